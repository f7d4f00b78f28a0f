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
  // Raw element kinds that checkpoints store (the caller's bytes, counters,
  // fp64 statistics) but nothing computes in: they have no STRATA_DTYPE_* or
  // CUDA code, and every part that computes refuses them (is_compute_dtype).
  kU8 = 3,
  kF64 = 4,
  kI32 = 5,
  kI64 = 6,
};

// fp32, bf16 or fp16: the kinds the optimizers, the device backends, the model
// ops and the C API compute in and convert between.
constexpr bool is_compute_dtype(DType d) {
  return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16;
}

constexpr size_t dtype_size(DType d) {
  switch (d) {
    case DType::kU8:
      return 1;
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF64:
    case DType::kI64:
      return 8;
  }
  return 1;  // outside the enum: never 0, so a size check cannot divide by zero
}

// "fp32", "bf16", "fp16", "u8", "fp64", "i32", "i64" ("?" for a value outside
// the enum). Checkpoint manifests store these names, so they never change.
// Defined in dtype.cpp; parse_dtype() (common/dtype_parse.h) is its inverse
// for the compute dtypes.
const char* dtype_name(DType d);

}  // namespace strata
