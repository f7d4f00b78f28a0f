// rendezvous_probe: one rank of a torchrun-style job runs the rendezvous
// (comm/rendezvous.h) `rounds` times, as `rounds` communicators would, and
// prints what it got; tests/comm/torchrun_rendezvous_test.py launches it under
// torchrun (whose agent serves torch's TCPStore on MASTER_PORT) and next to a
// store that torch.distributed's rank 0 serves, and compares the ranks' lines.
//
//   RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. rendezvous_probe [rounds] [timeout_s] [hold]
// Prints "rank R round K blob <hex>" per round; exit 1 with the error.
// "hold": rank 0 holds the store it serves (rendezvous.h) until it exits, as
// a communicator does: the later rounds meet through it.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "comm/bootstrap.h"
#include "comm/rendezvous.h"

using namespace strata;

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 2;
  const double timeout_s = argc > 2 ? std::atof(argv[2]) : 60;
  auto li = comm::detect_launch();
  if (!li.ok()) {
    std::fprintf(stderr, "rendezvous_probe: %s\n", li.status().to_string().c_str());
    return 1;
  }
  const bool hold = argc > 3 && std::string(argv[3]) == "hold";
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  std::vector<std::shared_ptr<void>> held;
  for (int k = 0; k < rounds; ++k) {
    comm::RendezvousOptions o;
    o.addr = li->master_addr;
    o.port = li->master_port;
    o.rank = li->rank;
    o.world_size = li->world_size;
    o.timeout_s = timeout_s;
    o.key = std::string("probe/") + (restart ? restart : "0") + "/" + std::to_string(k);
    std::shared_ptr<void> h;
    if (hold) o.hold = &h;
    // Rank 0's blob differs per run and round: a stale one would show.
    const std::string text = "pid " + std::to_string(::getpid()) + " round " + std::to_string(k);
    std::vector<uint8_t> mine;
    if (li->rank == 0) mine.assign(text.begin(), text.end());
    auto got = comm::rendezvous_broadcast(o, mine);
    if (!got.ok()) {
      std::fprintf(stderr, "rendezvous_probe rank %d round %d: %s\n", li->rank, k, got.status().to_string().c_str());
      return 1;
    }
    if (h) held.push_back(std::move(h));
    std::string hex;
    for (uint8_t b : *got) {
      char h[3];
      std::snprintf(h, sizeof h, "%02x", b);
      hex += h;
    }
    std::printf("rank %d round %d blob %s\n", li->rank, k, hex.c_str());
    std::fflush(stdout);
  }
  return 0;
}
