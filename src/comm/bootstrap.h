// Bootstrap: which rank this process is, read from the launcher's
// environment.
//
//   mpirun (Open MPI): OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
//                      OMPI_COMM_WORLD_LOCAL_RANK; the MPI communicator
//                      (mpi_comm.h) then connects the ranks.
//   torchrun style:    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
//                      MASTER_PORT; no MPI: the ranks meet through the TCP
//                      rendezvous (rendezvous.h) at MASTER_ADDR:MASTER_PORT
//                      (what NCCL's unique id will travel over).
//   neither:           one rank (rank 0 of 1).
//
// Values are refused by name when malformed (not a decimal integer, out of
// range, rank >= world size, a port outside 1..65535) or inconsistent (both
// launchers' variables set with different values; a partial set, e.g. RANK
// without WORLD_SIZE). Nothing here blocks or touches the network.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "common/status.h"

namespace strata::comm {

enum class Launcher { kNone, kMpirun, kTorchrun };
const char* launcher_name(Launcher launcher);

struct LaunchInfo {
  Launcher launcher = Launcher::kNone;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;  // torchrun style only
  uint16_t master_port = 0;  // torchrun style only
};

// Looks a variable up: null when unset. The default reads the process
// environment (std::getenv); tests pass a map.
using EnvLookup = std::function<const char*(const char*)>;

// Errors: kInvalidArgument naming the variable and its value.
Result<LaunchInfo> detect_launch(const EnvLookup& env = nullptr);

}  // namespace strata::comm
