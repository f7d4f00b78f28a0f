// SelfCommunicator: the one-rank Communicator (rank 0 of 1), always
// available on any device backend. Every collective is a stream-ordered copy
// (all_gather, reduce_scatter and all_reduce copy send to recv; broadcast and
// barrier are no-ops that still check their arguments): the 1-rank reference
// that an N-rank run is compared to, and what a job without a launcher uses.
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace strata::comm {

// `device` must outlive the communicator. Errors: kInvalidArgument (null device).
Result<std::unique_ptr<Communicator>> create_self_communicator(DeviceBackend* device);

}  // namespace strata::comm
