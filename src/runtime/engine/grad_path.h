// GradPath: the gradients' way from the trainer's device buffers into each
// parameter's fp32 accumulator.
//
// Owns: the download stream and its events (one per piece: its download is
// done), the pinned download pieces (pieces() buffers of piece_elems() fp32
// elements: the plan's grad_pieces) and their free list, with gradient
// staging the stage stream and one device buffer per piece (N ranks: the
// piece's reduce-scatter send buffer), the accumulation scratch buffer,
// every parameter's per-step gradient state (reduced in which micro-batch,
// written this step), and the accumulator thread with its queue.
// Thread: reduce()/queue_group_done()/end_reduce() on the driving thread (per
// piece: with staging a device copy on the stage stream, then the download
// on the download stream and its event; the piece is queued to the
// accumulator at once, with no host callback); the accumulator thread waits
// for the piece's event, then writes float(g) (first
// micro-batch) or adds float(g) into the host-tier accumulator, or does the
// same arithmetic as an NVMe read-add-write through the scratch buffer
// (cpu_optim::accumulate: vectorized, on the oneTBB workers). The same pass
// leaves the squares of the new sums in the parameter's norm blocks, so the
// step has its norm without reading the gradients again (sum_sq).
// Borrows: the registry (params, device, swap store, tracer, counters, pool),
// the engine's AsyncError (an accumulation's I/O error), and the
// on_group_done callback (overlap mode: the stepper's update queue), called
// on the accumulator thread after every piece of the group was added.
// N ranks: each piece of the shard is first reduce-scattered (the rank-order
// sum over ranks, fp32) into a device buffer and copied into the pinned
// piece, on the download stream; the accumulator then adds it as it would a
// one-rank gradient. Staged (Plan::grad_staged, the default): the piece's
// slices of the caller's gradient are first packed (widened to fp32) into
// the piece's own send buffer on the stage stream, which is all the caller's
// stream waits for; the reduce-scatter runs on the download stream behind
// it, so with one group's worth of pieces (Plan::grad_pieces) backward runs
// on while the group's reduce-scatters drain (DeepSpeed's overlap_comm
// buckets). Unstaged: packed on the download stream into one send buffer. ZeRO stage 1 ("deferred", Registry::defer_reduce):
// reduce() instead adds the caller's whole gradient into this rank's own
// fp32 sum on the device (local_, one buffer per trainable parameter), and
// reduce_deferred() at step time reduce-scatters those sums once, piece by
// piece, into the shard accumulators (written, not added).
// Must not: change the accumulation order or arithmetic (host and NVMe
// results are bit-identical); allocate per reduce (the pieces are the
// back-pressure: reduce() waits for a free one).
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <vector>

#include "runtime/engine/async_error.h"
#include "runtime/engine/registry.h"
#include "runtime/engine/work_queue.h"

namespace strata::engine {

class GradPath {
 public:
  GradPath(Registry& reg, AsyncError& errors) : reg_(reg), errors_(errors) {}
  ~GradPath();
  GradPath(const GradPath&) = delete;
  GradPath& operator=(const GradPath&) = delete;

  // ---- create()
  // Sizes the pieces (the plan's grad_piece_elems and grad_pieces), decides
  // on staging (strata.gradient_staging; N ranks: the plan's grad_staged) and
  // creates the streams and events.
  Status prepare();
  bool staging() const { return staging_; }
  // Whether an fp32 gradient of a bf16/fp16 parameter is rounded to the
  // compute dtype in the staging copy (strata.gradient_in_compute_dtype).
  bool narrows() const { return narrow_; }
  uint64_t piece_elems() const { return piece_elems_; }
  uint32_t pieces() const { return pieces_; }  // download pieces in flight (plus one scratch buffer)
  Status allocate();  // pieces and scratch from the registry's pool; staging buffers on the device
  Status start(std::function<void(GroupId)> on_group_done);
  void stop();  // finishes queued accumulations, joins the thread
  DeviceStream* download() const { return download_; }

  // ---- driving thread
  // Checks that p was not reduced in `micro_index` yet, then copies its
  // shard of `grad` piece by piece (device -> pinned, download stream, after
  // `stream`'s current point) and queues each piece for the accumulator.
  Status reduce(ParamId p, const void* grad, DType dtype, DeviceStream* stream, int64_t micro_index);
  // Overlap mode: a marker behind the group's pieces; the accumulator hands
  // the group to on_group_done once it gets there.
  Status queue_group_done(GroupId g);
  // `stream` waits until the gradients queued so far were read (the caller
  // may then reuse its gradient buffer): with staging, their device copies
  // only; without, their downloads.
  Status end_reduce(DeviceStream* stream);
  // Synchronizes the stage and download streams, then waits for the accumulator.
  Status wait_idle();
  // Stage 1, step(): every parameter a micro-batch reduced (ParamId order; the
  // same set on every rank, like reduce_grad itself) has its ranks' summed
  // local gradients reduce-scattered into this rank's shard accumulator;
  // then wait_idle(). A collective.
  Status reduce_deferred();
  // step(): accumulators no micro-batch wrote this step are zeroed.
  Status zero_unwritten();
  // Whether a micro-batch of this step reduced p (driving thread).
  bool written(ParamId p) const { return params_[p].written; }
  // The sum of squares of p's accumulated gradient shard (unscaled; not
  // finite when an element is not): its norm blocks added in order, as
  // cpu_optim::grad_stats would sum them. 0 when nothing was reduced this
  // step. Any thread that has seen p's pieces accumulated (the step after
  // wait_idle, the optimizer thread after the group's marker).
  double sum_sq(ParamId p) const;
  // Forgets the step's per-parameter state.
  void reset_step();
  // Why this step's gradients are torn (a reduce failed after part of it was
  // accumulated); empty when they are whole.
  const std::string& torn() const { return torn_; }
  // Pieces 0 and 1 as bounce buffers (driving thread, path idle).
  Bounce bounce() const { return Bounce{dl_[0].as<float>(), dl_[1].data(), piece_elems_}; }

 private:
  std::string torn_;
  struct Job {
    enum Kind { kAccum, kGroupDone } kind = kAccum;
    uint32_t slot = 0;  // download piece
    ParamId param = 0;
    GroupId group = 0;
    uint64_t offset = 0, count = 0;  // elements of the shard
    DType dtype = DType::kF32;
    bool first = false;
  };
  struct ParamGrad {
    bool written = false;        // a micro-batch of this step wrote the accumulator
    int64_t reduced_micro = -1;  // micro-batch index of the last reduce
    // Per cpu_optim::kNormBlock elements of the shard: the sum of squares of
    // the accumulator's current values (accumulator thread; zeroed by
    // reset_step).
    std::vector<double> block_sq;
  };

  void accumulator_main(const Job& j);  // accumulator thread
  Status accumulate(const Job& j);      // accumulator thread
  // The piece's copies, `cnt` elements from the caller's `src` (in `given`)
  // into dl_[slot] in `sent` (given, or the compute dtype when narrowed).
  Status download_piece(uint32_t slot, const void* src, DType given, DType sent, uint64_t cnt);
  // `grad`: the caller's whole gradient (on the host backend any host
  // memory), or a stage-1 local sum (backend memory). Packs into `send` on
  // `pack_stream` (staged: the stage stream, the download stream waiting for
  // `packed`; else the download stream itself), then reduce-scatters on the
  // download stream.
  Status reduce_scatter_piece(const ParamState& p, const void* grad, DType dtype, uint64_t off, uint64_t cnt,
                              float* send, DeviceStream* pack_stream, DeviceEvent* packed, float* out);
  // Stage 1: grad (the caller's, whole) into local_[id]: written when
  // `first`, else added (cpu_optim::accumulate's arithmetic: one fp32 add).
  Status add_local(ParamId id, const void* grad, DType dtype, bool first);
  // A free download piece (waits for the accumulator to give one back).
  Result<uint32_t> take_slot();
  // Hands piece `slot` (elements [offset, offset + count) of p's shard) to
  // the accumulator thread.
  void queue_accum(uint32_t slot, ParamId id, uint64_t offset, uint64_t count, DType dtype, bool first);
  Status zero_grad(ParamId p);

  Registry& reg_;
  AsyncError& errors_;
  std::function<void(GroupId)> on_group_done_;
  std::vector<ParamGrad> params_;  // driving thread

  DeviceStream* download_ = nullptr;
  DeviceEvent* ev_caller_ = nullptr;    // caller's stream point before a download
  DeviceEvent* ev_download_ = nullptr;  // the caller's buffer was read: the caller's stream waits
  std::vector<DeviceEvent*> ready_;     // per piece: its download is done (the accumulator waits)
  // Gradient staging (strata.gradient_staging): the caller's piece is copied
  // to stage_[slot] on the stage stream (staged_[slot] after it), the
  // download stream takes it from there. N ranks: stage_[slot] is the
  // piece's send buffer (world x piece fp32, packed on the stage stream).
  bool staging_ = false;
  bool narrow_ = false;  // strata.gradient_in_compute_dtype (with staging)
  DeviceStream* stage_stream_ = nullptr;
  std::vector<void*> stage_;
  std::vector<DeviceEvent*> staged_;

  // Download pieces and scratch (elements of fp32 each).
  uint64_t piece_elems_ = 0;
  uint32_t pieces_ = 0;
  void* stage_block_ = nullptr;  // N ranks, staged: every piece's send buffer
  std::vector<io::PinnedBuffer> dl_;
  std::mutex mu_;
  std::condition_variable cv_;     // a piece was freed
  std::vector<uint32_t> dl_free_;  // guarded by mu_
  io::PinnedBuffer scratch_;       // accumulator thread: fp32 read-add-write
  float* send_ = nullptr;          // N ranks, unstaged or stage 1: world x piece fp32 (device memory), the reduce-scatter's input
  float* recv_ = nullptr;          // N ranks: one piece fp32 (device memory), its output
  void* local_block_ = nullptr;    // stage 1: the local sums' device memory
  std::vector<float*> local_;      // stage 1: per trainable parameter, numel fp32 (null otherwise)
  WorkQueue<Job> queue_;
};

}  // namespace strata::engine
