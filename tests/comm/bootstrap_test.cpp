// detect_launch over fake environments: mpirun, torchrun style, none, and
// every malformed or inconsistent setting refused by name.
#include "comm/bootstrap.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

namespace strata::comm {
namespace {

Result<LaunchInfo> detect(const std::map<std::string, std::string>& vars) {
  return detect_launch([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

void expect_refused(const std::map<std::string, std::string>& vars, const std::string& needle) {
  auto r = detect(vars);
  ASSERT_FALSE(r.ok()) << needle;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
}

TEST(Bootstrap, NoLauncherIsOneRank) {
  auto r = detect({});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->launcher, Launcher::kNone);
  EXPECT_EQ(r->rank, 0);
  EXPECT_EQ(r->world_size, 1);
}

TEST(Bootstrap, Mpirun) {
  auto r = detect({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "3"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->launcher, Launcher::kMpirun);
  EXPECT_EQ(r->rank, 2);
  EXPECT_EQ(r->world_size, 3);
  EXPECT_EQ(r->local_rank, 1);
  // Agreeing torchrun-style variables are fine; disagreeing ones are refused.
  EXPECT_TRUE(detect({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"RANK", "1"}, {"WORLD_SIZE", "2"}})
                  .ok());
  expect_refused({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"RANK", "0"}, {"WORLD_SIZE", "2"}},
                 "mpirun says rank 1 of 2");
}

TEST(Bootstrap, Torchrun) {
  auto r = detect({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "10.0.0.1"},
                   {"MASTER_PORT", "29500"}});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->launcher, Launcher::kTorchrun);
  EXPECT_EQ(r->rank, 1);
  EXPECT_EQ(r->world_size, 4);
  EXPECT_EQ(r->master_addr, "10.0.0.1");
  EXPECT_EQ(r->master_port, 29500);
  // One rank needs no master.
  EXPECT_TRUE(detect({{"RANK", "0"}, {"WORLD_SIZE", "1"}}).ok());
}

TEST(Bootstrap, MalformedAndInconsistentValuesAreRefusedByName) {
  const std::map<std::string, std::string> master = {{"MASTER_ADDR", "h"}, {"MASTER_PORT", "1234"}};
  auto with = [&](std::map<std::string, std::string> v) {
    v.insert(master.begin(), master.end());
    return v;
  };
  expect_refused(with({{"RANK", "x"}, {"WORLD_SIZE", "2"}}), "RANK='x' is not a decimal integer");
  expect_refused(with({{"RANK", "1 "}, {"WORLD_SIZE", "2"}}), "RANK='1 '");
  expect_refused(with({{"RANK", ""}, {"WORLD_SIZE", "2"}}), "RANK=''");
  expect_refused(with({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}), "RANK=-1 is out of range");
  expect_refused(with({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), "RANK=2 is not below WORLD_SIZE=2");
  expect_refused(with({{"RANK", "0"}, {"WORLD_SIZE", "0"}}), "WORLD_SIZE=0 is out of range");
  expect_refused(with({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "5"}}), "LOCAL_RANK=5 is not below");
  expect_refused(with({{"RANK", "0"}}), "RANK is set but WORLD_SIZE is not");
  expect_refused(with({{"WORLD_SIZE", "2"}}), "WORLD_SIZE is set but RANK is not");
  expect_refused({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}, "MASTER_ADDR is not");
  expect_refused({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}, "MASTER_PORT is not");
  expect_refused({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}},
                 "MASTER_PORT=70000 is out of range");
  expect_refused({{"MASTER_ADDR", "h"}}, "without RANK and WORLD_SIZE");
  expect_refused({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "3"}},
                 "OMPI_COMM_WORLD_RANK=3 is not below OMPI_COMM_WORLD_SIZE=3");
  expect_refused({{"OMPI_COMM_WORLD_SIZE", "3"}}, "OMPI_COMM_WORLD_SIZE is set but OMPI_COMM_WORLD_RANK is not");
}

}  // namespace
}  // namespace strata::comm
