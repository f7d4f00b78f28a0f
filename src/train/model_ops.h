// ModelOps: the forward and backward math of a Llama-architecture decoder,
// one parameter group at a time, as the trainer drives it over the offload
// engine (runtime/engine.h): acquire a group, call the op with the pointers
// the engine hands out, release; in backward, reduce_grad the fp32 gradient
// buffers the op filled.
//
// Semantics are Hugging Face's LlamaForCausalLM (modeling_llama.py) exactly:
//   embed:  x = embed_tokens[token]
//   layer:  h = x + o_proj(attn(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1)))
//               with n1 = rmsnorm(x, input_layernorm)
//           y = h + down_proj(silu(gate_proj(n2)) * up_proj(n2))
//               with n2 = rmsnorm(h, post_attention_layernorm)
//   head:   logits = rmsnorm(x, norm) @ lm_head^T;  loss = mean cross-entropy
//   rmsnorm(x, w) = w * (x * rsqrt(mean(x^2) + rms_eps))   (weight applied last)
//   rope:   HF rotate_half convention: element i pairs with i + head_dim/2;
//           position ids 0..T-1 in every sequence; inv_freq as
//           model/rope.h computes it for the config's RoPE type (default:
//           1 / rope_theta^(2i/head_dim)); angle = float(pos) * inv_freq[i]
//           in fp32 and cos/sin times the attention scaling (as HF does).
//   attn:   causal, grouped-query (query head h reads kv head
//           h / (heads / kv_heads)), scale 1/sqrt(head_dim), softmax in fp32
//           with max subtraction. No attention mask besides causality: every
//           row of the batch is one sequence of T tokens.
//
// Layouts. Every activation is fp32, row-major [B*T, width] with token
// (b, t) in row b*T + t. Weights are row-major in HF's shapes, as the weight
// table (model/llama_weights.h) gives them:
//   q_proj [heads*head_dim, dim]   k_proj, v_proj [kv_heads*head_dim, dim]
//   o_proj [dim, heads*head_dim]   gate_proj, up_proj [ffn_dim, dim]
//   down_proj [dim, ffn_dim]       input_layernorm, post_attention_layernorm,
//   norm [dim]                     embed_tokens, lm_head [vocab, dim]
// A layer's weights and gradients are LayerArrays indexed by LayerTensor
// (w[kQProj]), never filled by position.
// Weights come in their compute dtype (fp32/bf16/fp16, one dtype per call);
// an op converts them to fp32 once per call (exactly: bf16/fp16 -> fp32 is
// exact) and computes and accumulates in fp32. Gradients are fp32 buffers of
// the parameter's full numel, ready for Engine::reduce_grad(..., kF32, ...).
//
// Gradients OVERWRITE: every backward op writes every element of every
// gradient buffer it is given (it never reads them), so the caller need not
// zero them. The one exception is embed_backward(accumulate = true), which
// exists for tied embeddings (below).
//
// Tied embeddings (dims.tied): lm_head IS embed_tokens. The trainer passes
// the embedding's pointer as HeadWeights::lm_head, lets
// head_forward_backward write the head's contribution into a [vocab, dim]
// fp32 buffer G (HeadGrads::lm_head), then after the layers' backward calls
// embed_backward(..., G, /*accumulate=*/true), which scatter-adds the
// embedding's contribution into G; G is then the whole gradient of the one
// tensor and is reduce_grad'ed once (the engine refuses a parameter reduced
// twice in a micro-batch). Untied: two buffers, accumulate = false.
//
// Activation checkpointing: layer_forward keeps nothing; layer_backward gets
// the layer's input again and recomputes the forward internally.
//
// Loss and its gradient: targets are already shifted (targets[b*T + t] is
// the token that should follow position t). A position is ignored when its
// target is negative (HF's ignore_index -100; any negative value counts) or,
// if `mask` is non-null, when mask[b*T + t] == 0. loss = mean over the
// counted positions of -log softmax(logits)[target]. The backward computes
// the gradient of dloss * loss, where dloss is 1 for plain training and the
// fp16 loss scale when the engine scales (Engine::loss_scale()). When no
// position counts, loss = 0 and every gradient is 0 (HF would give NaN).
// Gradient accumulation needs nothing here: the engine averages the
// micro-batches' gradients.
//
// Workspace: an implementation allocates everything at creation from
// (dims, max_batch * max_seq tokens): calls with B*T <= max_tokens and
// T <= max_seq allocate nothing.
//
// Aliasing: layer_forward's x_out may equal x_in; layer_backward's dx may
// equal dy; head_forward_backward's dx may not alias x. Other buffers must not
// overlap.
//
// Blocking and threads: the CPU implementation (train/cpu_ops.h) is
// synchronous and uses its own TBB arena internally. A device implementation
// enqueues on the stream it was created with: its pointers are device
// pointers and an Ok status means the work was accepted, as in
// device/device_backend.h (the loss is then available after a synchronize;
// see that implementation's header). One ModelOps object is driven by one
// thread at a time (it owns one workspace).
//
// Errors (Status): kInvalidArgument for B, T beyond the workspace, null
// pointers, token or target ids outside [0, vocab), a dtype outside the enum.
// Nothing aborts on such input.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "model/llama_weights.h"

namespace strata::train {

struct LlamaDims {
  int64_t dim = 0;       // hidden_size
  int64_t heads = 0;     // num_attention_heads
  int64_t kv_heads = 0;  // num_key_value_heads (divides heads)
  int64_t head_dim = 0;  // hidden_size / heads unless the config says otherwise; even
  int64_t ffn_dim = 0;   // intermediate_size
  int64_t vocab = 0;     // vocab_size
  double rms_eps = 1e-6;       // rms_norm_eps
  double rope_theta = 10000.0; // rope_theta
  // RoPE inverse frequencies (head_dim / 2; model/rope.h computes them for
  // every supported type); empty: the default type's from rope_theta. cos and
  // sin are multiplied by rope_attention_scaling (yarn's attention factor).
  std::vector<float> rope_inv_freq;
  float rope_attention_scaling = 1.0f;
  bool tied = false;           // tie_word_embeddings
  bool qkv_bias = false;       // Qwen2: q/k/v projections add biases (kQBias, kKBias, kVBias)
  bool qk_norm = false;        // Qwen3: RMSNorm of each q and k head before RoPE (kQNorm, kKNorm)

  int64_t q_dim() const { return heads * head_dim; }
  int64_t kv_dim() const { return kv_heads * head_dim; }
  // The sizes the weight table's shapes are made of.
  LlamaExtents extents() const { return {dim, q_dim(), kv_dim(), ffn_dim, vocab, head_dim, lora_rank}; }
  // LoRA (PEFT): the adapted projections (a bit per kLoraTargets entry; 0:
  // no LoRA), the rank, scaling (lora_alpha / r, or / sqrt(r) with rsLoRA)
  // and the dropout probability on the adapters' input.
  uint32_t lora_targets = 0;
  int64_t lora_rank = 0;
  float lora_scaling = 0.0f;
  float lora_dropout = 0.0f;

  // Whether this model has tensor t (its architecture's features, the LoRA targets).
  bool has(LayerTensor t) const { return layer_has(t, qkv_bias, qk_norm, lora_targets); }
  // Elements of one tensor (0 for a tensor this model does not have).
  int64_t numel(LayerTensor t) const { return has(t) ? weight_row(t).numel(extents()) : 0; }
  int64_t numel(ModelTensor t) const { return weight_row(t).numel(extents()); }
  // Elements of all the tensors of one decoder layer.
  int64_t layer_params() const {
    int64_t n = 0;
    for (LayerTensor t : kAllLayerTensors) n += numel(t);
    return n;
  }
  // kInvalidArgument naming the offending field (non-positive sizes, heads
  // not a multiple of kv_heads, odd head_dim, eps <= 0, theta <= 0, LoRA
  // targets without a positive rank, dropout outside [0, 1)).
  Status validate() const;
  std::string to_string() const;  // "dim=256 heads=8 kv_heads=4 ..."
};

// One decoder layer's parameters as the engine hands them out (pointers into
// the acquired group; not owned), all in `dtype`, indexed by LayerTensor:
// w[kQProj] is [heads*head_dim, dim] (shapes: the weight table).
struct LayerWeights {
  DType dtype = DType::kF32;
  // The LoRA adapters' dtype (PEFT keeps them in fp32 beside a bf16/fp16 base).
  DType lora_dtype = DType::kF32;
  // LoRA dropout (dims.lora_dropout > 0): on for training calls, with the
  // seed of this layer; the mask of element (row, i) of an adapter's input
  // is a pure function of (seed, target, (lora_row0 + row) x width + i),
  // where lora_row0 is the micro-batch's first token row in the whole run
  // (its first sample x T): the same sequence draws the same mask whatever
  // micro-batch, rank or batch size carries it, and different sequences
  // draw independent ones. The forward and the backward of one micro-batch
  // must pass the same values (the backward recomputes the forward). Off:
  // evaluation (no dropout).
  bool lora_dropout_on = false;
  uint64_t lora_seed = 0;
  uint64_t lora_row0 = 0;
  LayerArray<const void*> ptr;
  const void*& operator[](LayerTensor t) { return ptr[t]; }
  const void* operator[](LayerTensor t) const { return ptr[t]; }
};

// The same parameters' gradients: fp32, caller-owned, overwritten. A null
// pointer for a tensor the model has means the tensor is frozen (a LoRA
// base): its gradient is not computed (the input gradient through it is).
using LayerGrads = LayerArray<float*>;

// The tensors outside the layers (kEmbedTokens, kFinalNorm, kLmHead in the
// weight table) keep named fields; callers fill them with designated
// initializers ({.dtype = ..., .norm = ..., .lm_head = ...}).
struct EmbedWeights {
  DType dtype = DType::kF32;
  const void* embed_tokens = nullptr;  // [vocab, dim]
};

// model.norm and lm_head (tied: the embedding's pointer). norm and lm_head
// share `dtype`.
struct HeadWeights {
  DType dtype = DType::kF32;
  const void* norm = nullptr;     // [dim]
  const void* lm_head = nullptr;  // [vocab, dim]
};

// Null: that tensor is frozen, its gradient not computed.
struct HeadGrads {
  float* norm = nullptr;     // [dim]
  float* lm_head = nullptr;  // [vocab, dim]
};

// The loss over one batch: sum of the per-position losses (accumulated in
// double, in position order) and how many positions counted. Evaluation over
// many batches sums both and divides once.
struct LossStats {
  double sum = 0;
  int64_t count = 0;
  double mean() const { return count > 0 ? sum / static_cast<double>(count) : 0.0; }
};

class ModelOps {
 public:
  virtual ~ModelOps() = default;

  virtual const LlamaDims& dims() const = 0;
  virtual int64_t max_tokens() const = 0;  // B*T capacity of the workspace
  virtual int64_t max_seq() const = 0;     // T capacity (rope tables)
  virtual const char* name() const = 0;    // "cpu", "cuda"
  // True when every call has finished its work (and read and written every
  // buffer) by the time it returns, so the caller must make the memory it
  // passes ready first (synchronize the engine's stream after an acquire, wait
  // for gradient downloads before overwriting a buffer). False for a device
  // implementation that enqueues on its stream (stream order does that).
  // The default is the safe answer: a caller that synchronizes needlessly is
  // only slower.
  virtual bool synchronous() const { return true; }

  // x_out[B*T, dim] = embed_tokens[tokens]. Token ids must be in [0, vocab).
  virtual Status embed_forward(const EmbedWeights& w, const int32_t* tokens, int64_t B, int64_t T,
                               float* x_out) = 0;
  // grad_embed[vocab, dim]: scatter-add of dx[B*T, dim] by token (rows not
  // used stay 0). accumulate = false overwrites grad_embed; true adds into
  // its contents (tied embeddings, see the header comment).
  virtual Status embed_backward(const int32_t* tokens, int64_t B, int64_t T, const float* dx,
                                float* grad_embed, bool accumulate) = 0;

  // x_out[B*T, dim] = layer(x_in). Keeps nothing (activation checkpointing).
  virtual Status layer_forward(const LayerWeights& w, int64_t B, int64_t T, const float* x_in,
                               float* x_out) = 0;
  // Recomputes layer(x_in), then backpropagates dy (d loss / d x_out):
  // dx = d loss / d x_in; every buffer of `grads` is overwritten.
  virtual Status layer_backward(const LayerWeights& w, int64_t B, int64_t T, const float* x_in,
                                const float* dy, float* dx, const LayerGrads& grads) = 0;

  // Final RMSNorm, logits, masked mean cross-entropy (into *loss) and its
  // backward for dloss * loss: dx[B*T, dim] and grads (overwritten).
  // mask may be null.
  virtual Status head_forward_backward(const HeadWeights& w, const float* x, const int32_t* targets,
                                       const uint8_t* mask, int64_t B, int64_t T, float dloss,
                                       LossStats* loss, float* dx, const HeadGrads& grads) = 0;
  // Forward only (evaluation).
  virtual Status head_loss(const HeadWeights& w, const float* x, const int32_t* targets,
                           const uint8_t* mask, int64_t B, int64_t T, LossStats* loss) = 0;
  // logits[B*T, vocab] (fp32) for x: evaluation, generation, reference tests.
  virtual Status head_logits(const HeadWeights& w, const float* x, int64_t B, int64_t T,
                             float* logits) = 0;
};

struct CpuOpsOptions {
  LlamaDims dims;
  int64_t max_batch = 1;
  int64_t max_seq = 1;
  // TBB threads of the ops' own arena; 0: TBB's default concurrency.
  // Results are bitwise identical for every thread count.
  int threads = 0;
};

// The CPU implementation (train/cpu_ops.h). Errors: kInvalidArgument (dims,
// sizes), kOutOfMemory (the workspace).
Result<std::unique_ptr<ModelOps>> create_cpu_ops(const CpuOpsOptions& options);

}  // namespace strata::train
