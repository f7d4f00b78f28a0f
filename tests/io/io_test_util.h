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

namespace strata::io::testing {

// A fresh directory under STRATA_TEST_DIR (else /tmp), removed with its
// contents at the end of the test.
class TempDir {
 public:
  explicit TempDir(const char* base = nullptr) {
    const char* env = std::getenv("STRATA_TEST_DIR");
    std::string root = base ? base : (env && *env ? env : "/tmp");
    std::string tmpl = root + "/strata-io-test-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data())) path_ = buf.data();
  }
  ~TempDir() {
    if (path_.empty()) return;
    for (auto it = mounts_.rbegin(); it != mounts_.rend(); ++it) umount2(it->c_str(), MNT_DETACH);
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

  // Mounts a filesystem (tmpfs/ramfs) at <path>/<name>; false when not
  // permitted here (no CAP_SYS_ADMIN in this container).
  bool mount_fs(const std::string& name, const char* type, const char* data, unsigned long flags = 0) {
    std::string target = file(name);
    ::mkdir(target.c_str(), 0700);
    if (::mount(type, target.c_str(), type, flags, data) != 0) return false;
    mounts_.push_back(target);
    return true;
  }

 private:
  std::string path_;
  std::vector<std::string> mounts_;
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
