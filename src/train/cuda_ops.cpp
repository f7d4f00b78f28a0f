#include "train/cuda_ops.h"

#include <fmt/format.h>

#include <cstring>
#include <mutex>
#include <vector>

#include "common/log.h"
#include "cuda/train/train_module_abi.h"
#include "device/cuda_backend.h"
#include "device/cuda_loader.h"
#include "device/cuda_status.h"
#include "model/rope.h"

namespace strata::train {
namespace {

constexpr const char* kModuleName = "libstrata_cuda_train.so";

struct TrainModule {
  const strata_cuda_train_api_v1_t* api = nullptr;
  std::string path;
};

Result<TrainModule> load_once() {
  auto m = load_cuda_sibling_module(kModuleName, STRATA_CUDA_TRAIN_API_SYMBOL);
  if (!m.ok()) return Status(m.status().code(), "CUDA model-ops module not loadable: " + m.status().message());
  const strata_cuda_train_api_v1_t* api = reinterpret_cast<strata_cuda_train_api_v1_fn>(m->symbol)();
  if (!api || api->abi_version != STRATA_CUDA_TRAIN_ABI_VERSION || api->struct_size < sizeof(strata_cuda_train_api_v1_t))
    return Status(StatusCode::kUnavailable, m->path + " speaks another model-ops ABI version; rebuild Strata");
  return TrainModule{api, m->path};
}

Result<TrainModule> load_module() {
  static std::once_flag once;
  static Result<TrainModule> result = Status(StatusCode::kInternal, "not loaded");
  std::call_once(once, [] { result = load_once(); });
  return result;
}

// The module's layer tensors are the weight table's, in the same order.
constexpr bool same(int module_index, int table_index) { return module_index == table_index; }
static_assert(same(STRATA_CUDA_TRAIN_LAYER_TENSORS, kLayerTensorCount));
static_assert(same(STRATA_CUDA_TRAIN_Q_BIAS, kQBias) && same(STRATA_CUDA_TRAIN_K_BIAS, kKBias) &&
              same(STRATA_CUDA_TRAIN_V_BIAS, kVBias) && same(STRATA_CUDA_TRAIN_Q_NORM, kQNorm) &&
              same(STRATA_CUDA_TRAIN_K_NORM, kKNorm) && same(STRATA_CUDA_TRAIN_LORA_FIRST, kQLoraA));
// The module's LoRA pairs follow kLoraTargets' order: (A, B) of Q, K, V, O, gate, up, down.
static_assert(lora_a_of(kDownProj) == STRATA_CUDA_TRAIN_LORA_FIRST + 12 && lora_b_of(kQProj) == kQLoraA + 1);
static_assert(same(STRATA_CUDA_TRAIN_INPUT_NORM, kInputNorm) && same(STRATA_CUDA_TRAIN_Q_PROJ, kQProj) &&
              same(STRATA_CUDA_TRAIN_K_PROJ, kKProj) && same(STRATA_CUDA_TRAIN_V_PROJ, kVProj) &&
              same(STRATA_CUDA_TRAIN_O_PROJ, kOProj) && same(STRATA_CUDA_TRAIN_POST_NORM, kPostNorm) &&
              same(STRATA_CUDA_TRAIN_GATE_PROJ, kGateProj) && same(STRATA_CUDA_TRAIN_UP_PROJ, kUpProj) &&
              same(STRATA_CUDA_TRAIN_DOWN_PROJ, kDownProj));

// A module return code and its text as a Status.
Status module_status(int rc, const char* err, const std::string& what) {
  return cuda_module_status(rc, err, "cuda train ops: " + what);
}

// Every tensor the model has must be given.
bool any_null(const LayerArray<const void*>& a, const LlamaDims& d) {
  for (LayerTensor t : kAllLayerTensors)
    if (d.has(t) && !a[t]) return true;
  return false;
}

#define STRATA_TRAIN_CALL(what, fn, ...)                            \
  do {                                                              \
    char _err[512] = {0};                                           \
    const int _rc = api_->fn(__VA_ARGS__, _err, sizeof(_err));      \
    if (_rc != 0) return module_status(_rc, _err, what);            \
  } while (0)

Status bad_arg(const std::string& what) { return Status(StatusCode::kInvalidArgument, what); }

// The module's view of the dims. RoPE's frequencies are always passed (in
// *freqs, which must outlive the module call): the default type's from
// model/rope.h when the dims carry none, as the CPU ops compute them, so
// that both backends rotate by the same fp32 frequencies.
Result<strata_cuda_train_dims_t> module_dims(const CudaOpsOptions& o, std::vector<float>* freqs) {
  STRATA_RETURN_IF_ERROR(o.dims.validate());
  if (o.max_batch < 1 || o.max_seq < 1 || o.max_batch > INT_MAX / o.max_seq)
    return bad_arg(fmt::format("CUDA train ops: max_batch {} and max_seq {} must be >= 1 with a product < 2^31",
                               o.max_batch, o.max_seq));
  strata_cuda_train_dims_t d{};
  d.dim = o.dims.dim;
  d.heads = o.dims.heads;
  d.kv_heads = o.dims.kv_heads;
  d.head_dim = o.dims.head_dim;
  d.ffn_dim = o.dims.ffn_dim;
  d.vocab = o.dims.vocab;
  d.rms_eps = o.dims.rms_eps;
  d.rope_theta = o.dims.rope_theta;
  *freqs = o.dims.rope_inv_freq;
  if (freqs->empty()) {
    model::RopeSettings r;
    r.theta = o.dims.rope_theta;
    *freqs = model::rope_frequencies(r, o.dims.head_dim).inv_freq;
  }
  d.rope_inv_freq = freqs->data();
  d.rope_attention_scaling = o.dims.rope_attention_scaling;
  d.max_tokens = o.max_batch * o.max_seq;
  d.max_seq = o.max_seq;
  d.allow_tf32 = o.allow_tf32 ? 1 : 0;
  d.attention_fp32 = o.attention_fp32 ? 1 : 0;
  d.qkv_bias = o.dims.qkv_bias ? 1 : 0;
  d.qk_norm = o.dims.qk_norm ? 1 : 0;
  d.lora_targets = o.dims.lora_targets;
  d.lora_rank = o.dims.lora_targets ? o.dims.lora_rank : 0;
  d.lora_scaling = o.dims.lora_scaling;
  d.lora_dropout = o.dims.lora_dropout;
  return d;
}

class CudaOps final : public ModelOps {
 public:
  CudaOps(DeviceBackend& backend, DeviceStream* stream, const CudaOpsOptions& o, const strata_cuda_train_api_v1_t* api)
      : backend_(backend),
        stream_(stream),
        api_(api),
        dims_(o.dims),
        max_tokens_(o.max_batch * o.max_seq),
        max_seq_(o.max_seq) {}

  ~CudaOps() override {
    // Host functions still queued read pinned_; kernels use the workspace.
    Status st = backend_.synchronize(stream_);
    if (!st.ok()) log_warn("cuda train ops: stream error at destruction: {}", st.to_string());
    if (ctx_) {
      char err[512] = {0};
      if (api_->ctx_destroy(ctx_, err, sizeof(err)) != 0) log_warn("cuda train ops: {}", err);
    }
    if (workspace_) {
      st = backend_.free(workspace_);
      if (!st.ok()) log_warn("cuda train ops: freeing the workspace: {}", st.to_string());
    }
    backend_.free_pinned(pinned_);
  }

  Status init(const strata_cuda_train_dims_t& d, int device, void* native_stream) {
    size_t bytes = 0;
    STRATA_TRAIN_CALL("workspace size", workspace_bytes, &d, &bytes);
    auto ws = backend_.alloc(bytes);
    if (!ws.ok())
      return Status(ws.status().code(), fmt::format("cuda train ops: workspace of {} bytes for {} tokens: {}", bytes,
                                                    max_tokens_, ws.status().message()));
    workspace_ = ws.value();
    STRATA_ASSIGN_OR_RETURN(pinned_, backend_.alloc_pinned(sizeof(strata_cuda_train_report_t)));
    report_ = static_cast<strata_cuda_train_report_t*>(pinned_.ptr);
    STRATA_TRAIN_CALL("context creation", ctx_create, device, native_stream, &d, workspace_, bytes, &ctx_);
    return Status::ok_status();
  }

  const LlamaDims& dims() const override { return dims_; }
  // Which attention kernel layers with weights in `dtype` run (a module string).
  std::string attention_kernel(DType dtype) const { return api_->attention_kernel(ctx_, static_cast<int>(dtype)); }
  int64_t max_tokens() const override { return max_tokens_; }
  int64_t max_seq() const override { return max_seq_; }
  const char* name() const override { return "cuda"; }
  bool synchronous() const override { return false; }  // stream-ordered

  Status embed_forward(const EmbedWeights& w, const int32_t* tokens, int64_t B, int64_t T, float* x_out) override {
    constexpr const char* op = "embed_forward";
    STRATA_RETURN_IF_ERROR(check_shape(op, B, T));
    STRATA_RETURN_IF_ERROR(check_dtype(op, w.dtype));
    if (!w.embed_tokens || !tokens || !x_out) return null_arg(op);
    STRATA_TRAIN_CALL(op, embed_forward, ctx_, static_cast<int>(w.dtype), w.embed_tokens, tokens, B * T, x_out);
    return enqueue_report(op, nullptr);
  }

  Status embed_backward(const int32_t* tokens, int64_t B, int64_t T, const float* dx, float* grad_embed,
                        bool accumulate) override {
    constexpr const char* op = "embed_backward";
    STRATA_RETURN_IF_ERROR(check_shape(op, B, T));
    if (!tokens || !dx || !grad_embed) return null_arg(op);
    STRATA_TRAIN_CALL(op, embed_backward, ctx_, tokens, B * T, dx, grad_embed, accumulate ? 1 : 0);
    return enqueue_report(op, nullptr);
  }

  Status layer_forward(const LayerWeights& w, int64_t B, int64_t T, const float* x_in, float* x_out) override {
    constexpr const char* op = "layer_forward";
    STRATA_RETURN_IF_ERROR(check_shape(op, B, T));
    STRATA_RETURN_IF_ERROR(check_layer(op, w));
    if (!x_in || !x_out) return null_arg(op);
    const strata_cuda_train_layer_t lw = layer(w);
    STRATA_TRAIN_CALL(op, layer_forward, ctx_, &lw, B, T, x_in, x_out);
    return Status::ok_status();
  }

  Status layer_backward(const LayerWeights& w, int64_t B, int64_t T, const float* x_in, const float* dy, float* dx,
                        const LayerGrads& g) override {
    constexpr const char* op = "layer_backward";
    STRATA_RETURN_IF_ERROR(check_shape(op, B, T));
    STRATA_RETURN_IF_ERROR(check_layer(op, w));
    if (!x_in || !dy || !dx) return null_arg(op);  // a null gradient: frozen (model_ops.h)
    const strata_cuda_train_layer_t lw = layer(w);
    strata_cuda_train_layer_grads_t lg{};
    for (LayerTensor t : kAllLayerTensors) lg.tensors[t] = dims_.has(t) ? g[t] : nullptr;
    STRATA_TRAIN_CALL(op, layer_backward, ctx_, &lw, B, T, x_in, dy, dx, &lg);
    return Status::ok_status();
  }

  Status head_forward_backward(const HeadWeights& w, const float* x, const int32_t* targets, const uint8_t* mask,
                               int64_t B, int64_t T, float dloss, LossStats* loss, float* dx,
                               const HeadGrads& grads) override {
    constexpr const char* op = "head_forward_backward";
    STRATA_RETURN_IF_ERROR(check_head(op, w, x, B, T));
    if (!targets || !dx) return null_arg(op);  // null grads: frozen
    if (dx == x) return bad_arg(fmt::format("{}: dx may not alias x", op));
    strata_cuda_train_head_t h = head(w, x, B, T);
    h.targets = targets;
    h.mask = mask;
    h.dloss = dloss;
    h.dx = dx;
    h.grad_norm = grads.norm;
    h.grad_lm_head = grads.lm_head;
    STRATA_TRAIN_CALL(op, head, ctx_, &h);
    return enqueue_report(op, loss);
  }

  Status head_loss(const HeadWeights& w, const float* x, const int32_t* targets, const uint8_t* mask, int64_t B,
                   int64_t T, LossStats* loss) override {
    constexpr const char* op = "head_loss";
    STRATA_RETURN_IF_ERROR(check_head(op, w, x, B, T));
    if (!targets) return null_arg(op);
    strata_cuda_train_head_t h = head(w, x, B, T);
    h.targets = targets;
    h.mask = mask;
    STRATA_TRAIN_CALL(op, head, ctx_, &h);
    return enqueue_report(op, loss);
  }

  Status head_logits(const HeadWeights& w, const float* x, int64_t B, int64_t T, float* logits) override {
    constexpr const char* op = "head_logits";
    STRATA_RETURN_IF_ERROR(check_head(op, w, x, B, T));
    if (!logits) return null_arg(op);
    strata_cuda_train_head_t h = head(w, x, B, T);
    h.logits = logits;
    STRATA_TRAIN_CALL(op, head, ctx_, &h);
    return Status::ok_status();
  }

 private:
  Status check_shape(const char* op, int64_t B, int64_t T) const {
    if (B < 1 || T < 1 || T > max_seq_ || B > max_tokens_ / T)
      return bad_arg(fmt::format("{}: batch {} x seq {} does not fit the workspace (max_seq {}, max tokens {})", op, B,
                                 T, max_seq_, max_tokens_));
    return Status::ok_status();
  }
  static Status check_dtype(const char* op, DType d) {
    if (d != DType::kF32 && d != DType::kBF16 && d != DType::kF16)
      return bad_arg(fmt::format("{}: unknown dtype code {}", op, static_cast<int>(d)));
    return Status::ok_status();
  }
  static Status null_arg(const char* op) { return bad_arg(fmt::format("{}: a required pointer is null", op)); }
  Status check_layer(const char* op, const LayerWeights& w) const {
    STRATA_RETURN_IF_ERROR(check_dtype(op, w.dtype));
    if (dims_.lora_targets && w.lora_dtype != DType::kF32)
      return bad_arg(fmt::format("{}: the CUDA ops take fp32 LoRA adapters", op));
    if (any_null(w.ptr, dims_))
      return bad_arg(fmt::format("{}: a layer weight pointer is null", op));
    return Status::ok_status();
  }
  Status check_head(const char* op, const HeadWeights& w, const float* x, int64_t B, int64_t T) const {
    STRATA_RETURN_IF_ERROR(check_shape(op, B, T));
    STRATA_RETURN_IF_ERROR(check_dtype(op, w.dtype));
    if (!w.norm || !w.lm_head || !x) return null_arg(op);
    return Status::ok_status();
  }

  strata_cuda_train_layer_t layer(const LayerWeights& w) const {
    strata_cuda_train_layer_t lw{};
    lw.dtype = static_cast<int>(w.dtype);
    lw.lora_dtype = static_cast<int>(w.lora_dtype);
    lw.lora_dropout_on = w.lora_dropout_on ? 1 : 0;
    lw.lora_seed = w.lora_seed;
    lw.lora_row0 = w.lora_row0;
    for (LayerTensor t : kAllLayerTensors) lw.tensors[t] = dims_.has(t) ? w[t] : nullptr;
    return lw;
  }
  static strata_cuda_train_head_t head(const HeadWeights& w, const float* x, int64_t B, int64_t T) {
    strata_cuda_train_head_t h{};
    h.dtype = static_cast<int>(w.dtype);
    h.norm = w.norm;
    h.lm_head = w.lm_head;
    h.x = x;
    h.B = B;
    h.T = T;
    h.dloss = 1.0f;
    return h;
  }

  // The device report (loss, bad-id flags) to the pinned buffer, then a host
  // function that hands the loss over and turns bad ids into the stream's
  // error. One pinned buffer is enough: the next call's copy runs only after
  // this host function returned (stream order).
  Status enqueue_report(const char* op, LossStats* loss) {
    STRATA_TRAIN_CALL(std::string(op) + ": report copy", report_copy_async, ctx_, report_);
    const strata_cuda_train_report_t* src = report_;
    const int64_t vocab = dims_.vocab;
    return backend_.host_func_async(stream_, [src, loss, op, vocab]() -> Status {
      const strata_cuda_train_report_t r = *src;
      if (loss) {
        loss->sum = r.loss_sum;
        loss->count = r.loss_count;
      }
      if (r.bad_ids == 0) return Status::ok_status();
      std::string what;
      if (r.bad_ids & STRATA_CUDA_TRAIN_BAD_TOKEN_FWD) what += "a token id (embed_forward) ";
      if (r.bad_ids & STRATA_CUDA_TRAIN_BAD_TOKEN_BWD) what += "a token id (embed_backward) ";
      if (r.bad_ids & STRATA_CUDA_TRAIN_BAD_TARGET) what += "a target id ";
      return bad_arg(fmt::format("cuda train ops, {}: {}outside [0, {}) in device memory (read as zero / ignored)",
                                 op, what, vocab));
    });
  }

  DeviceBackend& backend_;
  DeviceStream* stream_;
  const strata_cuda_train_api_v1_t* api_;
  LlamaDims dims_;
  int64_t max_tokens_, max_seq_;
  strata_cuda_train_ctx_t* ctx_ = nullptr;
  void* workspace_ = nullptr;
  HostAllocation pinned_;
  strata_cuda_train_report_t* report_ = nullptr;
};

}  // namespace

Result<std::string> load_cuda_train_module() {
  STRATA_ASSIGN_OR_RETURN(TrainModule m, load_module());
  return m.path;
}

Result<uint64_t> cuda_ops_workspace_bytes(const CudaOpsOptions& options) {
  std::vector<float> freqs;
  STRATA_ASSIGN_OR_RETURN(strata_cuda_train_dims_t d, module_dims(options, &freqs));
  STRATA_ASSIGN_OR_RETURN(TrainModule m, load_module());
  size_t bytes = 0;
  char err[512] = {0};
  const int rc = m.api->workspace_bytes(&d, &bytes, err, sizeof(err));
  if (rc != 0) return module_status(rc, err, "workspace size");
  return static_cast<uint64_t>(bytes);
}

Result<std::string> cuda_ops_attention_kernel(const ModelOps& ops, DType dtype) {
  const auto* cuda = dynamic_cast<const CudaOps*>(&ops);
  if (!cuda) return bad_arg("cuda_ops_attention_kernel: the ops are not CUDA ops");
  return cuda->attention_kernel(dtype);
}

Result<std::unique_ptr<ModelOps>> create_cuda_ops(DeviceBackend& backend, DeviceStream* stream,
                                                  const CudaOpsOptions& options) {
  std::vector<float> freqs;
  STRATA_ASSIGN_OR_RETURN(strata_cuda_train_dims_t d, module_dims(options, &freqs));
  // The module first: where there is no GPU or cuBLAS, its reason is the
  // useful answer (kUnavailable), whatever backend the caller fell back to.
  STRATA_ASSIGN_OR_RETURN(TrainModule m, load_module());
  if (backend.kind() != DeviceKind::kCuda)
    return bad_arg("CUDA train ops need the cuda device backend, not '" + backend.name() + "'");
  if (!stream || stream->owner() != &backend) return bad_arg("CUDA train ops: the stream is null or another backend's");
  STRATA_ASSIGN_OR_RETURN(CudaNativeStream native, cuda_native_stream(stream));
  auto ops = std::make_unique<CudaOps>(backend, stream, options, m.api);
  STRATA_RETURN_IF_ERROR(ops->init(d, native.device, native.stream));
  return std::unique_ptr<ModelOps>(std::move(ops));
}

}  // namespace strata::train
