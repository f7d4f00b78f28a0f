// cleanup_checkpoint_leftovers: undoes what a crashed save left beside a
// checkpoint directory (runtime/checkpoint.h). Runs alone: not while another
// process may be saving to the same directory.
#include <dirent.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <string>
#include <vector>

#include "common/log.h"
#include "common/posix_file.h"
#include "runtime/checkpoint.h"

namespace strata {

Status cleanup_checkpoint_leftovers(const std::string& dir_in) {
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const std::string parent = parent_of(dir), base = base_of(dir);
  const std::string tmp_prefix = base + ".tmp-", old_prefix = base + ".old-";
  std::vector<std::string> tmps, olds;
  DIR* d = ::opendir(parent.c_str());
  if (!d) return Status::from_errno(errno, "listing " + parent);
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n.rfind(tmp_prefix, 0) == 0) tmps.push_back(join_path(parent, n));
    if (n.rfind(old_prefix, 0) == 0) olds.push_back(join_path(parent, n));
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

}  // namespace strata
