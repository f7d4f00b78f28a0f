// The pipelined optimizer step over NVMe-resident state.
//
// Given tensors whose fp32 master copy, optimizer states (fp32 or bf16) and
// fp32 gradient accumulator live in a SwapStore (or in host memory: each
// array of each tensor is placed independently, so the runtime can mix
// tiers), step() runs one optimizer step chunk by chunk through a ring of
// pinned buffers:
//
//   I/O thread:     read k+1 ........ read k+2 ........
//   calling thread:        update k          update k+1      (cpu_optim::step, TBB workers)
//   I/O thread:                   write k-1         write k
//
// A ring slot holds one chunk of every swap-resident array. Reads for the
// first `ring_buffers` chunks go out at once; every later read is issued from
// the completion callback of the write that frees its slot, so the disk always
// has reads and writes queued without the calling thread waking up for it.
// The bf16/fp16 compute copy is produced in the same pass
// (StepBuffers::params_out) and written to its place (host, swap store, or
// device memory through a DeviceOutput, overlapped with the next chunk).
// Host-resident arrays are used in place: nothing is copied or written for
// them.
//
//   auto opt = NvmeOptimizer::create(&store, pool, config, {.chunk_elems = 4 << 20, .ring_buffers = 4});
//   OptimizerTensor t{.name = "layer0.w", .count = n,
//                     .master = Placement::in_swap(master), .grads = Placement::in_swap(grads),
//                     .params_out = Placement::in_host(bf16_copy)};
//   t.state[0] = Placement::in_swap(exp_avg); t.state[1] = Placement::in_swap(exp_avg_sq);
//   config.grad_scale = scale * clip_coefficient;  // the norm comes from the caller
//   Status s = (*opt)->step(config, t_step, tensors);
//
// Gradient norm. Not computed here: clipping needs the global norm before the
// first chunk is updated, so the caller computes it while the gradients are
// accumulated (the engine's GradPath::sum_sq) and passes the clipping
// coefficient in config.grad_scale.
//
// Allocation. The ring is allocated once, by create(), from the pinned pool:
// a pool too small for it fails there with kOutOfBudget, never mid-step.
// step() allocates no buffers (the I/O engine keeps a small
// per-request record, as for every request).
//
// Failures and the step counter. The optimizer remembers its progress
// (progress()): the last step number and how many elements, as a prefix of
// the tensors in the order given, were updated and written back.
//   * A read error or an update error (cpu_optim) mid-step: chunks before
//     the failed one are updated (step t) and written back (host-resident
//     arrays updated in place); the rest are untouched (step t-1). Arguments
//     are checked before any I/O: a kInvalidArgument starts nothing. progress() says where; calling step() again
//     with the SAME step number and the same tensors resumes from there
//     (chunks already done are not updated twice). Any other step number is
//     refused with kInvalidArgument until step t is complete.
//   * A write error: the chunk being written is torn on disk (some of its
//     pieces hold step t, some step t-1), its updated bytes are gone from the
//     ring, and chunks updated after it may or may not have been written.
//     A failed upload to a device params_out counts as a write error. progress().torn is set and every later step() returns
//     kCorrupt: restore the state (a checkpoint), then set_completed_step().
//   * step() with a number other than last+1 after a complete step is refused
//     (kInvalidArgument), so a step cannot be applied twice by mistake. A new
//     optimizer accepts any first step >= 1 (a run resumed from a checkpoint).
//
// Ownership: the store, the pool and the tracer are borrowed and must outlive
// the optimizer; the ring's buffers are owned and returned at destruction.
// Host arrays belong to the caller and must stay valid during a call.
// Blocking: step() blocks the calling thread until every
// request they issued has completed (also on error), and use up to
// exec.threads-1 oneTBB workers for the updates.
// Thread-safety: one call at a time per NvmeOptimizer (it owns one ring).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "cpu_optim/optimizer.h"
#include "io/pinned_pool.h"
#include "io/swap_store.h"
#include "runtime/trace.h"

namespace strata {

// Where one array of a tensor lives: a swap-store tensor, host memory,
// device memory (params_out only, through NvmeOptimizerOptions::device_out),
// or nowhere (an optional array that is absent).
struct Placement {
  enum class Tier : std::uint8_t { kNone = 0, kHost = 1, kSwap = 2, kDevice = 3 };
  Tier tier = Tier::kNone;
  void* host = nullptr;  // kHost: the array's first element; kDevice: its device address
  io::SwapTensor swap;   // kSwap: the array's bytes, from element 0

  static Placement in_host(void* p) { return {Tier::kHost, p, {}}; }
  static Placement in_swap(const io::SwapTensor& t) { return {Tier::kSwap, nullptr, t}; }
  static Placement on_device(void* p) { return {Tier::kDevice, p, {}}; }
  bool present() const { return tier != Tier::kNone; }
};

// Where device-resident compute copies are written (params_out on
// Placement::Tier::kDevice): each updated chunk's output, still in its ring
// slot, goes to copy(), which enqueues an asynchronous host -> device copy;
// before that slot's output is written again, and before step() returns,
// the optimizer calls wait(slot), unless done(slot) already said the slot's
// copies are complete. So the upload of chunk k overlaps the
// update of chunk k+1 and no master is read back to rebuild the copy.
class DeviceOutput {
 public:
  virtual ~DeviceOutput() = default;
  virtual Status copy(unsigned slot, void* device_dst, const void* host_src, std::size_t bytes) = 0;
  // Blocks until every copy() of `slot` so far is complete; its error.
  virtual Status wait(unsigned slot) = 0;
  // Without blocking: whether every copy() of `slot` so far has completed
  // without error (false when it cannot tell). Lets step() report a tensor
  // done (TensorsDone) before the slot is next waited for.
  virtual bool done(unsigned /*slot*/) { return false; }
};

// One tensor of the step: `count` elements in each array.
struct OptimizerTensor {
  std::string_view name;  // for error messages; borrowed for the call
  std::size_t count = 0;
  Placement master;      // fp32, updated in place (required)
  Placement grads;       // fp32, read only (required)
  Placement state[3];    // as cpu_optim::StepBuffers::state, dtype = options.state_dtype
  Placement params_out;  // optional: the updated compute copy in options.out_dtype
  // params_out is an fp32 copy of the master (an fp32 model's compute copy):
  // the updated master chunk is written there as well, with no conversion
  // (from the ring, or copied from a host-resident master).
  bool out_is_master = false;
  // Optional host memory (count elements of out_dtype; 4-byte ones with
  // out_is_master) that receives each updated chunk of the compute copy as
  // well, right after its update, before any write-back: a reader that needs
  // the copy soon takes it from here instead of reading it back from the
  // store (the engine's uploader, for the first groups of the next forward).
  // step()'s `copied` says when it is complete.
  void* out_copy = nullptr;
  // This tensor's own bias-correction step (torch's per-parameter
  // state['step']: a parameter skipped in some steps has taken fewer); 0:
  // the call's step. The call's step still orders the calls (see step()).
  std::int64_t step = 0;
  // The global index of element 0 in the whole tensor (a rank's shard
  // offset): with bf16 states rounded stochastically, an element's random
  // bits hash its global index (and the step and state), so they do not
  // depend on chunking, tier or rank count (cpu_optim/stochastic_round.h).
  std::uint64_t first_index = 0;
  // This tensor's own hyper-parameters (its parameter group's lr, betas,
  // weight decay), borrowed for the call; null: the call's config. It must
  // use the same optimizer kind (state count) as the call's. One call can so
  // update tensors of every parameter group in one pass through the ring.
  const cpu_optim::OptimizerConfig* config = nullptr;
};

// step()'s completion callback: `tensors_done` leading tensors of the call
// are updated and their compute copies final: written back where the copy
// is in the swap store (or the tensor has no params_out: a copy made from
// the master reads the store), uploaded where it is on the device. A copy
// on the host or device does not wait for the master's and moments' write-
// back, which only the next call (and whoever waits for this call's end)
// reads; a write-back that fails after its tensor was reported still fails
// the call and tears the state (progress()). Called with
// increasing values, the last one the call's tensor count (on success), on
// the I/O thread or the calling thread, under the optimizer's lock: it must
// not block or call into the optimizer. A device upload counts as done when
// DeviceOutput::done() says so (polled before each chunk's update) or when
// its slot is next waited for (the slot's reuse, or the end of the call).
using TensorsDone = std::function<void(std::size_t tensors_done)>;

struct NvmeOptimizerOptions {
  // Elements per chunk. Rounded up to a multiple of 2048 so that every chunk
  // of every array starts on a 4 KiB boundary (O_DIRECT end to end).
  // DeepSpeed's offload_optimizer has no buffer size (it swaps whole
  // sub_group_size groups); the runtime derives this from the pinned budget:
  // ring bytes = ring_buffers x chunk_elems x (4 + states x state size + 4 + 2).
  std::size_t chunk_elems = std::size_t{4} << 20;
  // Chunks in the ring (DeepSpeed: offload_optimizer.buffer_count), 2..64.
  // 3 or more overlap read, update and write; with 2, a read waits for the
  // write that frees its slot.
  unsigned ring_buffers = 4;
  DType state_dtype = DType::kF32;  // fp32 or bf16
  // bf16 states: nearest (default) or stochastic; see cpu_optim::StepBuffers.
  cpu_optim::StateRounding state_rounding = cpu_optim::StateRounding::kNearest;
  DType out_dtype = DType::kBF16;   // of params_out: bf16 or fp16
  // Required when a params_out is on the device; borrowed.
  DeviceOutput* device_out = nullptr;
  cpu_optim::ExecOptions exec;
  Tracer* tracer = nullptr;  // read/write spans on one track per ring slot, updates on the caller's thread
  // Where to add the bytes of every read and write submitted to the swap
  // store (the engine's traffic counters); null: not counted.
  std::atomic<std::uint64_t>* read_bytes = nullptr;
  std::atomic<std::uint64_t>* write_bytes = nullptr;
};

// Where the last step stands (see the header comment).
struct StepProgress {
  std::int64_t step = 0;          // number of the last step() call (0: none)
  bool complete = true;           // every element of that step is updated and written back
  std::uint64_t done_elems = 0;   // prefix (in tensor order) updated and written back
  std::uint64_t total_elems = 0;  // of the last call's tensors
  bool torn = false;              // a write-back failed: on-disk state is undefined
};

class NvmeOptimizer {
 public:
  // Allocates the ring from `pool`. `store` may be null when every array is
  // host-resident. `config` fixes how many state arrays a slot carries
  // (cpu_optim::state_count). Errors: kInvalidArgument (bad options),
  // kOutOfBudget (the pool cannot hold the ring; the message gives the ring's
  // size), whatever the pool returns.
  static Result<std::unique_ptr<NvmeOptimizer>> create(io::SwapStore* store, io::PinnedPool& pool,
                                                       const cpu_optim::OptimizerConfig& config,
                                                       const NvmeOptimizerOptions& options);
  ~NvmeOptimizer();
  NvmeOptimizer(const NvmeOptimizer&) = delete;
  NvmeOptimizer& operator=(const NvmeOptimizer&) = delete;

  // One optimizer step (1-based `step`, as cpu_optim::step) over every
  // tensor; config.grad_scale carries 1/loss_scale x 1/accumulation x the
  // clipping coefficient. Results are bit-identical to cpu_optim::step on the
  // same data in RAM. Errors: kInvalidArgument (missing array, state count or
  // dtype mismatch, a step number out of order: see above), the I/O error of
  // the first failed read or write (with the tensor, chunk and step named),
  // kCorrupt (state torn by an earlier write failure), cpu_optim's errors.
  // `done` (optional): see TensorsDone; lets a caller use the first tensors
  // while the pass goes on with the rest (the engine's pipelined step).
  // `copied` (optional): the leading tensors whose updates, and so their
  // out_copy, are complete, in increasing counts, on the calling thread
  // without the optimizer's lock (the write-backs may still run); not called
  // when the call resumes an incomplete step (its first chunks are not
  // updated again) or after a failure.
  Status step(const cpu_optim::OptimizerConfig& config, std::int64_t step, std::span<const OptimizerTensor> tensors,
              const TensorsDone& done = {}, const TensorsDone& copied = {});
  // The same for one of several disjoint tensor sets that together make up
  // step `step` (the engine updates one parameter group at a time, e.g. while
  // backward runs): after a complete step, the same number is accepted again
  // as well as the next one. The caller guarantees that no tensor is updated
  // twice in one step. Failure and resume rules are those of step().
  Status step_part(const cpu_optim::OptimizerConfig& config, std::int64_t step,
                   std::span<const OptimizerTensor> tensors);


  // Read-ahead: issues the reads of the first ring_buffers() chunks of a
  // coming step() over `tensors` now and returns at once (masters and
  // moments do not depend on the gradients, so they can be read while
  // backward runs). It stops at the first chunk whose gradients are in the
  // swap store (they are not final yet). The next step()/step_part() uses a
  // read-ahead slot when it would read exactly the same bytes into it; any
  // other is waited for and read again. Whoever changes a swap-resident
  // array of those tensors between prefetch() and that step (a checkpoint
  // load) must call drop_prefetch() before the step, so that the slots'
  // possibly stale bytes are not used. Does nothing after a failed or
  // incomplete step. Same thread rules as step().
  void prefetch(std::span<const OptimizerTensor> tensors);
  // Waits for the read-ahead's requests and forgets them.
  void drop_prefetch();
  // Waits for the read-ahead's requests and keeps them: after it, the swap
  // store's arrays may be written without racing a read (the caller then
  // drops the read-ahead before the step, as above).
  void settle_prefetch();
  // Chunks a step() took from a read-ahead instead of reading them (total).
  std::uint64_t prefetch_hits() const { return prefetch_hits_.load(std::memory_order_relaxed); }

  const StepProgress& progress() const { return progress_; }
  // After restoring the state (a checkpoint at step `step`): clears `torn`
  // and marks `step` complete, so the next call must be step+1.
  void set_completed_step(std::int64_t step);

  std::size_t chunk_elems() const { return chunk_; }
  unsigned ring_buffers() const { return static_cast<unsigned>(slots_.size()); }
  std::size_t ring_bytes() const { return slot_bytes_ * slots_.size(); }

 private:
  enum Array { kMaster = 0, kState0 = 1, kGrads = 4, kOut = 5, kArrays = 6 };
  enum class Phase { kIdle, kReading, kReadDone, kWriting };
  struct Chunk {
    std::uint32_t tensor;
    std::uint64_t offset;  // elements from the tensor's start
    std::uint64_t count;
  };
  struct Slot {
    io::PinnedBuffer mem;
    void* part[kArrays] = {};
    // Guarded by mu_.
    std::size_t chunk = 0;
    Phase phase = Phase::kIdle;
    int pending = 0;
    Status error;
    int error_array = -1;  // the array whose request failed
    std::uint64_t t0 = 0;      // submission of the current read/write (trace)
    std::uint64_t bytes = 0;   // its bytes (trace)
    std::uint32_t track = 0;
  };
  // Up to one request per array, prepared under mu_ and submitted after it
  // (submitting can call back synchronously into piece_done, which locks).
  struct Pending {
    std::size_t slot = 0;
    bool write = false;
    int n = 0;
    struct Req {
      io::SwapTensor t;
      std::uint64_t offset, length;
      void* buf;
      int array;
    } req[kArrays];
  };

  NvmeOptimizer(io::SwapStore* store, const NvmeOptimizerOptions& o, int nstates)
      : store_(store), options_(o), nstates_(nstates) {}
  Status step_impl(const cpu_optim::OptimizerConfig& config, std::int64_t step,
                   std::span<const OptimizerTensor> tensors, bool part, const TensorsDone& done,
                   const TensorsDone& copied);
  Status validate(std::span<const OptimizerTensor> tensors) const;
  void build_chunks(std::span<const OptimizerTensor> tensors, std::uint64_t skip_elems);
  Status run(const cpu_optim::OptimizerConfig& config, std::int64_t step, std::size_t* chunks_done);
  std::size_t element_size(int array) const;
  std::size_t element_size(int array, const OptimizerTensor& t) const;  // out_is_master: 4
  bool reads(int array, const OptimizerTensor& t) const;
  bool writes(int array, const OptimizerTensor& t) const;
  // The requests of chunk `chunk` in `slot` (reads or writes); their bytes.
  std::uint64_t fill_requests(std::size_t slot, std::size_t chunk, bool write, Pending* p) const;
  void prepare_io_locked(std::size_t slot, std::size_t chunk, bool write, Pending* p);
  void submit(Pending& p);
  void piece_done(std::size_t slot, int array, const Status& st);
  void issue_read(std::size_t slot, std::size_t chunk);
  Status chunk_error(const char* what, std::size_t chunk, int array, const Status& st) const;
  void out_failed(const Status& st);
  // Completion tracking for `done_`: one of chunk ci's parts (update,
  // write-back, upload) finished; reports the new prefix of whole tensors.
  void chunk_part_done_locked(std::size_t ci);

  io::SwapStore* store_;
  NvmeOptimizerOptions options_;
  int nstates_;
  std::size_t chunk_ = 0;
  std::size_t slot_bytes_ = 0;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<Chunk> chunks_;  // capacity kept between calls
  StepProgress progress_;

  // Per call (set before any I/O, read by the I/O thread's callbacks).
  std::span<const OptimizerTensor> tensors_;
  std::int64_t step_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::size_t inflight_ = 0;  // pieces + submission guards not yet done (mu_)
  bool stop_ = false;         // no further reads (mu_)
  Status write_error_;        // first failed write-back or upload (mu_)
  std::vector<std::uint8_t> out_copying_;  // per slot: device_out copies in flight (calling thread)
  std::vector<std::size_t> out_chunk_;     // per slot: the chunk of that copy (calling thread)
  TensorsDone done_;                       // the call's callback (may be empty)
  TensorsDone copied_;                     // the call's out_copy callback (may be empty; calling thread)
  // Read-ahead (prefetch()): per slot, the requests it issued into the slot
  // (chunk index = slot index). Calling thread only.
  std::vector<std::uint8_t> prefetched_;
  std::vector<Pending> prefetch_req_;
  std::vector<std::uint8_t> keep_;  // run(): per slot, its read-ahead is used
  std::atomic<std::uint64_t> prefetch_hits_{0};  // written by the calling thread, read by any
  std::vector<std::uint8_t> chunk_left_;   // per chunk: parts not yet finished (mu_)
  std::vector<std::uint8_t> write_counts_; // per chunk: its write-back is one of those parts (mu_)
  std::size_t finished_ = 0;               // chunks finished as a prefix (mu_)
  std::size_t reported_ = 0;               // tensors reported to done_ (mu_)
};

}  // namespace strata
