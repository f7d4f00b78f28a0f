#include <string>

#include "common/dtype.h"
#include "common/dtype_parse.h"

namespace strata {

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kF32: return "fp32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "fp16";
    case DType::kU8: return "u8";
    case DType::kF64: return "fp64";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
  }
  return "?";
}

Result<DType> parse_dtype(std::string_view n) {
  if (n == "fp32" || n == "f32" || n == "float32") return DType::kF32;
  if (n == "bf16" || n == "bfloat16") return DType::kBF16;
  if (n == "fp16" || n == "f16" || n == "float16") return DType::kF16;
  return Status(StatusCode::kInvalidArgument, "unknown dtype '" + std::string(n) + "' (expected fp32|bf16|fp16)");
}

}  // namespace strata
