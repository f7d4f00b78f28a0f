// The CPU math behind CpuOps (train/cpu_ops.h), templated on the scalar type:
// float is what the trainer runs, double is what the finite-difference
// gradient checks run (the same code, so a check tests the shipped kernels).
// Instantiated for float and double in cpu_kernels.cpp.
//
// Threading: every function parallelises with TBB in the caller's task arena
// (CpuOps runs them inside its own arena). Work is split into blocks whose
// size depends only on the problem size, never on the thread count, and
// every reduction runs in a fixed order inside one block, so results are
// bitwise identical for any number of threads. Eigen never starts threads of
// its own (EIGEN_DONT_PARALLELIZE in every TU that includes it): one thread
// pool, TBB's.
//
// Layouts are those of train/model_ops.h: row-major, token-major [n, width]
// with n = B*T tokens, token (b, t) in row b*T + t.
#pragma once

#include <cstdint>
#include <vector>

#include "train/model_ops.h"

namespace strata::train::cpu {

// Rows per task for token-parallel and feature-parallel loops. Fixed (never
// derived from the thread count) so that partitioning, and with it every
// result bit, is the same for any number of threads.
inline constexpr int64_t kRowBlock = 64;

// ---- GEMM (single-threaded; callers parallelise by blocks)
// Row-major C[m, n] (=|+=) op(A)[m, k] * op(B)[k, n], where op(A) = A with A
// stored [m, k] (lda >= k) or A^T with A stored [k, m] (lda >= m); same for B.
// accumulate = false overwrites C. Float runs the kernel the CPU supports best
// (cpu_optim's ISA dispatch: avx512 / avx2+fma / generic x86-64, honouring
// STRATA_CPU_ISA); double always runs the generic one.
template <typename S>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const S* a, int64_t lda,
          const S* b, int64_t ldb, S* c, int64_t ldc, bool accumulate);
// The ISA the float GEMM uses ("generic", "avx2", "avx512").
const char* gemm_isa();

// ---- linear (HF nn.Linear without bias: y = x W^T, W [out, in])
template <typename S>
void linear_forward(const S* x, const S* w, S* y, int64_t n, int64_t in, int64_t out);
// dx (=|+=) dy W
template <typename S>
void linear_backward_input(const S* dy, const S* w, S* dx, int64_t n, int64_t in, int64_t out,
                           bool accumulate);
// dw = dy^T x (overwrites)
template <typename S>
void linear_backward_weight(const S* dy, const S* x, S* dw, int64_t n, int64_t in, int64_t out);

// ---- RMSNorm: y = w * (x * rstd), rstd = 1/sqrt(mean(x^2) + eps) per row
template <typename S>
void rmsnorm_forward(const S* x, const S* w, S* y, S* rstd, int64_t n, int64_t d, double eps);
// dx (=|+=) d/dx, dw = sum over rows (overwrites; null: not computed). rstd
// from the forward.
template <typename S>
void rmsnorm_backward(const S* x, const S* w, const S* rstd, const S* dy, S* dx, S* dw, int64_t n,
                      int64_t d, bool accumulate_dx);

// ---- biases (Qwen2's q/k/v)
// y[r, :] += b for r < n.
template <typename S>
void add_bias(S* y, const S* b, int64_t n, int64_t cols);
// db = sum over rows of dy (overwrites), rows in order, split over columns:
// the same bits for every thread count.
template <typename S>
void bias_backward(const S* dy, S* db, int64_t n, int64_t cols);

// ---- rotary embeddings (HF rotate_half convention)
template <typename S>
struct RopeTable {
  int64_t max_seq = 0, half = 0;
  std::vector<S> cos, sin;  // [max_seq, half]
  // inv_freq: head_dim / 2 values (LlamaDims::rope_inv_freq), empty: the
  // default RoPE of `theta`; cos/sin are multiplied by `scaling`.
  void init(int64_t max_seq, int64_t head_dim, double theta, const std::vector<float>& inv_freq = {},
            float scaling = 1.0f);
};
// In place on x[n = B*T, heads * head_dim]; position of row r is r % T.
// inverse = true applies the transposed rotation (the backward).
template <typename S>
void rope_apply(S* x, int64_t n, int64_t T, int64_t heads, int64_t head_dim,
                const RopeTable<S>& table, bool inverse);

// ---- causal grouped-query attention, tiled (flash attention on the CPU)
// Memory is O(T): no T x T matrix exists. The forward walks each block of
// kAttnQBlock query rows over the key blocks up to the diagonal (those wholly
// in the future are skipped, the diagonal one masked), with an online
// softmax: running max m and sum l per row, the output accumulator rescaled
// when m grows. It saves each row's log-sum-exp L = m + log(l), [n, heads]
// (the layout of the activations): the backward recomputes the tiles'
// probabilities as exp(score - L) from it, flash-attention-2 style, with
// D = rowsum(dO * O) in place of the softmax's row dot product. L is saved
// rather than recomputed because LayerMath::backward re-runs the layer's
// forward (activation recompute) just before, so L costs n * heads values
// (as much as one per-head norm's rstd) and no third pass over QK^T.
//
// The backward is two passes so that every output has one writer, with no
// atomics and a fixed summation order (results do not depend on threads):
// dK/dV by one task per (batch, kv head, key block), summing over the
// group's query heads in order, then the query blocks in order; dQ by one
// task per (batch, head, query block), summing over the key blocks in order.
// The price is P and dS computed twice (7 block products per tile instead
// of 5); skipping the tiles above the diagonal pays for it: 1.3-1.9x faster
// than the untiled kernel it replaced from T = 2048 on (BENCHMARKS.md).
//
// Block products run the single-threaded gemm<S> above.
inline constexpr int64_t kAttnQBlock = 64;  // query rows per tile
inline constexpr int64_t kAttnKBlock = 64;  // keys per tile

// Scratch per TBB thread slot of the arena the calls run in: slots must be
// the arena's max_concurrency() (tbb::this_task_arena::max_concurrency()
// inside it). A slot holds a few tiles, independent of T.
template <typename S>
struct AttnScratch {
  int slots = 0;
  int64_t per_slot = 0;  // values
  std::vector<S> buf;
  static int64_t values_per_slot(int64_t head_dim);  // ~2 tiles + a [block, head_dim] accumulator
  void init(int slots, int64_t head_dim);
  S* slot();  // this thread's slot
  size_t bytes() const { return buf.size() * sizeof(S); }
};
// q [n, heads*hd], k, v [n, kv_heads*hd] (rope already applied), out [n,
// heads*hd], lse [n, heads] (written: each row's log-sum-exp of the scaled
// scores, for the backward). Query head h reads kv head h / (heads / kv_heads).
template <typename S>
void attention_forward(const S* q, const S* k, const S* v, S* out, S* lse, int64_t B, int64_t T,
                       int64_t heads, int64_t kv_heads, int64_t hd, AttnScratch<S>& scratch);
// out and lse: the forward's on the same q, k, v. dq, dk, dv are overwritten.
template <typename S>
void attention_backward(const S* q, const S* k, const S* v, const S* out, const S* lse,
                        const S* dout, S* dq, S* dk, S* dv, int64_t B, int64_t T, int64_t heads,
                        int64_t kv_heads, int64_t hd, AttnScratch<S>& scratch);

// ---- SwiGLU: a = silu(g) * u, elementwise over n*f values
template <typename S>
void swiglu_forward(const S* g, const S* u, S* a, int64_t count);
// dg, du overwritten; du may equal da (each element is read before it is
// written); nothing else may alias.
template <typename S>
void swiglu_backward(const S* g, const S* u, const S* da, S* dg, S* du, int64_t count);

// ---- embedding
template <typename S>
void embed_forward(const S* table, const int32_t* tokens, S* out, int64_t n, int64_t d);
// grad[vocab, d] (=|+=) scatter-add of dx by token, in token order per column.
template <typename S>
void embed_backward(const int32_t* tokens, const S* dx, S* grad, int64_t n, int64_t d,
                    int64_t vocab, bool accumulate);

// ---- cross-entropy over logits rows
// true where row r counts (target >= 0 and mask null or non-zero).
inline bool ce_counts(const int32_t* targets, const uint8_t* mask, int64_t r) {
  return targets[r] >= 0 && (mask == nullptr || mask[r] != 0);
}
// For rows [0, n): row_loss[r] = lse - logit[target] (0 for ignored rows).
// If write_grad, logits are replaced in place by grad_scale *
// (softmax - onehot) (0 for ignored rows). Targets must be < vocab. The
// softmax denominator is summed in double (vocab may be 10^5 terms).
template <typename S>
void cross_entropy_rows(S* logits, const int32_t* targets, const uint8_t* mask, int64_t n,
                        int64_t vocab, bool write_grad, S grad_scale, double* row_loss);

// ---- a whole decoder layer
// Indexed by LayerTensor (p[kQProj]); shapes as in the weight table.
template <typename S>
using LayerParams = LayerArray<const S*>;
template <typename S>
using LayerParamGrads = LayerArray<S*>;

// Activations and scratch of one layer for up to max_tokens tokens. Not
// thread-safe: one call at a time.
// LoRA dropout of one call (LayerWeights::lora_dropout_on / lora_seed).
struct LoraDropout {
  bool on = false;
  uint64_t seed = 0;
  uint64_t row0 = 0;  // the first row's index in the whole run (LayerWeights::lora_row0)
};

template <typename S>
class LayerMath {
 public:
  // Allocates everything (may throw std::bad_alloc; CpuOps catches it).
  // attn_slots: see AttnScratch. max_seq sizes only the RoPE table (O(max_seq)).
  LayerMath(const LlamaDims& dims, int64_t max_tokens, int64_t max_seq, int attn_slots);
  // y may equal x.
  void forward(const LayerParams<S>& p, const S* x, S* y, int64_t B, int64_t T, const LoraDropout& dr = {});
  // dx may equal dy. grads overwritten; a null grad: frozen, not computed.
  void backward(const LayerParams<S>& p, const S* x, const S* dy, S* dx,
                const LayerParamGrads<S>& g, int64_t B, int64_t T, const LoraDropout& dr = {});

 private:
  void run_forward(const LayerParams<S>& p, const S* x, int64_t B, int64_t T, const LoraDropout& dr);
  const S* lora_input(int ti, const S* x, int64_t n, int64_t in, const LoraDropout& dr);
  void lora_forward(const LayerParams<S>& p, LayerTensor proj, const S* x, S* y, int64_t n, int64_t in,
                    int64_t out, const LoraDropout& dr);
  void lora_backward(const LayerParams<S>& p, LayerTensor proj, const S* x, const S* dy, S* dx,
                     const LayerParamGrads<S>& g, int64_t n, int64_t in, int64_t out, const LoraDropout& dr);
  LlamaDims d_;
  int64_t max_tokens_;
  RopeTable<S> rope_;
  AttnScratch<S> scratch_;
  // Saved by run_forward (per token): n1, q, k, v (roped), att and its
  // log-sum-exp per head, h, n2, g, u, a.
  std::vector<S> rstd1_, n1_, q_, k_, v_, att_, lse_, h_, rstd2_, n2_, g_, u_, a_;
  // qk_norm (Qwen3): q and k before their per-head RMSNorm, and its rstd.
  std::vector<S> q_raw_, k_raw_, rstd_q_, rstd_k_;
  // Backward scratch.
  std::vector<S> dh_, dbig_, dbig2_, dq_, dk_, dv_, datt_, dn_, dq_raw_, dk_raw_;
  // LoRA scratch: x A^T [n, r] and its gradient, the adapter's output (or
  // its scaled gradient) [n, widest], the dropped-out input [n, widest].
  std::vector<S> lora_xa_, lora_dxa_, lora_out_, lora_xd_;
};

// The final norm, logits and cross-entropy, chunked over tokens so that only
// chunk_rows x vocab logits exist at a time. The chunk size depends only on
// (vocab, max_tokens), so results do not depend on threads.
template <typename S>
class HeadMath {
 public:
  // chunk_rows > 0 overrides the chunk size (tests exercise several chunks).
  HeadMath(const LlamaDims& dims, int64_t max_tokens, int64_t chunk_rows = 0);
  // Any of loss / dx / grads may be skipped: dx == nullptr means forward
  // only (grads ignored); a null grad with dx given: that tensor is frozen. dloss: see ModelOps::head_forward_backward.
  void run(const S* norm_w, const S* lm_head, const S* x, const int32_t* targets,
           const uint8_t* mask, int64_t n, S dloss, LossStats* loss, S* dx, S* grad_norm,
           S* grad_lm_head);
  void logits(const S* norm_w, const S* lm_head, const S* x, int64_t n, S* out);
  int64_t chunk_rows() const { return chunk_; }

 private:
  LlamaDims d_;
  int64_t max_tokens_, chunk_;
  std::vector<S> xn_, rstd_, logits_, dxn_;
  std::vector<double> row_loss_;
};

}  // namespace strata::train::cpu
