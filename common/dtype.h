// Element types of Strata's buffers: one enum for the CPU optimizers, the
// device backends, the planner and checkpoints.
//
// Freestanding on purpose (only <stddef.h>/<stdint.h>): the NEON kernel is
// compile-checked with `clang --target=aarch64 -ffreestanding`.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace strata {

// Values are the C ABI's STRATA_DTYPE_* and the CUDA module's codes; never
// renumber.
enum class DType : uint8_t {
  kF32 = 0,
  kBF16 = 1,  // bfloat16: fp32 with the low 16 bits dropped, rounded to nearest even
  kF16 = 2,   // IEEE binary16
};

constexpr size_t dtype_size(DType d) { return d == DType::kF32 ? 4 : 2; }

// "fp32", "bf16", "fp16" ("?" for a value outside the enum). Defined in
// dtype.cpp; parse_dtype() (common/dtype_parse.h) is its inverse.
const char* dtype_name(DType d);

}  // namespace strata
