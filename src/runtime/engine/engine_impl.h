// Engine::Impl: the parts of one engine wired together, and the protocol
// state the facade (engine.cpp, engine/checkpointing.cpp) keeps between calls.
// Not a public header.
//
// The parts, each with its own header under runtime/engine/ saying what it
// owns, which thread runs it and what it borrows:
//   Registry   params, groups, where every array lives, the storage and the
//              shared services (device, tracer, I/O, swap store, pinned pool)
//   Uploader   acquire/release, device slots, prefetch; the uploader thread
//   GradPath   reduce_grad's downloads and fp32 accumulation; the accumulator thread
//   Stepper    norm, loss scale, clipping, optimizer, compute-copy refresh;
//              the optimizer thread (overlap_backward)
// Each thread is a WorkQueue (runtime/engine/work_queue.h); the first
// asynchronous error of any of them is kept in `errors` until the next call.
#pragma once

#include <atomic>
#include <mutex>
#include <vector>

#include "runtime/engine.h"
#include "runtime/engine/async_error.h"
#include "runtime/engine/grad_path.h"
#include "runtime/engine/registry.h"
#include "runtime/engine/stepper.h"
#include "runtime/engine/uploader.h"

namespace strata {

struct Engine::Impl {
  // Declaration order is construction order: the registry outlives the parts
  // that borrow it.
  engine::Registry reg;
  engine::AsyncError errors;
  engine::Uploader uploader{reg};
  engine::GradPath grads{reg, errors};
  engine::Stepper stepper{reg, errors};

  // Protocol state (driving thread).
  int64_t micro_index = -1;      // micro-batches begun in this step, minus one
  bool overlap_running = false;  // last micro-batch of an overlap step in progress
  bool broken = false;           // a step failed: refuse steps until load_checkpoint
  Status broken_status;
  std::atomic<uint64_t> hot_allocs{0};  // allocations after the first step (none are made)

  // Caller compute spans (trace_begin/trace_end; any thread).
  std::mutex trace_mu;
  std::vector<uint64_t> trace_stack;  // trace_begin times (guarded by trace_mu)
  std::vector<const char*> trace_names;

  ~Impl();
  Status init(const EngineOptions& options);
  // Downloads, accumulations, group updates and uploads done.
  Status wait_idle();
  // Forgets the step's micro-batches and per-parameter gradient state.
  void reset_step();
};

}  // namespace strata
