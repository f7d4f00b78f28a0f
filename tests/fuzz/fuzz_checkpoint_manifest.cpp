// Fuzz target: a checkpoint's index.json and manifest.rank0.json, as files
// (the reader's real path: open, size checks, strict JSON, self checksum,
// every field bounded). An input that is a JSON object gets its correct
// "self_crc32c" first, so the fuzzer gets past the checksum to the fields.
// The first byte picks the file. Accepted or refused, never a crash, a leak
// or an unbounded allocation.
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "runtime/checkpoint_manifest.h"

namespace {

// A plain buffer (no destructor): the atexit handler below runs after
// static objects are gone.
char g_dir[64] = "/tmp/strata-fuzz-manifest-XXXXXX";

std::string scratch_dir() {
  static const bool made = [] {
    if (!mkdtemp(g_dir)) std::abort();
    std::atexit([] {
      for (const char* f : {"/index.json", "/manifest.rank0.json"}) std::remove((std::string(g_dir) + f).c_str());
      ::rmdir(g_dir);
    });
    return true;
  }();
  (void)made;
  return g_dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool index = data[0] & 1;
  std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  nlohmann::json doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_object()) {
    doc.erase("self_crc32c");
    const uint32_t crc = strata::canonical_crc(doc);
    doc["self_crc32c"] = strata::hex32(crc);
    text = doc.dump();
  }
  const std::string dir = scratch_dir();
  const std::string file = dir + (index ? "/index.json" : "/manifest.rank0.json");
  std::remove((dir + "/index.json").c_str());
  std::remove((dir + "/manifest.rank0.json").c_str());
  FILE* f = std::fopen(file.c_str(), "wb");
  if (!f) std::abort();
  std::fwrite(text.data(), 1, text.size(), f);
  std::fclose(f);
  if (index) {
    (void)strata::parse_index(dir, 0, "fuzz");
  } else {
    (void)strata::parse_manifest(dir, 0, "fuzz");
  }
  return 0;
}
