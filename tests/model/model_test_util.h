// Helpers shared by the model tests: temp directories, building safetensors
// bytes by hand (independently of the writer under test).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>
#include "test_util/temp_dir.h"

namespace strata::model::testing {

// A temp directory named for these tests (test_util/temp_dir.h).
class TempDir : public ::strata::testing::TempDir {
 public:
  explicit TempDir(const char* base = nullptr) : ::strata::testing::TempDir("strata-model-test", base) {}
};

// An 8-byte little-endian length, the header text, then `data`.
inline std::string st_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + header + data;
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace strata::model::testing
