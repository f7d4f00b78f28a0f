// cleanup_checkpoint_leftovers: undoes what a crashed save left beside a
// checkpoint directory (runtime/checkpoint.h). Runs alone: not while another
// process may be saving to the same directory.
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <string>
#include <vector>

#include "common/log.h"
#include "common/posix_file.h"
#include "runtime/checkpoint.h"
#include "runtime/checkpoint_manifest.h"

namespace strata {

namespace {

// Whether the token after `prefix` in `name` ("<pid>-<random>") names a live
// process on this host other than this one.
bool live_owner(const std::string& name, size_t prefix) {
  const size_t dash = name.find('-', prefix);
  if (dash == std::string::npos || dash == prefix) return false;
  long pid = 0;
  for (size_t i = prefix; i < dash; ++i) {
    if (name[i] < '0' || name[i] > '9' || pid > (1L << 30)) return false;
    pid = pid * 10 + (name[i] - '0');
  }
  if (pid <= 0 || pid == static_cast<long>(::getpid())) return false;
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

}  // namespace

Status cleanup_checkpoint_leftovers(const std::string& dir_in, bool keep_live_owners) {
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const std::string parent = parent_of(dir), base = base_of(dir);
  const std::string tmp_prefix = base + ".tmp-", old_prefix = base + ".old-";
  std::vector<std::string> tmps, olds;
  DIR* d = ::opendir(parent.c_str());
  if (!d) return Status::from_errno(errno, "listing " + parent);
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    const bool tmp = n.rfind(tmp_prefix, 0) == 0, old = n.rfind(old_prefix, 0) == 0;
    if ((tmp || old) && keep_live_owners && live_owner(n, tmp_prefix.size())) continue;
    if (tmp) tmps.push_back(join_path(parent, n));
    if (old) olds.push_back(join_path(parent, n));
  }
  ::closedir(d);
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0 && errno == ENOENT) {
    for (auto it = olds.begin(); it != olds.end(); ++it) {
      struct stat ist {};
      if (::stat(join_path(*it, "index.json").c_str(), &ist) != 0) continue;
      if (::rename(it->c_str(), dir.c_str()) != 0)
        return Status::from_errno(errno, "renaming " + *it + " back to " + dir);
      log_warn("checkpoint {}: restored the previous checkpoint from {} (a save was interrupted)", dir, *it);
      olds.erase(it);
      STRATA_RETURN_IF_ERROR(fsync_path(parent, true));
      break;
    }
  }
  Status first;
  for (const auto& p : tmps) {
    Status s = remove_tree(p);
    if (!s.ok() && first.ok()) first = s;
  }
  for (const auto& p : olds) {
    Status s = remove_tree(p);
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

Result<std::vector<std::string>> checkpoint_files(const std::string& dir) {
  const std::string prefix = "checkpoint " + dir;
  STRATA_ASSIGN_OR_RETURN(ParsedIndex index, parse_index(dir, 0, prefix));
  std::vector<std::string> files = {"index.json"};
  for (uint32_t r = 0; r < index.world_size; ++r) {
    STRATA_ASSIGN_OR_RETURN(ParsedManifest m, parse_manifest(dir, r, prefix));
    files.push_back(manifest_file_name(r));
    for (const CheckpointEntry& e : m.entries) files.push_back(e.file);
    if (m.has_extra_file) files.push_back(m.extra.file);
  }
  return files;
}

}  // namespace strata
