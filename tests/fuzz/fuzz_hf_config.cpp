// Fuzz target: a Hugging Face config.json. Accepted or refused, never a
// crash, a leak or an unbounded allocation; an accepted config validates and
// survives a write -> parse round trip unchanged.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "model/llama_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  auto r = strata::model::parse_llama_config(text, "fuzz/config.json");
  if (!r.ok()) return 0;
  if (!strata::model::validate_llama_config(*r).ok()) std::abort();
  auto again = strata::model::parse_llama_config(strata::model::llama_config_to_json(*r), "fuzz/roundtrip.json");
  if (!again.ok()) std::abort();
  if (strata::model::llama_config_to_json(*again) != strata::model::llama_config_to_json(*r)) std::abort();
  return 0;
}
