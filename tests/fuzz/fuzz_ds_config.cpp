// Fuzz target: a DeepSpeed-format config (the "strata" section included).
// Accepted or refused, never a crash, a leak or an unbounded allocation; an
// accepted config's resolved JSON parses back to the same resolved JSON.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/log.h"
#include "runtime/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  strata::ConfigNotes notes;
  auto r = strata::parse_config(text, "fuzz.json", &notes);
  if (!r.ok()) return 0;
  std::string resolved = strata::config_to_json(*r);
  auto again = strata::parse_config(resolved, "fuzz-resolved.json", &notes);
  if (!again.ok()) std::abort();
  if (strata::config_to_json(*again) != resolved) std::abort();
  return 0;
}
