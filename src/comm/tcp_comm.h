// TcpCommunicator: the Communicator over TCP sockets between the ranks, for
// host-backend buffers: how host ranks launched torchrun-style (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT; no mpirun) meet, and what a build
// without MPI uses. Always built (POSIX sockets only).
//
// Connecting. Every rank listens on a port the kernel picks, on every
// interface, IPv4 and IPv6 alike (socket_io.h). Rank 0's port travels to the
// others through the TCP rendezvous (rendezvous.h: torchrun's TCPStore at
// MASTER_ADDR:MASTER_PORT, or one rank 0 serves there, and with
// TcpCommOptions::hold_store holds for the communicator's life, so a second
// job given that port fails at once), with a random job token. Each other rank connects to rank 0 at MASTER_ADDR (each address it
// resolves to, in turn) and says its rank, the world size, the token and its
// own port; once all have come, rank 0 answers each with the table of every
// rank's address, IPv4 or IPv6 (as rank 0 saw it; a rank that came over
// loopback, 127/8 or ::1, is on rank 0's host and is reached at MASTER_ADDR)
// and port. Then rank r connects to ranks 1 .. r-1 and accepts ranks
// r+1 .. N-1: one connection per pair of ranks, TCP_NODELAY. A connection
// that does not present the token (a rank of another job, a port scanner) is
// closed and ignored. An IPv6 link-local address (fe80::/10) in the table is
// not usable from another host (its scope is rank 0's interface): give the
// hosts routable addresses.
//
// Moving data. The collectives are P2pCommunicator's (p2p_communicator.h: its
// algorithms and rank-order sums, so results are bit-identical to the MPI
// backend's and to a 1-rank sum). One progress thread per communicator owns
// the sockets: it writes each peer's queued messages in the order they were
// posted and reads every peer's messages as they come. A message is a
// header (collective sequence number, phase, byte count) and the bytes; it
// lands in the buffer of the matching posted receive, or, when it arrives
// first, in memory of its own until that receive is posted (so a peer's
// sends never wait for this rank's progress, and no two collectives block
// each other). Several collectives (on different streams) run at once.
//
// Failure. A collective not done `timeout_s` after it started running fails
// with kUnavailable naming the rank it waits for. A peer whose connection
// closes or fails (the process exited or was killed, its communicator
// broke) fails at once every collective that still waits on it, naming the
// rank: "all_reduce #3 on rank 0 of 3 (tcp): rank 2 closed its connection
// (its process exited or was killed, or its communicator broke)". Either
// breaks the communicator (communicator.h): it sends each peer an abort
// frame with its reason (where the connection is between two messages),
// then its progress thread stops and every socket is closed, so the other
// ranks learn of it at once too. A rank that receives an abort frame fails
// every collective it runs, now and later, with the sender's reason and
// status code: "all_reduce #3 on rank 0 of 3 (tcp): rank 1 gave up:
// all_reduce #3 on rank 1 of 3 (tcp): timed out after 90 s waiting for rank
// 2 (...)": the rank at fault is named on every rank, not only on those
// that waited on it, and none waits out its own timeout.
//
// Connecting fails the same way: kUnavailable when a rank has not come
// within `timeout_s` (naming it where known), kInvalidArgument when ranks
// disagree on the world size.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "comm/communicator.h"

namespace strata::comm {

struct TcpCommOptions {
  std::string master_addr;   // MASTER_ADDR: rank 0's host (name, IPv4 or IPv6 address; see rendezvous.h)
  uint16_t master_port = 0;  // MASTER_PORT: the rendezvous store's port
  int rank = 0;
  int world_size = 1;
  double timeout_s = 300.0;  // connecting, and each collective from when it starts running; > 0
  // Names this communicator's exchange in the store (rendezvous.h's key):
  // every rank passes the same, distinct per communicator of a job.
  std::string key = "tcp/0";
  std::string taken_hint;  // rendezvous.h: what a taken key means here ("": another job)
  bool hold_store = false;  // rank 0 holds the store it served for the communicator's life (communicator.h)
};

// Collective over the ranks (every rank calls it, in the same order as its
// other communicators). `device` must be a host backend and outlive the
// communicator. With world_size 1 nothing is opened. Destroy the
// communicator only once no collective of it is queued (synchronize the
// streams first). Errors: kInvalidArgument (null or CUDA device, bad rank or
// world size, timeout <= 0), those of rendezvous_broadcast() and the
// connecting above.
Result<std::unique_ptr<Communicator>> create_tcp_communicator(DeviceBackend* device, const TcpCommOptions& options);

}  // namespace strata::comm
