// P2pCommunicator: the collectives of communicator.h built from point-to-
// point transfers, shared by the backends whose transport has no reduction
// Strata may use (MPI: mpi_comm.cpp; TCP sockets: tcp_comm.cpp). A backend
// says how to post a transfer, wait for an op's transfers and abandon them;
// this class owns the algorithms, their fixed rank-order sums, the sequence
// numbers, running on the stream and the broken state.
//
// Algorithms (every transfer of a collective is posted before it waits):
//   all_gather      own slot to every peer, every peer's slot from it;
//   reduce_scatter  slice p to peer p, slice rank() from every peer, then
//                   the rank-order sum;
//   all_reduce      phase 0: chunk p to peer p, chunk rank() from every
//                   peer, rank-order sum into chunk rank(); phase 1: the
//                   summed chunk to every peer, theirs from them;
//   broadcast       root to every other rank;
//   barrier         an empty message to and from every peer.
// A (peer, phase) pair carries at most one transfer per direction and
// collective, so a backend may match messages by (sequence, phase, peer).
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace strata::comm {

// One collective while it runs; backends derive their own (requests, state).
struct P2pOp {
  const char* name = "";
  uint64_t seq = 0;
  int rank = 0;
  int world = 1;
  const char* backend = "";
  std::chrono::steady_clock::time_point start;
  // Staging the op's transfers land in (reduce_scatter, all_reduce): owned
  // by the op, which outlives abandon(), so no transfer of a failed op can
  // land in freed memory.
  std::shared_ptr<std::vector<float>> stage;

  virtual ~P2pOp() = default;
  // "all_reduce #7 on rank 0 of 3 (mpi)": how errors start.
  std::string where() const;
};

class P2pCommunicator : public Communicator {
 public:
  int rank() const final { return rank_; }
  int world_size() const final { return world_; }
  DeviceBackend* device() const final { return device_; }

  Status all_gather(const void* send, void* recv, std::size_t bytes_per_rank, DeviceStream* stream) final;
  Status reduce_scatter(const float* send, float* recv, std::size_t count, DeviceStream* stream) final;
  Status all_reduce(const float* send, float* recv, std::size_t count, DeviceStream* stream) final;
  Status broadcast(void* data, std::size_t bytes, int root, DeviceStream* stream) final;
  Status barrier(DeviceStream* stream) final;

 protected:
  P2pCommunicator(DeviceBackend* device, int rank, int world, double timeout_s)
      // (At most 1e9 s: a deadline further off would overflow the clock.)
      : device_(device), rank_(rank), world_(world), timeout_s_(timeout_s < 1e9 ? timeout_s : 1e9) {}

  // The backend's op for collective `seq` (the base fields but start: see
  // new_op()).
  virtual std::unique_ptr<P2pOp> make_op(const char* name, uint64_t seq) = 0;
  // A backend's Op with the base fields filled.
  template <typename Op>
  std::unique_ptr<Op> new_op(const char* name, uint64_t seq) const {
    auto op = std::make_unique<Op>();
    op->name = name;
    op->seq = seq;
    op->rank = rank_;
    op->world = world_;
    op->backend = backend_name();
    return op;
  }
  // Posts one transfer of `bytes` (0 allowed: buf may be null) to or from
  // `peer`; it may complete at any time until wait() returns.
  virtual Status post(P2pOp& op, bool recv, void* buf, std::size_t bytes, int peer, int phase) = 0;
  // Until every transfer posted on `op` completed, or the deadline
  // (op.start + timeout_s()) passed: kUnavailable naming the peer.
  virtual Status wait(P2pOp& op) = 0;
  // After an error (the communicator is already broken): the op's pending
  // transfers must never touch the caller's buffers again; op.stage may be
  // kept alive (graveyard_add) where they still could.
  virtual void abandon(P2pOp& op) = 0;
  // Called once, when the communicator breaks (before abandon()), with the
  // error that broke it.
  virtual void on_broken(const Status& /*error*/) {}

  double timeout_s() const { return timeout_s_; }
  // OK, or the error that broke the communicator (prefixed "communicator
  // broken by an earlier failure").
  Status broken_status();
  // Keeps memory alive until the communicator is destroyed.
  void graveyard_add(std::shared_ptr<std::vector<float>> mem);

 private:
  template <typename Body>
  Status enqueue(const char* name, DeviceStream* stream, Body body);
  void break_with(const Status& st);

  DeviceBackend* const device_;
  const int rank_, world_;
  const double timeout_s_;
  std::atomic<uint64_t> next_seq_{0};
  std::mutex mu_;  // guards first_error_ and graveyard_
  Status first_error_;
  std::vector<std::shared_ptr<std::vector<float>>> graveyard_;
};

}  // namespace strata::comm
