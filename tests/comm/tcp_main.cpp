// test_comm_tcp's main: collectives_test.cpp over the TCP backend, under
// launch_ranks (tests/test_util/launch_ranks.cpp: torchrun's environment
// without torch). create_communicator() picks tcp from that environment, as
// the trainer and the Python package do. A rank given an IPv6 MASTER_ADDR
// ("::1") where this machine has no IPv6 loopback exits 77 (ctest: skipped),
// saying why.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "comm/communicator.h"
#include "device/host_backend.h"
#include "ranks_world.h"
#include "test_util/ipv6.h"

namespace strata::comm {

World* g_world = nullptr;

Result<std::unique_ptr<Communicator>> make_communicator(DeviceBackend* dev, double timeout_s) {
  CommOptions co;
  co.timeout_s = timeout_s;
  auto made = create_communicator(dev, co);
  // (One rank is the self backend's.)
  if (made.ok() && (*made)->world_size() > 1 && std::strcmp((*made)->backend_name(), "tcp") != 0)
    return Status(StatusCode::kInternal, fmt::format("expected the tcp backend, got {}", (*made)->backend_name()));
  return made;
}

}  // namespace strata::comm

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // Line by line: a rank that launch_ranks kills at its timeout has shown how
  // far it got (a pipe's full buffer would be lost with it).
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  using namespace strata;
  const char* master = std::getenv("MASTER_ADDR");
  if (master != nullptr && std::strchr(master, ':') != nullptr) {
    if (auto why = test::ipv6_loopback_missing(); !why.empty()) {
      if (test::ipv6_required()) {
        std::printf("FAIL (STRATA_REQUIRE_IPV6=1): MASTER_ADDR=%s: %s\n", master, why.c_str());
        return 1;
      }
      std::printf("SKIP: MASTER_ADDR=%s: %s\n", master, why.c_str());
      return 77;
    }
  }
  auto dev = create_host_backend(HostBackendOptions{});
  if (!dev.ok()) {
    std::fprintf(stderr, "host backend: %s\n", dev.status().to_string().c_str());
    return 1;
  }
  // Generous (3 ranks share 2 loaded cores in CI), and shorter than
  // launch_ranks' --timeout in CMakeLists.txt (110 s at least): ranks that
  // fail to meet say why instead of being killed.
  auto comm = comm::make_communicator(dev->get(), 90);
  if (!comm.ok()) {
    std::fprintf(stderr, "tcp communicator: %s\n", comm.status().to_string().c_str());
    return 1;
  }
  if ((*comm)->world_size() < 2) std::fprintf(stderr, "warning: 1 rank; run under launch_ranks 2 or more\n");
  comm::World world{std::move(*dev), std::move(*comm)};
  comm::g_world = &world;
  const int rc = RUN_ALL_TESTS();
  world.comm.reset();
  world.dev.reset();
  return rc;
}
