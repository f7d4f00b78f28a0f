// What `strata finetune` takes from the device pool beside the engine's
// placement (trainer.h, "Devices"): its fp32 gradient buffers, the kept layer
// inputs and the activation and token buffers, and (CUDA) the model ops'
// workspace. The trainer reserves exactly this on the device, and `strata
// plan` reserves the same, so a plan says what the run will hold.
//
// Pure functions; no state.
#pragma once

#include <cstdint>

#include "runtime/model_spec.h"

namespace strata::train {

// Device-pool bytes a buffer of `bytes` may take: the caching allocator
// rounds up to a size class, at most 25% over (device/caching_allocator.h).
inline uint64_t pool_bytes(uint64_t bytes) { return bytes + bytes / 4 + 512; }

struct DeviceSizes {
  uint64_t grad_buf_elems = 0;  // the gradient buffer: the largest group's trainable elements
  uint64_t grad_bytes = 0;      // it and the tied embedding's, fp32
  uint64_t reserve_base = 0;    // grad_bytes + 64 MiB of margin
  uint64_t extra = 0;           // layer inputs (layers + 1), dx x 2, tokens and targets, as the pool rounds them
  uint64_t group_buffers = 0;   // the engine's compute buffers for prefetch_depth + 2 groups, double-buffered

  // The device reserve: reserve_base + extra, plus on CUDA the ops'
  // workspace (pool-rounded) and, with N GPU ranks, NCCL's scratch.
  uint64_t reserve(uint64_t workspace = 0, uint64_t nccl_scratch = 0) const {
    return reserve_base + extra + (workspace ? pool_bytes(workspace) : 0) + nccl_scratch;
  }
};

// `spec` as the engine gets it (trainable flags set: a LoRA base has no
// gradient); `dim` the hidden size; `tokens` batch x seq of one micro-batch.
DeviceSizes trainer_device_sizes(const ModelSpec& spec, uint64_t dim, uint32_t layers, bool tied, uint64_t tokens,
                                 uint32_t prefetch_depth);

}  // namespace strata::train
