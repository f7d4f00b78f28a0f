// Parsing of dtype names for command lines and config files.
#pragma once

#include <string_view>

#include "common/dtype.h"
#include "common/status.h"

namespace strata {

// Accepts "fp32"/"f32"/"float32", "bf16"/"bfloat16", "fp16"/"f16"/"float16":
// the compute dtypes only. The storage-only kinds ("u8", "fp64", "i32",
// "i64") are refused, since nothing a command line or config names computes
// in them.
// Errors: kInvalidArgument naming the value and what is accepted.
Result<DType> parse_dtype(std::string_view name);

}  // namespace strata
