// The memory-bandwidth ceiling the optimizer is measured against: b[i] +=
// s * c[i], a read-modify-write stream like the optimizer's (reads 8, writes
// 4 bytes per element), run with the same ISA, block size and oneTBB thread
// setup as step(). `strata bench adam` reports the optimizer's effective GB/s
// as a ratio to this kernel's, measured in the same run.
//
// Ownership/threads/blocking as in optimizer.h.
#pragma once

#include <cstddef>

#include "common/status.h"
#include "cpu_optim/optimizer.h"

namespace strata::cpu_optim {

inline constexpr std::size_t kMembwBytesPerElement = 12;

// Errors: kInvalidArgument (null with count > 0), kUnavailable (ISA).
Status membw_rmw(float* b, const float* c, float s, std::size_t count, const ExecOptions& exec = {});

}  // namespace strata::cpu_optim
