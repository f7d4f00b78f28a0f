// Fuzz target: a whole .safetensors file held in memory (length field, JSON
// header, data region). Accepted or refused, never a crash, a leak or an
// unbounded allocation; an accepted header satisfies the reader's invariants.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto r = strata::model::parse_safetensors_file_bytes(bytes, "fuzz.safetensors");
  if (!r.ok()) return 0;
  uint64_t end = r->data_offset;
  for (const auto& t : r->tensors) {
    // Sorted by offset, inside the file, sized by shape x dtype, no overlap.
    if (t.offset < end || t.offset + t.nbytes > r->file_size) std::abort();
    if (t.numel() * strata::model::st_dtype_size(t.dtype) != t.nbytes) std::abort();
    end = t.offset + t.nbytes;
  }
  return 0;
}
