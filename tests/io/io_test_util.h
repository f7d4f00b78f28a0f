// Helpers shared by the io tests: temp directories, byte patterns, mounts.
#pragma once

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "common/tunables.h"
#include "io/io_engine.h"
#include "test_util/temp_dir.h"

namespace strata::io::testing {

// A temp directory named for these tests (test_util/temp_dir.h).
class TempDir : public ::strata::testing::TempDir {
 public:
  explicit TempDir(const char* base = nullptr) : ::strata::testing::TempDir("strata-io-test", base) {}
};

// Deterministic bytes that differ with position and seed.
inline void fill_pattern(void* p, std::size_t n, std::uint64_t seed) {
  auto* b = static_cast<unsigned char*>(p);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (std::size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b[i] = static_cast<unsigned char>(x >> 24);
  }
}

inline std::vector<std::string> backends() {
  return io_backends_built();
}

// Sets an environment variable for the scope and re-reads the tunables.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    ::setenv(name, value, 1);
    reload_tunables();
  }
  ~ScopedEnv() {
    if (had_)
      ::setenv(name_.c_str(), old_.c_str(), 1);
    else
      ::unsetenv(name_.c_str());
    reload_tunables();
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

}  // namespace strata::io::testing
