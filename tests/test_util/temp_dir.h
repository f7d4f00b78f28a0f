// A fresh directory for one test: under STRATA_TEST_DIR (else /tmp, or a
// given base), removed with its contents (and any filesystem the test mounted
// in it) when the test ends. Shared by every test folder.
#pragma once

#include <sys/mount.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace strata::testing {

class TempDir {
 public:
  // `prefix` names the directory (e.g. "strata-engine"), so a leftover says
  // which test left it.
  explicit TempDir(const char* prefix = "strata-test", const char* base = nullptr) {
    const char* env = std::getenv("STRATA_TEST_DIR");
    const std::string root = base ? base : (env && *env ? env : "/tmp");
    std::string tmpl = root + "/" + prefix + "-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data())) path_ = buf.data();
  }
  ~TempDir() {
    if (path_.empty()) return;
    for (auto it = mounts_.rbegin(); it != mounts_.rend(); ++it) ::umount2(it->c_str(), MNT_DETACH);
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

  // Mounts a filesystem (tmpfs, ramfs) at <path>/<name>; false when not
  // permitted here (no CAP_SYS_ADMIN in this container).
  bool mount_fs(const std::string& name, const char* type, const char* data, unsigned long flags = 0) {
    const std::string target = file(name);
    ::mkdir(target.c_str(), 0700);
    if (::mount(type, target.c_str(), type, flags, data) != 0) return false;
    mounts_.push_back(target);
    return true;
  }
  bool mount_tmpfs(const std::string& name, const char* data) { return mount_fs(name, "tmpfs", data); }

 private:
  std::string path_;
  std::vector<std::string> mounts_;
};

}  // namespace strata::testing
