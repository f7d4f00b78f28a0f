// How fast this CPU computes a model's micro-batch: the measured input of
// `strata plan --device cpu` (the host backend, where the "device" is these
// cores). The CPU ops (train/cpu_ops.h) run one decoder layer's forward and
// backward (with its recompute), the head's forward+backward (final norm,
// logits, loss) and the embedding's lookup and scatter at the model's shape,
// on weights of the compute dtype, and the micro-batch's time is put
// together as the trainer spends it:
//
//   micro_batch_s = layers x (layer_forward_s + layer_backward_s) + head_s + embed_s
//
// The probe stays small on any model: at most max_bytes of weights,
// gradients and workspace, and about max_flops per timed pass. Past those it
// runs fewer tokens (batch 1 first, then a shorter sequence, down to 256), then a
// narrower model (hidden size, heads, kv heads, FFN and vocabulary divided by
// the same k, head_dim kept); `scale` and `tokens` say what ran. A plan then
// takes the rate (FLOP per second, counted its own way) of what ran as the
// rate of what it plans: wider models and more tokens run no slower per FLOP
// on these GEMMs, so a narrowed probe errs towards a longer step.
//
//   auto p = train::probe_cpu_compute(dims, layers, DType::kBF16, 8, 2048, {});
//   if (p.ok()) use(p->micro_batch_s, p->dims, p->batch, p->seq);
//
// LoRA dims run their adapters (fp32, as PEFT and strata finetune keep them;
// the rank is kept when the probe narrows the model).
//
// Errors: kInvalidArgument (dims, sizes), kOutOfMemory (no room even for the
// narrowest probe), the ops' own errors. Blocking; uses `threads` TBB threads
// (0: all), as `strata finetune --threads`.
#pragma once

#include <cstdint>
#include <string>

#include "common/dtype.h"
#include "common/status.h"
#include "train/model_ops.h"

namespace strata::train {

struct CpuProbeOptions {
  int threads = 0;
  uint64_t max_bytes = uint64_t{2} << 30;  // weights + gradients + workspace
  double max_flops = 1e11;                 // per timed pass (about 0.5 s at 200 GFLOP/s)
  int reps = 3;  // timed passes after one warm-up, at least (more, up to 25, within a second); the median counts
  // A frozen base (LoRA's): no weight gradients but the adapters' (dims'
  // lora_targets, fp32), only the inputs'.
  bool frozen = false;
};

struct CpuProbe {
  LlamaDims dims;            // what ran: the model's, or divided by `scale`
  int64_t scale = 1;         // k: hidden size, heads, kv heads, FFN, vocabulary / k
  int64_t batch = 0, seq = 0;  // the tokens of what ran
  double layer_forward_s = 0, layer_backward_s = 0, head_s = 0, embed_s = 0;  // medians
  double micro_batch_s = 0;  // layers x (forward + backward) + head + embed, at batch x seq
  std::string description() const;  // "dim 4096 / 2, batch 1 x seq 512, layer 12.1 + 30.2 ms, head 3.1 ms"
};

Result<CpuProbe> probe_cpu_compute(const LlamaDims& model, int64_t layers, DType dtype, int64_t batch, int64_t seq,
                                   const CpuProbeOptions& options);

}  // namespace strata::train
