#include <string>

#include "common/dtype.h"
#include "common/dtype_parse.h"
#include "common/enum_names.h"

namespace strata {

// The first row of a value is its name; the rows after are aliases
// find_enum() accepts. The storage-only kinds (u8, fp64, i32, i64) have names
// (checkpoint manifests spell them) but parse_dtype() refuses them.
template <>
inline constexpr auto kEnumNames<DType> = std::to_array<EnumName<DType>>({
    {DType::kF32, "fp32"},
    {DType::kBF16, "bf16"},
    {DType::kF16, "fp16"},
    {DType::kU8, "u8"},
    {DType::kF64, "fp64"},
    {DType::kI32, "i32"},
    {DType::kI64, "i64"},
    {DType::kF32, "f32"},
    {DType::kF32, "float32"},
    {DType::kBF16, "bfloat16"},
    {DType::kF16, "f16"},
    {DType::kF16, "float16"},
});

const char* dtype_name(DType d) { return enum_name(d); }

Result<DType> parse_dtype(std::string_view n) {
  if (std::optional<DType> d = find_enum<DType>(n); d && is_compute_dtype(*d)) return *d;
  return Status(StatusCode::kInvalidArgument, "unknown dtype '" + std::string(n) + "' (expected fp32|bf16|fp16)");
}

}  // namespace strata
