// TCP rendezvous: how ranks launched torchrun-style (no mpirun) first meet.
// Rank 0 listens on MASTER_ADDR:MASTER_PORT (bootstrap.h's LaunchInfo), the
// other ranks connect, and rank 0 sends every rank one blob (the NCCL unique
// id, later). Loopback or across hosts; one exchange per call.
//
// Protocol (all integers little-endian, the machines' own order on x86/arm):
//   rank r -> rank 0: "STRATARV", u32 version (1), u32 rank, u32 world size
//   rank 0 -> rank r: u32 status code (0 = ok), u64 length, then the blob (ok)
//                     or the error text
// Rank 0 checks every hello: the world size must be its own, the rank in
// 1..world-1 and not seen before. On a bad hello or a timeout, rank 0 sends
// the error to every rank that connected and returns it; those ranks return
// it too, prefixed with "rank 0 refused the rendezvous". A rank that cannot
// reach rank 0 keeps retrying (rank 0 may not listen yet) until its timeout.
//
// Blocking: the call returns when the exchange is done or failed; no thread is
// left behind and every socket is closed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace strata::comm {

struct RendezvousOptions {
  std::string addr;       // rank 0's address (MASTER_ADDR): host name or IPv4
  uint16_t port = 0;      // MASTER_PORT; rank 0 listens on it on every interface
  int rank = 0;
  int world_size = 1;
  double timeout_s = 300;  // for the whole exchange, > 0
};

// Returns rank 0's `root_blob` on every rank (rank 0 gets its own back;
// others pass an empty one). With world_size 1, no socket is opened.
// Errors: kInvalidArgument (bad options; a peer with another world size, a
// rank out of range or twice), kUnavailable (timeout: which ranks never came,
// or that rank 0 could not be reached), kIoError/kAlreadyExists (socket
// calls, e.g. the port in use), each naming addr:port and the rank.
Result<std::vector<uint8_t>> rendezvous_broadcast(const RendezvousOptions& options,
                                                  const std::vector<uint8_t>& root_blob);

}  // namespace strata::comm
