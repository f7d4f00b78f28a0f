// test_comm_tcp's main: collectives_test.cpp over the TCP backend, under
// launch_ranks (tests/test_util/launch_ranks.cpp: torchrun's environment
// without torch). create_communicator() picks tcp from that environment, as
// the trainer and the Python package do.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>

#include "comm/communicator.h"
#include "device/host_backend.h"
#include "ranks_world.h"

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
  using namespace strata;
  auto dev = create_host_backend(HostBackendOptions{});
  if (!dev.ok()) {
    std::fprintf(stderr, "host backend: %s\n", dev.status().to_string().c_str());
    return 1;
  }
  // Generous: 3 ranks share 2 loaded cores in CI.
  auto comm = comm::make_communicator(dev->get(), 120);
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
