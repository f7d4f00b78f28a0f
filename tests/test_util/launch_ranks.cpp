// launch_ranks: starts N processes the way torchrun does, for tests of the
// torchrun-style launch without torch: each gets RANK, LOCAL_RANK,
// WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a MASTER_PORT that
// was free a moment ago (rank 0 serves the rendezvous there). Output goes
// where the launcher's goes.
//
//   launch_ranks [--timeout S] [--keep-going] [--master-addr A[,B...]] N PROGRAM [ARGS...]
//
// --master-addr: MASTER_ADDR instead of 127.0.0.1 ("::1", "localhost"); a
// list gives rank r the r-th address (the last for the ranks past its end),
// so that ranks name rank 0's host by IPv4 and by IPv6 in one job.
// Exit status: 0 when every rank exited 0; otherwise that of the first rank
// that failed (128 + signal when killed), after a line on stderr per failed
// rank. When a rank fails, the others get SIGTERM and, 15 s later, SIGKILL
// (torchrun's behaviour) unless --keep-going (tests of how the others end by
// themselves). After
// --timeout seconds (default 600) every rank still running is killed and the
// status is 124.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

int free_port() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof sa;
  if (s < 0 || ::bind(s, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 ||
      ::getsockname(s, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    std::perror("launch_ranks: picking a port");
    std::exit(2);
  }
  ::close(s);
  return ntohs(sa.sin_port);
}

int usage() {
  std::fprintf(stderr,
               "usage: launch_ranks [--timeout S] [--keep-going] [--master-addr A[,B...]] N PROGRAM [ARGS...]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  double timeout_s = 600;
  bool keep_going = false;
  std::vector<std::string> master_addrs{"127.0.0.1"};
  int i = 1;
  for (; i < argc && std::strncmp(argv[i], "--", 2) == 0; ++i) {
    if (std::strcmp(argv[i], "--timeout") == 0 && i + 1 < argc)
      timeout_s = std::atof(argv[++i]);
    else if (std::strcmp(argv[i], "--keep-going") == 0)
      keep_going = true;
    else if (std::strcmp(argv[i], "--master-addr") == 0 && i + 1 < argc) {
      master_addrs.clear();
      std::string list = argv[++i];
      for (std::size_t at = 0, end; at <= list.size(); at = end + 1) {
        end = std::min(list.find(',', at), list.size());
        master_addrs.push_back(list.substr(at, end - at));
      }
    } else
      return usage();
  }
  if (argc - i < 2) return usage();
  const int n = std::atoi(argv[i]);
  if (n < 1) return usage();
  char** cmd = argv + i + 1;
  const std::string port = std::to_string(free_port()), world = std::to_string(n);

  std::vector<pid_t> pids(static_cast<std::size_t>(n), -1);
  for (int r = 0; r < n; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("launch_ranks: fork");
      return 2;
    }
    if (pid == 0) {
      const std::string rank = std::to_string(r);
      ::setenv("RANK", rank.c_str(), 1);
      ::setenv("LOCAL_RANK", rank.c_str(), 1);
      ::setenv("WORLD_SIZE", world.c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", world.c_str(), 1);
      ::setenv("MASTER_ADDR", master_addrs[std::min<std::size_t>(r, master_addrs.size() - 1)].c_str(), 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      ::execvp(cmd[0], cmd);
      std::fprintf(stderr, "launch_ranks: cannot run %s: %s\n", cmd[0], std::strerror(errno));
      ::_exit(127);
    }
    pids[r] = pid;
  }

  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  auto kill_at = Clock::time_point::max();  // after a failure: SIGKILL to those left
  int status_out = 0, running = n;
  bool timed_out = false;
  while (running > 0) {
    int st = 0;
    const pid_t pid = ::waitpid(-1, &st, WNOHANG);
    if (pid < 0) break;
    if (pid == 0) {
      const auto now = Clock::now();
      if ((now >= deadline && !timed_out) || now >= kill_at) {
        if (now >= deadline && !timed_out) {
          timed_out = true;
          std::fprintf(stderr, "launch_ranks: timed out after %g s; killing the ranks still running\n", timeout_s);
        }
        kill_at = Clock::time_point::max();
        for (pid_t p : pids)
          if (p > 0) ::kill(p, SIGKILL);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    int r = 0;
    while (r < n && pids[r] != pid) ++r;
    if (r == n) continue;
    pids[r] = -1;
    --running;
    const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (code == 0) continue;
    std::fprintf(stderr, "launch_ranks: rank %d %s %d\n", r, WIFEXITED(st) ? "exited with status" : "killed by signal",
                 WIFEXITED(st) ? code : WTERMSIG(st));
    if (status_out == 0) {
      status_out = code;
      if (!keep_going) {
        for (pid_t p : pids)
          if (p > 0) ::kill(p, SIGTERM);
        kill_at = Clock::now() + std::chrono::seconds(15);
      }
    }
  }
  return timed_out ? 124 : status_out;
}
