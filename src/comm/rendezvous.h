// TCP rendezvous: how ranks launched torchrun-style (no mpirun) first meet,
// and rank 0 hands every rank one blob (the NCCL unique id).
//
// It speaks the key-value protocol of torch's TCPStore (c10d), so that it
// works where torchrun is the launcher: torchrun's agent already serves a
// TCPStore on MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE), as does
// torch.distributed.init_process_group's rank 0, and the port is taken. Rank 0
// connects there first; where nothing listens (a launcher that only sets the
// variables) it serves the few requests itself on that port, on every
// interface, IPv4 and IPv6 alike, until every rank has its answer, and
// closes it (or holds it: "Holding the port" below). MASTER_ADDR is a host name, IPv4 or IPv6 address ("::1", no
// brackets, as torch.distributed reads it); every address it resolves to is
// tried in turn (socket_io.h).
//
// Keys, under "strata/rendezvous/<key>/" (RendezvousOptions::key: a store
// outlives one job attempt and one engine):
//   leader    ADD 1 by rank 0: over 1 means another rank 0 leads this key
//   blob      rank 0: "STRATARV", u32 version (3), u32 world size, u64 ms
//             until rank 0 decides, the blob; once the ranks have met,
//             world size 0 and no blob ("ended")
//   joined/<r> ADD 1 by rank r: over 1 means two processes say rank r
//   ack/<r>   rank r: "" (ok) or why it refuses (another world size, a
//             second process with that rank)
//   refused   a refusing rank: its reason (rank 0 decides at once); also
//             a rank of another version, naming both
//   failed    a rank that failed before the ranks met (rendezvous_refuse):
//             its reason; rank 0 then serves the verdict a while (15 s) to
//             ranks still to come
//   fetched/<r> rank r, once it has read the verdict (rank 0 through a
//             store waits for every one)
//   verdict   rank 0, once every ack is in, a refusal came or the timeout
//             passed: u32 status code (0 ok) and the error text
// A rank 0 that finds the leader key taken in the store it reached (another
// job's rank 0 serving or holding the same MASTER_PORT, or a second RANK=0;
// or taken_hint) fails with kAlreadyExists saying so, instead of mixing the
// two jobs' ranks. The counts are the store's ADD, atomic: two rank 0s, or
// two processes given one rank, cannot both count first.
// Every rank returns the verdict: a refusal or a missing rank ("never came:
// rank 2") reaches every rank that came, prefixed "rank 0 refused the
// rendezvous" on ranks other than 0; a rank waits for it as long as rank 0
// takes to decide (the blob says how long) and 5 s more, whatever its own
// timeout. A refusal ends rank 0's wait at once (a rank given another
// WORLD_SIZE does not leave rank 0 waiting for ranks that will never come).
// A rank that finds the exchange ended fails at once with kAlreadyExists:
// it came after its job's ranks met (a second process given its RANK), or
// it is another job's on the same MASTER_PORT.
//
// Holding the port. Where rank 0 served the store itself and
// RendezvousOptions::hold is given, it goes on serving it in a thread of
// its own until the handle is released (the communicator's life), as
// torch's rank-0 TCPStore does for its process group: MASTER_PORT stays
// taken, so a second job given that port fails at once, loudly (its rank 0
// finds the leader key taken, its other ranks find the exchange ended);
// later exchanges of this job meet through it. Caveats: a torch.distributed
// process group made later on the same MASTER_PORT cannot bind it (hence
// CommOptions::hold_store, off by default); a child made by a plain fork()
// while it is held keeps the listening socket (an exec closes it).
//
// A rank that cannot reach MASTER_ADDR keeps retrying (rank 0 may
// not listen yet, or its previous exchange's store is closing) until its
// timeout; a connect that reached itself (the kernel picked MASTER_PORT as
// its source port: net::self_connected) counts as nothing listening yet.
// The TCP communicator's ranks listen on any port but MASTER_PORT
// (net::listen_on_other_port), which rank 0 may still have to serve.
//
// The TCPStore wire format used (integers little-endian; a string = u64
// length + bytes): VALIDATE(0) u32 0x3C85F7CE; PING(13) u32 n -> u32 n;
// SET(1) key value; GET(3) key -> value; CHECK(5) u64 k, k keys -> u8 (0
// ready); WAIT(6) u64 k, k keys -> u8 0 once all exist; CANCEL_WAIT(12) -> u8 1;
// ADD(4) key i64 -> i64 (the value a decimal string, absent 0, plus i64).
// Checked against torch 2.15's store (tests/comm/torchrun_rendezvous_test.py).
//
// Blocking: the call returns when the exchange is done or failed; no thread is
// left behind and every socket is closed (but the held store's, above).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace strata::comm {

struct RendezvousOptions {
  std::string addr;       // rank 0's address (MASTER_ADDR): host name, IPv4 or IPv6 address
  uint16_t port = 0;      // MASTER_PORT: a TCPStore there, or rank 0 serves one on every interface
  int rank = 0;
  int world_size = 1;
  double timeout_s = 300;  // for the whole exchange, > 0
  // Names this exchange among others in the same store (every rank passes the
  // same): the job attempt and the communicator's sequence number.
  std::string key = "0";
  // Rank 0: what a blob already under `key` means where the key cannot name
  // the attempt (a restart on several torchrun nodes); "": another job's rank
  // 0 on the same MASTER_PORT, or a second RANK=0.
  std::string taken_hint;
  // Rank 0 where it served the store itself: receives the handle that keeps
  // serving it (see "Holding the port"); released, the port is let go.
  // Untouched elsewhere. Null: the store closes when the call returns.
  std::shared_ptr<void>* hold = nullptr;
};

// Returns rank 0's `root_blob` on every rank (rank 0 gets its own back;
// others pass an empty one). With world_size 1, no socket is opened.
// Errors: kInvalidArgument (bad options; a peer with another world size),
// kUnavailable (timeout: which ranks never came, or that rank 0 could not be
// reached), kIoError (socket calls; MASTER_PORT taken by something that is
// not a TCPStore), each naming addr:port and the rank.
Result<std::vector<uint8_t>> rendezvous_broadcast(const RendezvousOptions& options,
                                                  const std::vector<uint8_t>& root_blob);

// Rank 0's blob, made on demand.
using BlobMaker = std::function<Result<std::vector<uint8_t>>()>;

// Rank 0's blob from `make`, wherever it travels (this rendezvous, or the MPI
// broadcast under mpirun: mpi_comm.h): the maker's result, or why there is
// none, with its status code (an exception: kInternal with its text; no
// maker, or a blob longer than `max_bytes`: kInvalidArgument).
Result<std::vector<uint8_t>> run_blob_maker(const BlobMaker& make, std::size_t max_bytes);

// The same, rank 0's blob made by `make_root_blob` (rank 0 only, once) when
// MASTER_PORT is already taken, by the store rank 0 reached there (after
// the handshake and the leader check) or by its own listener. So a listener
// the maker opens on a port the kernel picks (NCCL's bootstrap root, which
// ncclGetUniqueId starts) cannot take MASTER_PORT from the exchange (after
// it, with the store not held, other listeners of the job may). A maker that
// fails (an error or an exception) refuses the exchange, so every rank hears
// why ("rank 0 could not make its blob: ..."), with the maker's status code.
Result<std::vector<uint8_t>> rendezvous_broadcast_lazy(const RendezvousOptions& options,
                                                       const BlobMaker& make_root_blob);

// For a rank that failed before it could meet the others (its model or data
// unreadable, ...): the exchange `options` names is refused with "rank R
// failed before the ranks met: <why>", so every other rank fails at once
// with that text instead of waiting out its timeout. Rank r > 0 publishes it
// once a store answers at MASTER_PORT (waiting for one up to the timeout);
// rank 0 publishes it as its verdict and, where it serves the store itself,
// serves until every rank has fetched it or refused too (or the timeout).
// OK once published; the errors of rendezvous_broadcast() otherwise (a
// timeout: nobody came to hear it). With world_size 1, nothing.
Status rendezvous_refuse(const RendezvousOptions& options, const std::string& why);

}  // namespace strata::comm
