// What collectives_test.cpp needs from the program that runs it (mpi_main.cpp
// or tcp_main.cpp): the host backend and communicator every test shares, and
// how to make another communicator of the same backend over the same ranks.
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace strata::comm {

struct World {
  std::unique_ptr<DeviceBackend> dev;
  std::unique_ptr<Communicator> comm;
};
extern World* g_world;

// Collective: every rank calls it at the same point.
Result<std::unique_ptr<Communicator>> make_communicator(DeviceBackend* dev, double timeout_s);

}  // namespace strata::comm
