#include <string>

#include "common/dtype.h"
#include "common/dtype_parse.h"
#include "common/enum_names.h"

namespace strata {

// The first row of a value is its name; the rows after are aliases
// parse_dtype() accepts.
template <>
inline constexpr auto kEnumNames<DType> = std::to_array<EnumName<DType>>({
    {DType::kF32, "fp32"},
    {DType::kBF16, "bf16"},
    {DType::kF16, "fp16"},
    {DType::kF32, "f32"},
    {DType::kF32, "float32"},
    {DType::kBF16, "bfloat16"},
    {DType::kF16, "f16"},
    {DType::kF16, "float16"},
});

const char* dtype_name(DType d) { return enum_name(d); }

Result<DType> parse_dtype(std::string_view n) {
  if (std::optional<DType> d = find_enum<DType>(n)) return *d;
  return Status(StatusCode::kInvalidArgument,
                "unknown dtype '" + std::string(n) + "' (expected " + enum_name_list<DType>("|") + ")");
}

}  // namespace strata
