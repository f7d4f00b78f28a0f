#include "train/cpu_ops.h"

#include <fmt/format.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <new>
#include <optional>
#include <utility>
#include <vector>

#include "common/float_convert.h"
#include "train/cpu_kernels.h"

namespace strata::train {

Status LlamaDims::validate() const {
  auto bad = [&](const char* what) {
    return Status(StatusCode::kInvalidArgument, fmt::format("Llama dims ({}): {}", to_string(), what));
  };
  if (dim <= 0 || heads <= 0 || kv_heads <= 0 || head_dim <= 0 || ffn_dim <= 0 || vocab <= 0)
    return bad("every size must be positive");
  if (heads % kv_heads != 0) return bad("heads must be a multiple of kv_heads");
  if (head_dim % 2 != 0) return bad("head_dim must be even (rotary embeddings pair halves)");
  if (!(rms_eps > 0)) return bad("rms_eps must be > 0");
  if (!(rope_theta > 0)) return bad("rope_theta must be > 0");
  if (vocab > INT32_MAX) return bad("vocab must fit int32 token ids");
  if (lora_targets & ~kAllLoraTargets) return bad("unknown LoRA target bits");
  if (lora_targets != 0 && lora_rank <= 0) return bad("LoRA targets need a positive rank");
  if (lora_targets != 0 && !(lora_dropout >= 0.0f && lora_dropout < 1.0f)) return bad("LoRA dropout must be in [0, 1)");
  if (lora_targets != 0 && !std::isfinite(lora_scaling)) return bad("LoRA scaling must be finite");
  return Status::ok_status();
}

std::string LlamaDims::to_string() const {
  return fmt::format(
      "dim={} heads={} kv_heads={} head_dim={} ffn_dim={} vocab={} rms_eps={} rope_theta={} tied={}{}",
      dim, heads, kv_heads, head_dim, ffn_dim, vocab, rms_eps, rope_theta, tied,
      lora_targets ? fmt::format(" lora_rank={} lora_targets={:#x} lora_scaling={} lora_dropout={}", lora_rank,
                                 lora_targets, lora_scaling, lora_dropout)
                   : std::string());
}

const char* cpu_ops_gemm_isa() { return cpu::gemm_isa(); }

namespace {

Status bad_arg(const std::string& what) { return Status(StatusCode::kInvalidArgument, what); }

template <typename P>
bool any_null(const LayerArray<P>& a, const LlamaDims& d) {
  for (LayerTensor t : kAllLayerTensors)
    if (d.has(t) && !a[t]) return true;  // tensors the model does not have may be null
  return false;
}

class CpuOps final : public ModelOps {
 public:
  CpuOps(const CpuOpsOptions& o, int threads)
      : dims_(o.dims),
        max_tokens_(o.max_batch * o.max_seq),
        max_seq_(o.max_seq),
        arena_(threads) {}

  // Allocations happen inside the arena so that the attention scratch has
  // one slot per arena thread.
  Status init() {
    Status st;
    const auto no_memory = [&] {
      return Status(StatusCode::kOutOfMemory,
                    fmt::format("CPU train ops: workspace for {} tokens (max_seq {}) of {} does not fit in memory",
                                max_tokens_, max_seq_, dims_.to_string()));
    };
    // The arena starts (its threads and their stacks) in the first execute,
    // which may throw before the lambda runs (a small ulimit -v).
    try {
      arena_.execute([&] {
        try {
          const int slots = tbb::this_task_arena::max_concurrency();
          layer_.emplace(dims_, max_tokens_, max_seq_, slots);
          head_.emplace(dims_, max_tokens_);
        } catch (const std::bad_alloc&) {
          st = no_memory();
        }
      });
    } catch (const std::bad_alloc&) {
      return no_memory().with_context("starting the CPU threads");
    } catch (const std::exception& e) {
      return Status(StatusCode::kUnavailable, fmt::format("CPU train ops: starting the CPU threads failed: {}", e.what()));
    }
    return st;
  }

  const LlamaDims& dims() const override { return dims_; }
  int64_t max_tokens() const override { return max_tokens_; }
  int64_t max_seq() const override { return max_seq_; }
  const char* name() const override { return "cpu"; }
  bool synchronous() const override { return true; }  // computes in the call, on host memory

  Status embed_forward(const EmbedWeights& w, const int32_t* tokens, int64_t B, int64_t T,
                       float* x_out) override {
    STRATA_RETURN_IF_ERROR(check_shape("embed_forward", B, T));
    STRATA_RETURN_IF_ERROR(check_dtype("embed_forward", w.dtype));
    if (!w.embed_tokens || !tokens || !x_out) return null_arg("embed_forward");
    STRATA_RETURN_IF_ERROR(check_tokens("embed_forward", "token", tokens, B * T, false));
    const int64_t n = B * T, D = dims_.dim;
    if (w.dtype == DType::kF32) {
      run([&] { cpu::embed_forward(static_cast<const float*>(w.embed_tokens), tokens, x_out, n, D); });
      return Status::ok_status();
    }
    // Only the rows used are converted (each conversion is exact).
    run([&] {
      tbb_rows(n, [&](int64_t r) {
        const int64_t off = static_cast<int64_t>(tokens[r]) * D;
        convert(w.embed_tokens, w.dtype, off, D, x_out + r * D);
      });
    });
    return Status::ok_status();
  }

  Status embed_backward(const int32_t* tokens, int64_t B, int64_t T, const float* dx,
                        float* grad_embed, bool accumulate) override {
    STRATA_RETURN_IF_ERROR(check_shape("embed_backward", B, T));
    if (!tokens || !dx || !grad_embed) return null_arg("embed_backward");
    STRATA_RETURN_IF_ERROR(check_tokens("embed_backward", "token", tokens, B * T, false));
    run([&] {
      cpu::embed_backward(tokens, dx, grad_embed, B * T, dims_.dim, dims_.vocab, accumulate);
    });
    return Status::ok_status();
  }

  Status layer_forward(const LayerWeights& w, int64_t B, int64_t T, const float* x_in,
                       float* x_out) override {
    STRATA_RETURN_IF_ERROR(check_shape("layer_forward", B, T));
    STRATA_RETURN_IF_ERROR(check_layer("layer_forward", w));
    if (!x_in || !x_out) return null_arg("layer_forward");
    STRATA_RETURN_IF_ERROR(ensure_conv(w));
    run([&] { layer_->forward(layer_params(w), x_in, x_out, B, T, dropout(w)); });
    return Status::ok_status();
  }

  Status layer_backward(const LayerWeights& w, int64_t B, int64_t T, const float* x_in,
                        const float* dy, float* dx, const LayerGrads& g) override {
    STRATA_RETURN_IF_ERROR(check_shape("layer_backward", B, T));
    STRATA_RETURN_IF_ERROR(check_layer("layer_backward", w));
    // A null gradient is a frozen tensor's (model_ops.h).
    if (!x_in || !dy || !dx) return null_arg("layer_backward");
    STRATA_RETURN_IF_ERROR(ensure_conv(w));
    run([&] { layer_->backward(layer_params(w), x_in, dy, dx, g, B, T, dropout(w)); });
    return Status::ok_status();
  }

  Status head_forward_backward(const HeadWeights& w, const float* x, const int32_t* targets,
                               const uint8_t* mask, int64_t B, int64_t T, float dloss,
                               LossStats* loss, float* dx, const HeadGrads& g) override {
    STRATA_RETURN_IF_ERROR(check_head("head_forward_backward", w, x, B, T));
    if (!targets || !loss || !dx) return null_arg("head_forward_backward");  // null grads: frozen
    if (dx == x) return bad_arg("head_forward_backward: dx must not alias x");
    STRATA_RETURN_IF_ERROR(check_tokens("head_forward_backward", "target", targets, B * T, true));
    STRATA_RETURN_IF_ERROR(ensure_conv(w.dtype));
    run([&] {
      const auto [nw, lm] = head_params(w);
      head_->run(nw, lm, x, targets, mask, B * T, dloss, loss, dx, g.norm, g.lm_head);
    });
    return Status::ok_status();
  }

  Status head_loss(const HeadWeights& w, const float* x, const int32_t* targets,
                   const uint8_t* mask, int64_t B, int64_t T, LossStats* loss) override {
    STRATA_RETURN_IF_ERROR(check_head("head_loss", w, x, B, T));
    if (!targets || !loss) return null_arg("head_loss");
    STRATA_RETURN_IF_ERROR(check_tokens("head_loss", "target", targets, B * T, true));
    STRATA_RETURN_IF_ERROR(ensure_conv(w.dtype));
    run([&] {
      const auto [nw, lm] = head_params(w);
      head_->run(nw, lm, x, targets, mask, B * T, 0.0f, loss, nullptr, nullptr, nullptr);
    });
    return Status::ok_status();
  }

  Status head_logits(const HeadWeights& w, const float* x, int64_t B, int64_t T,
                     float* logits) override {
    STRATA_RETURN_IF_ERROR(check_head("head_logits", w, x, B, T));
    if (!logits) return null_arg("head_logits");
    STRATA_RETURN_IF_ERROR(ensure_conv(w.dtype));
    run([&] {
      const auto [nw, lm] = head_params(w);
      head_->logits(nw, lm, x, B * T, logits);
    });
    return Status::ok_status();
  }

 private:
  template <typename F>
  void run(F&& f) {
    arena_.execute(std::forward<F>(f));
  }

  template <typename F>
  static void tbb_rows(int64_t n, F&& f) {
    tbb::parallel_for(int64_t{0}, n, [&](int64_t r) { f(r); });
  }

  Status check_shape(const char* op, int64_t B, int64_t T) const {
    if (B < 1 || T < 1 || T > max_seq_ || B > max_tokens_ / T)
      return bad_arg(fmt::format(
          "{}: batch {} x seq {} does not fit the workspace (max_seq {}, max tokens {})", op, B, T,
          max_seq_, max_tokens_));
    return Status::ok_status();
  }
  static Status check_dtype(const char* op, DType d) {
    if (d != DType::kF32 && d != DType::kBF16 && d != DType::kF16)
      return bad_arg(fmt::format("{}: unknown dtype code {}", op, static_cast<int>(d)));
    return Status::ok_status();
  }
  static Status null_arg(const char* op) {
    return bad_arg(fmt::format("{}: a required pointer is null", op));
  }
  Status check_layer(const char* op, const LayerWeights& w) const {
    STRATA_RETURN_IF_ERROR(check_dtype(op, w.dtype));
    if (dims_.lora_targets) STRATA_RETURN_IF_ERROR(check_dtype(op, w.lora_dtype));
    if (any_null(w.ptr, dims_))
      return bad_arg(fmt::format("{}: a layer weight pointer is null", op));
    return Status::ok_status();
  }
  Status check_head(const char* op, const HeadWeights& w, const float* x, int64_t B,
                    int64_t T) const {
    STRATA_RETURN_IF_ERROR(check_shape(op, B, T));
    STRATA_RETURN_IF_ERROR(check_dtype(op, w.dtype));
    if (!w.norm || !w.lm_head || !x) return null_arg(op);
    return Status::ok_status();
  }
  // Ids must be in [0, vocab); targets may also be negative (ignored).
  Status check_tokens(const char* op, const char* what, const int32_t* ids, int64_t n,
                      bool allow_negative) const {
    for (int64_t r = 0; r < n; ++r) {
      const int32_t t = ids[r];
      if (t >= dims_.vocab || (t < 0 && !allow_negative))
        return bad_arg(fmt::format("{}: {} id {} at position {} is outside [0, {})", op, what, t,
                                   r, dims_.vocab));
    }
    return Status::ok_status();
  }

  // The conversion buffer, allocated once, by the first non-fp32 call.
  Status ensure_conv(const LayerWeights& w) {
    return ensure_conv(dims_.lora_targets && w.lora_dtype != DType::kF32 ? w.lora_dtype : w.dtype);
  }
  Status ensure_conv(DType d) {
    if (d == DType::kF32 || !conv_.empty()) return Status::ok_status();
    const int64_t need = std::max(dims_.layer_params(), dims_.numel(kLmHead) + dims_.numel(kFinalNorm));
    try {
      conv_.resize(static_cast<size_t>(need));
    } catch (const std::bad_alloc&) {
      return Status(StatusCode::kOutOfMemory,
                    fmt::format("CPU train ops: {} floats to convert weights to fp32", need));
    }
    return Status::ok_status();
  }

  static void convert(const void* src, DType d, int64_t offset, int64_t count, float* dst) {
    widen_to_f32(static_cast<const uint16_t*>(src) + offset, d, static_cast<size_t>(count), dst);
  }

  // fp32: the pointer itself; otherwise converted into conv_ at *cursor.
  // Runs inside the arena (parallel over fixed blocks).
  const float* as_f32(const void* p, DType d, int64_t numel, int64_t* cursor) {
    if (d == DType::kF32) return static_cast<const float*>(p);
    float* dst = conv_.data() + *cursor;
    *cursor += numel;
    constexpr int64_t kBlock = 1 << 16;
    const int64_t nb = (numel + kBlock - 1) / kBlock;
    tbb::parallel_for(int64_t{0}, nb, [&](int64_t b) {
      const int64_t s = b * kBlock;
      convert(p, d, s, std::min(kBlock, numel - s), dst + s);
    });
    return dst;
  }

  // Every tensor in table order, each converted into conv_ after the last.
  cpu::LayerParams<float> layer_params(const LayerWeights& w) {
    int64_t c = 0;
    cpu::LayerParams<float> p;
    for (LayerTensor t : kAllLayerTensors) {
      const DType d = weight_row(t).feature == Feature::kLora ? w.lora_dtype : w.dtype;
      p[t] = dims_.has(t) ? as_f32(w[t], d, dims_.numel(t), &c) : nullptr;
    }
    return p;
  }
  cpu::LoraDropout dropout(const LayerWeights& w) const { return {w.lora_dropout_on, w.lora_seed, w.lora_row0}; }

  std::pair<const float*, const float*> head_params(const HeadWeights& w) {
    int64_t c = 0;
    const float* nw = as_f32(w.norm, w.dtype, dims_.numel(kFinalNorm), &c);
    const float* lm = as_f32(w.lm_head, w.dtype, dims_.numel(kLmHead), &c);
    return {nw, lm};
  }

  LlamaDims dims_;
  int64_t max_tokens_, max_seq_;
  tbb::task_arena arena_;
  std::optional<cpu::LayerMath<float>> layer_;
  std::optional<cpu::HeadMath<float>> head_;
  std::vector<float> conv_;
};

}  // namespace

Result<std::unique_ptr<ModelOps>> create_cpu_ops(const CpuOpsOptions& options) {
  STRATA_RETURN_IF_ERROR(options.dims.validate());
  if (options.max_batch < 1 || options.max_seq < 1)
    return bad_arg(fmt::format("CPU train ops: max_batch {} and max_seq {} must be >= 1",
                               options.max_batch, options.max_seq));
  if (options.threads < 0 || options.threads > (1 << 16))
    return bad_arg(fmt::format("CPU train ops: threads {} is outside [0, 65536]", options.threads));
  const int threads = options.threads > 0 ? options.threads : tbb::task_arena::automatic;
  auto ops = std::make_unique<CpuOps>(options, threads);
  STRATA_RETURN_IF_ERROR(ops->init());
  return std::unique_ptr<ModelOps>(std::move(ops));
}

}  // namespace strata::train
