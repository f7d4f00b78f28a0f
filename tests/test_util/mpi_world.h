// One host backend and one MPI communicator over it for a test program run
// by mpirun (its own main: MPI is initialized once per process). Errors are
// printed; open_mpi_world returns false on any.
#pragma once

#include <cstdio>
#include <memory>

#include "comm/mpi_comm.h"
#include "device/host_backend.h"

namespace strata::testing {

struct MpiWorld {
  std::unique_ptr<DeviceBackend> dev;
  std::unique_ptr<comm::Communicator> comm;
};

// timeout_s: generous by default, as 3 ranks share 2 loaded cores in CI.
// budget_bytes: the host backend's (0: its default).
inline bool open_mpi_world(MpiWorld* w, double timeout_s = 120, uint64_t budget_bytes = 0) {
  HostBackendOptions ho;
  if (budget_bytes > 0) ho.budget_bytes = budget_bytes;
  auto dev = create_host_backend(ho);
  if (!dev.ok()) {
    std::fprintf(stderr, "host backend: %s\n", dev.status().to_string().c_str());
    return false;
  }
  comm::MpiCommOptions mo;
  mo.timeout_s = timeout_s;
  auto c = comm::create_mpi_communicator(dev->get(), mo);
  if (!c.ok()) {
    std::fprintf(stderr, "mpi communicator: %s\n", c.status().to_string().c_str());
    return false;
  }
  w->dev = std::move(*dev);
  w->comm = std::move(*c);
  return true;
}

}  // namespace strata::testing
