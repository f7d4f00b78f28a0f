// Strata's CPU optimizers: AdamW, Adam, Adagrad, Lion and SGD over fp32 master
// parameters, vectorized (AVX-512, AVX2, NEON, scalar; chosen at run time) and
// parallel (oneTBB). The runtime calls step() chunk by chunk on buffers it
// streams from NVMe; a trainer may call it directly on whole tensors.
//
// Semantics are PyTorch's (torch.optim.AdamW/Adam/Adagrad/SGD single-tensor
// formulas; Lion as in Chen et al. 2023), with the per-call constants
// (1 - beta, bias corrections, lr/(1 - beta1^t), lr*wd) computed in double
// and rounded once to fp32. Arithmetic per element is fp32 in a fixed order.
// One deliberate difference in rounding, not in math: decoupled weight decay
// is p - (lr*wd)*p in one fma, where PyTorch multiplies by 1 - lr*wd rounded
// to fp32 (a 2^-25 relative error per step that compounds over steps).
//
// Determinism: the result of step() is bit-identical for any thread count and
// on every ISA (scalar, AVX2, AVX-512, NEON give the same bits; NaN payloads
// aside). grad_stats() is likewise bit-identical for any thread count and ISA:
// it sums squares in double over fixed blocks and combines them in order.
//
// Ownership: every buffer belongs to the caller and must stay valid for the
// duration of the call; nothing is retained after a call returns.
// Blocking: calls are synchronous; they use the calling thread plus up to
// threads-1 oneTBB workers.
// Thread-safety: calls on disjoint buffers may run concurrently from several
// threads. Buffers of one call must not overlap each other (except that
// grads may be read-only shared), and no other thread may write them meanwhile.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype_parse.h"
#include "common/status.h"
#include "cpu_optim/stochastic_round.h"
#include "cpu_optim/types.h"

namespace strata::cpu_optim {

// Hyper-parameters. All may change between calls (schedulers). Defaults are
// PyTorch's where the optimizer has one.
struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double lr = 1e-3;
  double beta1 = 0.9;     // Adam/AdamW/Lion (Lion's usual betas: 0.9, 0.99)
  double beta2 = 0.999;   // Adam/AdamW/Lion
  double eps = 1e-8;      // Adam/AdamW/Adagrad (torch's Adagrad default is 1e-10)
  double weight_decay = 0.0;  // decoupled for AdamW and Lion; L2 in the gradient otherwise
  bool amsgrad = false;   // Adam/AdamW: needs the max_exp_avg_sq state
  double momentum = 0.0;  // SGD
  double dampening = 0.0; // SGD
  bool nesterov = false;  // SGD: needs momentum > 0 and dampening == 0
  double lr_decay = 0.0;  // Adagrad
  bool maximize = false;  // ascend instead of descend (negates the gradient)
  // Multiplies every gradient before use: 1/loss_scale * 1/accumulation_steps
  // (and a clipping coefficient), folded into the same pass.
  double grad_scale = 1.0;
};

// The buffers of one step, each holding `count` elements.
//
// state[] by optimizer (PyTorch's state names):
//   Adam/AdamW: state[0] exp_avg, state[1] exp_avg_sq, state[2] max_exp_avg_sq (amsgrad only)
//   Adagrad:    state[0] sum (initialise to initial_accumulator_value)
//   Lion:       state[0] exp_avg
//   SGD:        state[0] momentum_buffer (only when momentum != 0; it is set
//               from the gradient when step == 1, as PyTorch creates it)
// States start zeroed (except Adagrad's sum) and are updated in place.
struct StepBuffers {
  float* params = nullptr;         // fp32 master parameters, updated in place
  const void* grads = nullptr;     // read only
  DType grad_dtype = DType::kF32;  // fp32, bf16 or fp16
  void* state[3] = {nullptr, nullptr, nullptr};
  DType state_dtype = DType::kF32;  // fp32 or bf16
  // Optional: the updated parameters are also written here, rounded to
  // out_dtype (bf16 or fp16) in the same pass (the compute copy for the GPU).
  void* params_out = nullptr;
  DType out_dtype = DType::kBF16;
  // bf16 states only: how they are rounded (types.h). Stochastic rounding's
  // random bits are a hash of (rounding_seed, rounding_stream, step, the
  // element's index index_base + i, the state slot), never a generator's
  // state. When a tensor is updated in pieces (chunks, shards), give each
  // piece the index of its first element in the whole tensor: then the bits
  // depend on neither the split, the ISA nor the thread count. The runtime
  // and the C ABI leave rounding_stream 0 (same bits on both); a caller may
  // give tensors streams of their own to decorrelate them.
  // index_base + count < 2^63.
  StateRounding state_rounding = StateRounding::kNearest;
  std::uint64_t rounding_seed = kDefaultRoundingSeed;
  std::uint64_t rounding_stream = 0;
  std::uint64_t index_base = 0;
};

// How to run. kAuto/0 take STRATA_CPU_ISA / STRATA_THREADS, else the best ISA
// and the number of CPUs this process may run on (sched_getaffinity).
struct ExecOptions {
  Isa isa = Isa::kAuto;
  int threads = 0;
};

// Number of state buffers `config` needs (0..3).
int state_count(const OptimizerConfig& config);

// Bytes moved per parameter by one step (reads + writes, no write-allocate):
// fp32 AdamW is 28.
std::size_t bytes_per_param(const OptimizerConfig& config, const StepBuffers& buffers);

// One optimizer step over elements [0, count). `step` is the 1-based step
// number after increment (PyTorch's state['step']): 1 on the first call.
// Errors (nothing is modified): kInvalidArgument for a null or missing buffer,
// a bad dtype, step < 1 or out-of-range hyper-parameters (with the same checks
// PyTorch makes: lr, eps, weight_decay, momentum >= 0; betas in [0, 1);
// nesterov needs momentum > 0 and dampening == 0); kUnavailable when the
// requested or STRATA_CPU_ISA-forced ISA cannot run here. count == 0 is ok.
Status step(const OptimizerConfig& config, std::int64_t step, const StepBuffers& buffers, std::size_t count,
            const ExecOptions& exec = {});

// Result of grad_stats().
struct GradStats {
  double sum_sq = 0.0;       // sum over i of (scale * g[i])^2, computed in double
  bool has_inf_nan = false;  // some g[i] is inf or NaN (sum_sq is then inf or NaN)
};

// One pass over the gradients: squared L2 norm (for clipping) and whether any
// element is inf/NaN (to skip an overflowed fp16 step). `scale` is the same
// pre-scale that step() would apply (1/loss_scale * 1/accumulation).
// Deterministic: fixed blocks of kNormBlock elements, squares summed in double
// in 16 fixed lanes per block, blocks combined in index order; the same bits
// for any thread count and ISA. Errors: kInvalidArgument (null grads with
// count > 0, non-finite scale), kUnavailable (ISA).
Result<GradStats> grad_stats(const void* grads, DType dtype, std::size_t count, double scale = 1.0,
                             const ExecOptions& exec = {});
inline constexpr std::size_t kNormBlock = 16384;

// Gradient accumulation with the norm's squares in the same pass:
// dst[i] = float(src[i]) when `first`, else dst[i] + float(src[i]) (one fp32
// add: exact widening, no FMA, the same bits on every ISA), for i < count.
// When block_sq is not null, block_sq[b] receives the sum of squares of the
// new dst over block b = [b * kNormBlock, (b+1) * kNormBlock) ∩ [0, count),
// computed as grad_stats computes its blocks: adding block_sq[0..nblocks) in
// order gives grad_stats(dst, kF32, count, 1.0).sum_sq bit for bit, so a
// caller that accumulates a gradient piece by piece (pieces starting at
// multiples of kNormBlock) has its norm without reading the gradient again.
// A non-finite block_sq[b] means a non-finite element in block b.
// Vectorized and parallel over blocks like grad_stats. Errors:
// kInvalidArgument (invalid source dtype, null buffers with count > 0).
Status accumulate(float* dst, const void* src, DType src_dtype, std::size_t count, bool first, double* block_sq,
                  const ExecOptions& exec = {});

// dst[i] = round(src[i]) to bf16 or fp16 (round to nearest even), vectorized
// and parallel like step(). Errors: kInvalidArgument (null, dst_dtype fp32).
Status convert(const float* src, void* dst, DType dst_dtype, std::size_t count, const ExecOptions& exec = {});

// "fp32", "bf16", "fp16"; parse accepts those and "f32"/"float32"/"bfloat16"/"f16"/"float16".
using ::strata::dtype_name;
using ::strata::dtype_size;
inline Result<DType> parse_dtype(const char* name) { return ::strata::parse_dtype(name ? name : ""); }
const char* optimizer_name(OptimizerKind kind);  // "adamw", "adam", "adagrad", "lion", "sgd"
Result<OptimizerKind> parse_optimizer(const char* name);

namespace detail {
// Elements per scheduling block of step(): every block is processed by one
// thread; blocks are split into contiguous equal runs per thread.
inline constexpr std::size_t kStepBlock = 32768;
// The thread count ExecOptions resolves to (>= 1).
int resolve_threads(int requested);
// Runs fn(block_begin, block_end) over [0, nblocks) on `threads` threads with
// a static partition (contiguous, near-equal runs of blocks per thread), in a
// oneTBB task_arena of that size cached per thread count.
void parallel_blocks(std::size_t nblocks, int threads, void (*fn)(void* ctx, std::size_t b0, std::size_t b1),
                     void* ctx);
}  // namespace detail

}  // namespace strata::cpu_optim
