#include "common/threads.h"

#include <sys/resource.h>
#include <unistd.h>

#include <fstream>

namespace strata {

namespace {

std::string rlimit_text(int resource) {
  rlimit r{};
  if (::getrlimit(resource, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return "";
  return std::to_string(r.rlim_cur);
}

// The pids cgroup's limit of this process ("max" or absent: none), cgroup v2.
std::string pids_limit() {
  std::ifstream cg("/proc/self/cgroup");
  std::string line, path;
  while (std::getline(cg, line))
    if (line.rfind("0::", 0) == 0) path = line.substr(3);
  if (path.empty()) return "";
  std::ifstream f("/sys/fs/cgroup" + path + "/pids.max");
  std::string v;
  if (!(f >> v) || v == "max") return "";
  return v;
}

}  // namespace

std::string thread_limit_hint() {
  std::string parts;
  auto add = [&](const std::string& s) { parts += (parts.empty() ? "" : "; ") + s; };
  if (auto n = rlimit_text(RLIMIT_AS); !n.empty())
    add("the address space is limited to " + n + " bytes and each thread maps a stack: raise `ulimit -v`");
  // (root is not held to RLIMIT_NPROC)
  if (auto n = rlimit_text(RLIMIT_NPROC); !n.empty() && ::geteuid() != 0)
    add("this user may run " + n + " processes and threads: raise `ulimit -u`");
  if (auto n = pids_limit(); !n.empty()) add("this cgroup (container) may hold " + n + " tasks: pids.max");
  return parts.empty() ? "" : " (" + parts + ")";
}

Status thread_start_error(const std::string& what, const std::system_error& e) {
  return Status(StatusCode::kOutOfMemory, what + ": " + e.what() + thread_limit_hint());
}

Status out_of_memory_status(const char* what) noexcept {
  try {
    std::string msg = std::string(what) + ": out of memory";
    if (auto n = rlimit_text(RLIMIT_AS); !n.empty())
      msg += " (the address space is limited to " + n + " bytes: raise `ulimit -v`)";
    return Status(StatusCode::kOutOfMemory, std::move(msg));
  } catch (...) {
    return Status(StatusCode::kOutOfMemory, std::string());
  }
}

}  // namespace strata
