// CudaOps (train/cuda_ops.h) against CpuOps (the reference, itself checked
// against finite differences and PyTorch): every op's outputs and gradients,
// then a 2-layer model's whole forward and backward. Label gpu: without a
// CUDA device the tests skip and say why.
//
// Errors are normwise: max |got - want| / max |want| over a tensor, so one
// tolerance serves tensors of any scale. Tolerances:
//   fp32 weights: 1e-4 (fp32 GEMMs without TF32 and fp32 kernels; only the
//                 summation order and expf/cosf differ from the CPU);
//   bf16 weights: 2e-2 (activations are rounded to bf16 before each product:
//                 relative 2^-9 per element, compounded through a layer);
//   embedding:    exact forward (a copy), 1e-6 backward (same token order);
//   loss:         1e-5 relative (fp32), 5e-3 (bf16).
// Every reference tensor is checked to be non-zero, and device outputs are
// pre-filled with NaN, so an op that writes nothing cannot pass.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/float_convert.h"
#include "device/cuda_backend.h"
#include "device/cuda_loader.h"
#include "device/device_backend.h"
#include "small_model.h"
#include "train/cuda_ops.h"
#include "train/model_ops.h"
#include "test_util/gpu.h"

namespace strata::train {
namespace {

#ifdef STRATA_TEST_CUDA_MODULE
// Point the loader at the modules just built (libstrata_cuda_train.so is
// looked up next to libstrata_cuda.so) before anything reads the tunables.
const bool kModuleSet = [] { return setenv("STRATA_CUDA_MODULE", STRATA_TEST_CUDA_MODULE, 1) == 0; }();
#endif

constexpr double kTolF32 = 1e-4;
constexpr double kTolBf16 = 2e-2;

LlamaDims test_dims(bool tied = false) { return testing::small_dims(/*ffn_dim=*/172, /*vocab=*/97, tied); }
constexpr int64_t kMaxBatch = 3, kMaxSeq = 16;

double tol_for(DType dt) { return dt == DType::kF32 ? kTolF32 : kTolBf16; }

// A tensor in `dtype` on the host (what the CPU reads) and on the device.
struct Blob {
  DType dtype = DType::kF32;
  std::vector<uint8_t> bytes;
  void* dev = nullptr;
  const void* host() const { return bytes.data(); }
};

std::vector<float> randn(std::mt19937_64& rng, int64_t n, double scale, double offset = 0.0) {
  return testing::random_vec<float>(rng, n, scale, offset);
}

std::vector<uint8_t> encode(const std::vector<float>& v, DType dt) {
  std::vector<uint8_t> out(v.size() * dtype_size(dt));
  if (dt == DType::kF32) {
    std::memcpy(out.data(), v.data(), out.size());
    return out;
  }
  auto* p = reinterpret_cast<uint16_t*>(out.data());
  for (size_t i = 0; i < v.size(); ++i) p[i] = dt == DType::kBF16 ? f32_to_bf16_bits(v[i]) : f32_to_f16_bits(v[i]);
  return out;
}

// max |got - want| / max |want|; infinity when got has a non-finite value.
double normwise_err(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, mag = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, std::abs(static_cast<double>(got[i]) - want[i]));
    mag = std::max(mag, std::abs(static_cast<double>(want[i])));
  }
  return mag > 0 ? diff / mag : diff;
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::abs(static_cast<double>(x)));
  return m;
}

#define EXPECT_CLOSE(got, want, tol, what)                                                          \
  do {                                                                                              \
    EXPECT_GT(max_abs(want), 0.0) << (what) << ": the reference is all zeros (a vacuous check)";   \
    const double _e = normwise_err((got), (want));                                                  \
    EXPECT_LE(_e, (tol)) << (what) << ": normwise error " << _e << " (tolerance " << (tol) << ")"; \
  } while (0)

class CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DeviceBackendOptions o;
    o.kind = DeviceBackendKind::kCuda;
    o.budget_bytes = 1ull << 30;
    auto b = create_device_backend(o);
    if (!b.ok()) {
      ASSERT_EQ(b.status().code(), StatusCode::kUnavailable) << b.status().to_string();
      STRATA_SKIP_WITHOUT_GPU("no CUDA device here: " << b.status().message());
    }
    backend_ = std::move(b).value();
    auto s = backend_->create_stream("cuda-ops-test");
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    stream_ = s.value();
  }
  void TearDown() override {
    if (!backend_) return;
    gpu_.reset();
    for (void* p : allocs_) EXPECT_TRUE(backend_->free(p).ok());
    // A test that provoked an asynchronous error leaves the stream failed.
    Status st = backend_->destroy_stream(stream_);
    if (!expect_stream_error_) {
      EXPECT_TRUE(st.ok()) << st.to_string();
    }
  }

  void make_ops(const LlamaDims& dims, bool tf32 = false, int64_t max_batch = kMaxBatch, int64_t max_seq = kMaxSeq) {
    CudaOpsOptions co;
    co.dims = dims;
    co.max_batch = max_batch;
    co.max_seq = max_seq;
    co.allow_tf32 = tf32;
    auto g = create_cuda_ops(*backend_, stream_, co);
    ASSERT_TRUE(g.ok()) << "a CUDA device exists but the CUDA ops do not start: " << g.status().to_string();
    gpu_ = std::move(g).value();
    ASSERT_STREQ(gpu_->name(), "cuda");
    CpuOpsOptions po;
    po.dims = dims;
    po.max_batch = max_batch;
    po.max_seq = max_seq;
    auto c = create_cpu_ops(po);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    cpu_ = std::move(c).value();
  }

  void* dev_alloc(size_t bytes) {
    auto p = backend_->alloc(bytes);
    EXPECT_TRUE(p.ok()) << p.status().to_string();
    if (!p.ok()) return nullptr;
    allocs_.push_back(p.value());
    return p.value();
  }
  void upload(void* dst, const void* src, size_t bytes) {
    ASSERT_TRUE(backend_->copy_async(dst, src, bytes, CopyKind::kHostToDevice, stream_).ok());
    ASSERT_TRUE(backend_->synchronize(stream_).ok());
  }
  template <typename T>
  T* up(const std::vector<T>& v) {
    void* d = dev_alloc(std::max<size_t>(1, v.size() * sizeof(T)));
    if (d && !v.empty()) upload(d, v.data(), v.size() * sizeof(T));
    return static_cast<T*>(d);
  }
  // A device fp32 buffer of n NaNs (outputs must overwrite every element).
  float* nan_buffer(int64_t n) { return up(std::vector<float>(static_cast<size_t>(n), std::nanf(""))); }
  std::vector<float> down(const float* d, int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    Status st = backend_->synchronize(stream_);
    EXPECT_TRUE(st.ok()) << st.to_string();
    EXPECT_TRUE(backend_->copy_async(v.data(), d, v.size() * sizeof(float), CopyKind::kDeviceToHost, stream_).ok());
    st = backend_->synchronize(stream_);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return v;
  }
  Blob blob(const std::vector<float>& values, DType dt) {
    Blob b;
    b.dtype = dt;
    b.bytes = encode(values, dt);
    b.dev = up(b.bytes);
    return b;
  }
  Blob blob(std::mt19937_64& rng, int64_t n, DType dt, double scale, double offset = 0.0) {
    return blob(randn(rng, n, scale, offset), dt);
  }

  struct Layer {
    DType dtype = DType::kF32;
    LayerArray<Blob> t;
    LayerWeights weights(bool device) const {
      LayerWeights w;
      w.dtype = dtype;
      for (LayerTensor i : kAllLayerTensors) w[i] = device ? t[i].dev : t[i].host();
      return w;
    }
  };
  // The shared small model's layer (filled through the weight table), with
  // scales for this test: larger q, k (peakier attention), down_proj by
  // 1/sqrt(ffn_dim), the rest by 1/sqrt(dim); norms near 1.
  Layer make_layer(std::mt19937_64& rng, const LlamaDims& d, DType dt) {
    const double ws = 1.0 / std::sqrt(static_cast<double>(d.dim));
    const double ws_f = 1.0 / std::sqrt(static_cast<double>(d.ffn_dim));
    testing::LayerBlob<float> host;
    host.init_scaled(rng, d, [&](LayerTensor t) -> testing::InitScale {
      if (weight_row(t).norm) return {0.1, 1.0};
      if (t == kQProj || t == kKProj) return {2 * ws};
      return {t == kDownProj ? ws_f : ws};
    });
    Layer l;
    l.dtype = dt;
    // LoRA adapters are fp32 whatever the model's dtype (LayerWeights::lora_dtype).
    for (LayerTensor t : kAllLayerTensors) l.t[t] = blob(host[t], weight_row(t).feature == Feature::kLora ? DType::kF32 : dt);
    return l;
  }

  // Gradient buffers of one layer: NaN-filled on the device, on the host.
  struct Grads {
    LayerArray<std::vector<float>> host;
    LayerArray<float*> dev;
    LayerGrads view(bool device) {
      LayerGrads g;
      for (LayerTensor t : kAllLayerTensors) g[t] = device ? dev[t] : host[t].data();
      return g;
    }
  };
  Grads make_grads(const LlamaDims& d) {
    Grads g;
    for (LayerTensor t : kAllLayerTensors) {
      g.host[t].assign(static_cast<size_t>(d.numel(t)), 0.0f);
      g.dev[t] = nan_buffer(d.numel(t));
    }
    return g;
  }
  void expect_grads(Grads& g, double tol, const std::string& what) {
    for (LayerTensor t : kAllLayerTensors)
      EXPECT_CLOSE(down(g.dev[t], static_cast<int64_t>(g.host[t].size())), g.host[t], tol,
                   what + " grad " + testing::label(t));
  }

  // One layer's forward and backward on B x T tokens against the CPU ops,
  // out of place and in place (x_out == x_in, dx == dy, as the trainer runs
  // them; the in-place backward overwrites fresh gradients).
  void check_layer(const Layer& layer, const LlamaDims& d, DType dt, int64_t B, int64_t T, std::mt19937_64& rng) {
    const int64_t n = B * T;
    const std::vector<float> x = randn(rng, n * d.dim, 1.0);
    const std::vector<float> dy = randn(rng, n * d.dim, 1.0);
    const float* x_d = up(x);

    std::vector<float> y(x.size());
    ASSERT_TRUE(cpu_->layer_forward(layer.weights(false), B, T, x.data(), y.data()).ok());
    float* y_d = nan_buffer(n * d.dim);
    ASSERT_TRUE(gpu_->layer_forward(layer.weights(true), B, T, x_d, y_d).ok());
    EXPECT_CLOSE(down(y_d, n * d.dim), y, tol_for(dt), "layer output");
    float* xy_d = up(x);
    ASSERT_TRUE(gpu_->layer_forward(layer.weights(true), B, T, xy_d, xy_d).ok());
    EXPECT_CLOSE(down(xy_d, n * d.dim), y, tol_for(dt), "layer output in place");

    std::vector<float> dx(x.size());
    Grads g = make_grads(d);
    ASSERT_TRUE(cpu_->layer_backward(layer.weights(false), B, T, x.data(), dy.data(), dx.data(), g.view(false)).ok());
    const float* dy_d = up(dy);
    float* dx_d = nan_buffer(n * d.dim);
    ASSERT_TRUE(gpu_->layer_backward(layer.weights(true), B, T, x_d, dy_d, dx_d, g.view(true)).ok());
    EXPECT_CLOSE(down(dx_d, n * d.dim), dx, tol_for(dt), "layer dx");
    expect_grads(g, tol_for(dt), "layer");
    float* dxy_d = up(dy);
    Grads g2 = make_grads(d);
    g2.host = g.host;
    ASSERT_TRUE(gpu_->layer_backward(layer.weights(true), B, T, x_d, dxy_d, dxy_d, g2.view(true)).ok());
    EXPECT_CLOSE(down(dxy_d, n * d.dim), dx, tol_for(dt), "layer dx in place");
    expect_grads(g2, tol_for(dt), "layer (in place)");
  }

  std::vector<int32_t> random_ids(std::mt19937_64& rng, int64_t n, int64_t vocab) {
    std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(vocab - 1));
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& t : v) t = dist(rng);
    return v;
  }

  std::unique_ptr<DeviceBackend> backend_;
  DeviceStream* stream_ = nullptr;
  std::unique_ptr<ModelOps> gpu_, cpu_;
  std::vector<void*> allocs_;
  bool expect_stream_error_ = false;
};

// ---------------------------------------------------------------- embedding

TEST_F(CudaOpsTest, EmbeddingForwardAndBackward) {
  const LlamaDims d = test_dims();
  make_ops(d);
  std::mt19937_64 rng(1);
  const int64_t B = 2, T = 16, n = B * T;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Blob table = blob(rng, d.vocab * d.dim, dt, 1.0);
    std::vector<int32_t> tokens = random_ids(rng, n, d.vocab);
    tokens[3] = tokens[7] = tokens[20] = 5;  // a repeated token: its gradient row sums three rows
    const int32_t* tok_d = up(tokens);

    std::vector<float> want(static_cast<size_t>(n * d.dim));
    ASSERT_TRUE(
        cpu_->embed_forward({.dtype = dt, .embed_tokens = table.host()}, tokens.data(), B, T, want.data()).ok());
    float* x_d = nan_buffer(n * d.dim);
    ASSERT_TRUE(gpu_->embed_forward({.dtype = dt, .embed_tokens = table.dev}, tok_d, B, T, x_d).ok());
    EXPECT_EQ(down(x_d, n * d.dim), want) << "embedding rows are copies: they must match exactly";

    const std::vector<float> dx = randn(rng, n * d.dim, 1.0);
    const float* dx_d = up(dx);
    for (bool accumulate : {false, true}) {
      SCOPED_TRACE(accumulate ? "accumulate" : "overwrite");
      const std::vector<float> init = randn(rng, d.vocab * d.dim, 1.0);
      std::vector<float> g = init;
      ASSERT_TRUE(cpu_->embed_backward(tokens.data(), B, T, dx.data(), g.data(), accumulate).ok());
      float* g_d = accumulate ? up(init) : nan_buffer(d.vocab * d.dim);
      ASSERT_TRUE(gpu_->embed_backward(tok_d, B, T, dx_d, g_d, accumulate).ok());
      EXPECT_CLOSE(down(g_d, d.vocab * d.dim), g, 1e-6, "embedding gradient");
    }
  }
}

// ---------------------------------------------------------------- one layer

class CudaOpsLayerTest : public CudaOpsTest, public ::testing::WithParamInterface<DType> {};

TEST_P(CudaOpsLayerTest, ForwardAndBackwardMatchCpu) {
  const DType dt = GetParam();
  const LlamaDims d = test_dims();
  make_ops(d);
  std::mt19937_64 rng(2);
  const Layer layer = make_layer(rng, d, dt);
  // The full shape, then a ragged one (B*T below capacity, T < max_seq).
  for (auto [B, T] : {std::pair<int64_t, int64_t>{2, 16}, {3, 7}}) {
    SCOPED_TRACE("B=" + std::to_string(B) + " T=" + std::to_string(T));
    ASSERT_NO_FATAL_FAILURE(check_layer(layer, d, dt, B, T, rng));
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaOpsLayerTest, ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// A long sequence at a real head size: head_dim 128, GQA 8/2, one sequence
// of 4096 tokens, fp32 (the fp32 attention) and bf16 (the tensor-core
// attention) against the CPU ops. The attention keeps no
// T x T matrix (per-row log-sum-exp, probabilities recomputed in backward):
// its scratch is 2 x 8 x 4096 floats, where the probabilities and their
// gradient would take 2 x 8 x 4096^2 x 4 B = 1 GiB, the whole budget here.
TEST_F(CudaOpsTest, LongSequenceAtRealHeadSizeMatchesCpu) {
  LlamaDims d = testing::small_dims(/*ffn_dim=*/1536, /*vocab=*/97);
  d.dim = 1024;
  d.heads = 8;
  d.kv_heads = 2;
  d.head_dim = 128;
  make_ops(d, false, /*max_batch=*/1, /*max_seq=*/4096);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(std::string(dtype_name(dt)) + ", T = 4096");
    std::mt19937_64 rng(11);
    const Layer layer = make_layer(rng, d, dt);
    ASSERT_NO_FATAL_FAILURE(check_layer(layer, d, dt, 1, 4096, rng));
  }
}

// The tensor-core attention (cuda/train/attention_mma.cuh: bf16/fp16 weights,
// head_dim 64 or 128) at the tiles' edges: one row, a tile less one, a tile
// plus one, two tiles and a part; batch 2, GQA 4/2. Its numbers are those of
// the layer's other bf16 products (bf16 operands, fp32 sums), so the layer
// tolerance is the bf16 one. The same kernels' source runs on the CPU in
// every CI job (tests/cuda/attention_mma_emulated_test.cpp); this is where
// they meet the tensor cores.
TEST_F(CudaOpsTest, TensorCoreAttentionMatchesCpuAtTileEdges) {
  for (int64_t hd : {64, 128}) {
    LlamaDims d = testing::small_dims(/*ffn_dim=*/320, /*vocab=*/97);
    d.dim = 256;
    d.heads = 4;
    d.kv_heads = 2;
    d.head_dim = hd;
    make_ops(d, false, /*max_batch=*/2, /*max_seq=*/130);
    auto kernel = cuda_ops_attention_kernel(*gpu_, DType::kBF16);
    ASSERT_TRUE(kernel.ok()) << kernel.status().to_string();
    EXPECT_EQ(kernel->rfind("tensor-core", 0), 0u) << "head_dim " << hd << ": " << *kernel;
    auto fp32_kernel = cuda_ops_attention_kernel(*gpu_, DType::kF32);
    ASSERT_TRUE(fp32_kernel.ok());
    EXPECT_EQ(fp32_kernel->rfind("fp32", 0), 0u) << *fp32_kernel;
    for (int64_t T : {1, 63, 65, 130}) {
      SCOPED_TRACE("head_dim " + std::to_string(hd) + ", T = " + std::to_string(T));
      std::mt19937_64 rng(static_cast<uint64_t>(hd * 1000 + T));
      const Layer layer = make_layer(rng, d, DType::kBF16);
      ASSERT_NO_FATAL_FAILURE(check_layer(layer, d, DType::kBF16, 2, T, rng));
    }
  }
}

// The tensor-core attention against the fp32 attention kernels on the same
// GPU, same bf16 layer: only the attention's roundings differ (q, k, v, dout,
// P and dS to bf16, relative 2^-9 each): 1e-2 normwise. And its backward
// repeats bit for bit (fixed summation order, no atomics).
TEST_F(CudaOpsTest, TensorCoreAttentionAgreesWithFp32AttentionAndRepeats) {
  LlamaDims d = testing::small_dims(/*ffn_dim=*/320, /*vocab=*/97);
  d.dim = 512;
  d.heads = 4;
  d.kv_heads = 1;
  d.head_dim = 128;
  const int64_t B = 2, T = 200, n = B * T;
  make_ops(d, false, B, T);
  CudaOpsOptions fo;
  fo.dims = d;
  fo.max_batch = B;
  fo.max_seq = T;
  fo.attention_fp32 = true;
  auto f = create_cuda_ops(*backend_, stream_, fo);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  std::unique_ptr<ModelOps> fp32_attn = std::move(f).value();
  auto kernel = cuda_ops_attention_kernel(*fp32_attn, DType::kBF16);
  ASSERT_TRUE(kernel.ok());
  EXPECT_EQ(kernel->rfind("fp32", 0), 0u) << *kernel;

  std::mt19937_64 rng(5);
  const Layer layer = make_layer(rng, d, DType::kBF16);
  const std::vector<float> x = randn(rng, n * d.dim, 1.0), dy = randn(rng, n * d.dim, 1.0);
  const float* x_d = up(x);
  const float* dy_d = up(dy);
  auto run = [&](ModelOps& ops, std::vector<std::vector<float>>* got) {
    float* y_d = nan_buffer(n * d.dim);
    ASSERT_TRUE(ops.layer_forward(layer.weights(true), B, T, x_d, y_d).ok());
    Grads g = make_grads(d);
    float* dx_d = nan_buffer(n * d.dim);
    ASSERT_TRUE(ops.layer_backward(layer.weights(true), B, T, x_d, dy_d, dx_d, g.view(true)).ok());
    got->push_back(down(y_d, n * d.dim));
    got->push_back(down(dx_d, n * d.dim));
    for (LayerTensor t : kAllLayerTensors)
      if (d.has(t)) got->push_back(down(g.dev[t], d.numel(t)));
  };
  std::vector<std::vector<float>> tc, tc2, ref;
  ASSERT_NO_FATAL_FAILURE(run(*gpu_, &tc));
  ASSERT_NO_FATAL_FAILURE(run(*gpu_, &tc2));
  ASSERT_NO_FATAL_FAILURE(run(*fp32_attn, &ref));
  ASSERT_EQ(tc.size(), ref.size());
  for (size_t i = 0; i < tc.size(); ++i) {
    EXPECT_CLOSE(tc[i], ref[i], 1e-2, "tensor " + std::to_string(i) + " (0: y, 1: dx, then the gradients)");
    EXPECT_EQ(0, std::memcmp(tc[i].data(), tc2[i].data(), tc[i].size() * sizeof(float)))
        << "tensor " << i << " differs between two identical runs";
  }
}

// Qwen2's biases, Qwen3's q/k norms with an explicit head_dim, LoRA adapters
// (all or some projections, dropout on, the base frozen: null gradients)
// against the CPU ops.
struct FeatureCase {
  const char* name;
  DType dtype;
  bool qkv_bias, qk_norm;
  int64_t head_dim;  // 0: dim / heads
  uint32_t lora_targets;
  float lora_dropout;
};
class CudaOpsFeatureTest : public CudaOpsTest, public ::testing::WithParamInterface<FeatureCase> {};

TEST_P(CudaOpsFeatureTest, ForwardAndBackwardMatchCpu) {
  const FeatureCase fc = GetParam();
  LlamaDims d = test_dims();
  d.qkv_bias = fc.qkv_bias;
  d.qk_norm = fc.qk_norm;
  if (fc.head_dim) d.head_dim = fc.head_dim;
  if (fc.lora_targets) {
    d.lora_targets = fc.lora_targets;
    d.lora_rank = 4;
    d.lora_scaling = 1.5f;
    d.lora_dropout = fc.lora_dropout;
  }
  make_ops(d);
  std::mt19937_64 rng(11);
  const Layer layer = make_layer(rng, d, fc.dtype);
  const int64_t B = 2, T = 16, n = B * T;
  const std::vector<float> x = randn(rng, n * d.dim, 1.0);
  const std::vector<float> dy = randn(rng, n * d.dim, 1.0);
  const float* x_d = up(x);
  LayerWeights wc = layer.weights(false), wg = layer.weights(true);
  for (LayerWeights* w : {&wc, &wg}) {
    w->lora_dropout_on = fc.lora_dropout > 0;
    w->lora_seed = 0xfeed;
    w->lora_row0 = 3 * T;  // the masks' row offset (the micro-batch's first sample x T)
  }
  std::vector<float> y(x.size());
  ASSERT_TRUE(cpu_->layer_forward(wc, B, T, x.data(), y.data()).ok());
  float* y_d = nan_buffer(n * d.dim);
  ASSERT_TRUE(gpu_->layer_forward(wg, B, T, x_d, y_d).ok());
  EXPECT_CLOSE(down(y_d, n * d.dim), y, tol_for(fc.dtype), "layer output");
  std::vector<float> dx(x.size());
  Grads g = make_grads(d);
  LayerGrads gc = g.view(false), gg = g.view(true);
  const bool frozen = fc.lora_targets != 0;
  if (frozen)
    for (LayerTensor t : kAllLayerTensors)
      if (weight_row(t).feature != Feature::kLora) gc[t] = gg[t] = nullptr;
  ASSERT_TRUE(cpu_->layer_backward(wc, B, T, x.data(), dy.data(), dx.data(), gc).ok());
  float* dx_d = nan_buffer(n * d.dim);
  ASSERT_TRUE(gpu_->layer_backward(wg, B, T, x_d, up(dy), dx_d, gg).ok());
  EXPECT_CLOSE(down(dx_d, n * d.dim), dx, tol_for(fc.dtype), "layer dx");
  for (LayerTensor t : kAllLayerTensors) {
    if (!d.has(t) || !gg[t]) continue;
    EXPECT_CLOSE(down(g.dev[t], static_cast<int64_t>(g.host[t].size())), g.host[t], tol_for(fc.dtype),
                 "grad " + testing::label(t));
  }
}

constexpr uint32_t kQvo = (1u << 0) | (1u << 2) | (1u << 3);
INSTANTIATE_TEST_SUITE_P(
    Features, CudaOpsFeatureTest,
    ::testing::Values(FeatureCase{"qwen2_bias_fp32", DType::kF32, true, false, 0, 0, 0.0f},
                      FeatureCase{"qwen2_bias_bf16", DType::kBF16, true, false, 0, 0, 0.0f},
                      FeatureCase{"qwen3_qknorm_hd24_fp32", DType::kF32, false, true, 24, 0, 0.0f},
                      FeatureCase{"qwen3_qknorm_bf16", DType::kBF16, false, true, 0, 0, 0.0f},
                      FeatureCase{"lora_all_fp32", DType::kF32, false, false, 0, kAllLoraTargets, 0.0f},
                      FeatureCase{"lora_qvo_dropout_bf16", DType::kBF16, false, false, 0, kQvo, 0.2f},
                      FeatureCase{"lora_all_dropout_qwen2_bf16", DType::kBF16, true, false, 0, kAllLoraTargets, 0.1f},
                      FeatureCase{"lora_all_qwen3_fp32", DType::kF32, false, true, 24, kAllLoraTargets, 0.0f}),
    [](const auto& info) { return std::string(info.param.name); });

TEST_F(CudaOpsTest, LayerBackwardIsDeterministic) {
  const LlamaDims d = test_dims();
  make_ops(d);
  std::mt19937_64 rng(3);
  const Layer layer = make_layer(rng, d, DType::kBF16);
  const int64_t B = 2, T = 16, n = B * T;
  const float* x_d = up(randn(rng, n * d.dim, 1.0));
  const float* dy_d = up(randn(rng, n * d.dim, 1.0));
  std::vector<std::vector<float>> first;
  for (int run = 0; run < 2; ++run) {
    Grads g = make_grads(d);
    float* dx_d = nan_buffer(n * d.dim);
    ASSERT_TRUE(gpu_->layer_backward(layer.weights(true), B, T, x_d, dy_d, dx_d, g.view(true)).ok());
    std::vector<std::vector<float>> got{down(dx_d, n * d.dim)};
    for (LayerTensor t : kAllLayerTensors) got.push_back(down(g.dev[t], static_cast<int64_t>(g.host[t].size())));
    if (run == 0) {
      first = got;
    } else {
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_EQ(0, std::memcmp(got[i].data(), first[i].data(), got[i].size() * sizeof(float)))
            << "tensor " << i << " differs between two identical runs";
    }
  }
}

// ---------------------------------------------------------------- head

class CudaOpsHeadTest : public CudaOpsTest, public ::testing::WithParamInterface<DType> {};

TEST_P(CudaOpsHeadTest, LossLogitsAndGradientsMatchCpu) {
  const DType dt = GetParam();
  const LlamaDims d = test_dims();
  make_ops(d);
  std::mt19937_64 rng(4);
  const int64_t B = 2, T = 16, n = B * T;
  const Blob norm = blob(rng, d.dim, dt, 0.1, 1.0);
  const Blob lm = blob(rng, d.vocab * d.dim, dt, 1.0 / std::sqrt(static_cast<double>(d.dim)));
  const std::vector<float> x = randn(rng, n * d.dim, 1.0);
  std::vector<int32_t> targets = random_ids(rng, n, d.vocab);
  targets[0] = -100;  // ignored (HF's ignore_index)
  targets[9] = -1;    // any negative value is ignored
  std::vector<uint8_t> mask(static_cast<size_t>(n), 1);
  mask[5] = mask[6] = mask[30] = 0;
  const float* x_d = up(x);
  const int32_t* t_d = up(targets);
  const uint8_t* m_d = up(mask);
  const HeadWeights hw_c{.dtype = dt, .norm = norm.host(), .lm_head = lm.host()},
      hw_g{.dtype = dt, .norm = norm.dev, .lm_head = lm.dev};
  const double loss_tol = dt == DType::kF32 ? 1e-5 : 5e-3;

  for (bool with_mask : {false, true}) {
    SCOPED_TRACE(with_mask ? "mask" : "no mask");
    const uint8_t* mc = with_mask ? mask.data() : nullptr;
    const uint8_t* mg = with_mask ? m_d : nullptr;
    const float dloss = 2.5f;  // e.g. an fp16 loss scale
    LossStats lc, lg;
    std::vector<float> dx(x.size()), gn(static_cast<size_t>(d.dim)), glm(static_cast<size_t>(d.vocab * d.dim));
    ASSERT_TRUE(cpu_->head_forward_backward(hw_c, x.data(), targets.data(), mc, B, T, dloss, &lc, dx.data(),
                                            HeadGrads{.norm = gn.data(), .lm_head = glm.data()})
                    .ok());
    float* dx_d = nan_buffer(n * d.dim);
    float* gn_d = nan_buffer(d.dim);
    float* glm_d = nan_buffer(d.vocab * d.dim);
    lg.sum = -1;
    lg.count = -1;
    ASSERT_TRUE(gpu_->head_forward_backward(hw_g, x_d, t_d, mg, B, T, dloss, &lg, dx_d,
                                            HeadGrads{.norm = gn_d, .lm_head = glm_d})
                    .ok());
    ASSERT_TRUE(backend_->synchronize(stream_).ok());
    EXPECT_EQ(lg.count, lc.count);
    EXPECT_EQ(lc.count, with_mask ? n - 5 : n - 2);
    EXPECT_NEAR(lg.sum, lc.sum, loss_tol * std::abs(lc.sum)) << "loss sum";
    EXPECT_CLOSE(down(dx_d, n * d.dim), dx, tol_for(dt), "head dx");
    EXPECT_CLOSE(down(gn_d, d.dim), gn, tol_for(dt), "head grad norm");
    EXPECT_CLOSE(down(glm_d, d.vocab * d.dim), glm, tol_for(dt), "head grad lm_head");

    LossStats ec, eg;
    ASSERT_TRUE(cpu_->head_loss(hw_c, x.data(), targets.data(), mc, B, T, &ec).ok());
    ASSERT_TRUE(gpu_->head_loss(hw_g, x_d, t_d, mg, B, T, &eg).ok());
    ASSERT_TRUE(backend_->synchronize(stream_).ok());
    EXPECT_EQ(eg.count, ec.count);
    EXPECT_NEAR(eg.sum, ec.sum, loss_tol * std::abs(ec.sum)) << "head_loss";
    EXPECT_NEAR(eg.sum, lg.sum, 1e-6 * std::abs(lg.sum)) << "head_loss and head_forward_backward disagree";
  }

  std::vector<float> logits(static_cast<size_t>(n * d.vocab));
  ASSERT_TRUE(cpu_->head_logits(hw_c, x.data(), B, T, logits.data()).ok());
  float* l_d = nan_buffer(n * d.vocab);
  ASSERT_TRUE(gpu_->head_logits(hw_g, x_d, B, T, l_d).ok());
  EXPECT_CLOSE(down(l_d, n * d.vocab), logits, tol_for(dt), "logits");
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaOpsHeadTest, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST_F(CudaOpsTest, HeadWithNoCountedPositionGivesZeroLossAndGradients) {
  const LlamaDims d = test_dims();
  make_ops(d);
  std::mt19937_64 rng(5);
  const int64_t B = 1, T = 8, n = B * T;
  const Blob norm = blob(rng, d.dim, DType::kF32, 0.1, 1.0);
  const Blob lm = blob(rng, d.vocab * d.dim, DType::kF32, 0.1);
  const float* x_d = up(randn(rng, n * d.dim, 1.0));
  const int32_t* t_d = up(std::vector<int32_t>(static_cast<size_t>(n), -100));
  float* dx_d = nan_buffer(n * d.dim);
  float* gn_d = nan_buffer(d.dim);
  float* glm_d = nan_buffer(d.vocab * d.dim);
  LossStats l{-1, -1};
  ASSERT_TRUE(gpu_->head_forward_backward({.dtype = DType::kF32, .norm = norm.dev, .lm_head = lm.dev}, x_d, t_d,
                                          nullptr, B, T, 1.0f, &l, dx_d, {.norm = gn_d, .lm_head = glm_d})
                  .ok());
  ASSERT_TRUE(backend_->synchronize(stream_).ok());
  EXPECT_EQ(l.count, 0);
  EXPECT_EQ(l.sum, 0.0);
  for (auto [p, count] : {std::pair<float*, int64_t>{dx_d, n * d.dim}, {gn_d, d.dim}, {glm_d, d.vocab * d.dim}})
    for (float v : down(p, count)) ASSERT_EQ(v, 0.0f);
}

// ---------------------------------------------------------------- a whole model

struct ModelCase {
  DType dtype;
  bool tied;
};

class CudaOpsModelTest : public CudaOpsTest, public ::testing::WithParamInterface<ModelCase> {};

// embed -> 2 layers -> head forward/backward -> layers' backward -> embedding
// backward, exactly as the trainer drives the ops, on both implementations.
TEST_P(CudaOpsModelTest, TwoLayerForwardBackwardMatchesCpu) {
  const DType dt = GetParam().dtype;
  const bool tied = GetParam().tied;
  const LlamaDims d = test_dims(tied);
  make_ops(d);
  std::mt19937_64 rng(6);
  const int64_t B = 2, T = 16, n = B * T, nd = n * d.dim;
  const Blob embed = blob(rng, d.vocab * d.dim, dt, 1.0);
  const Layer layers[2] = {make_layer(rng, d, dt), make_layer(rng, d, dt)};
  const Blob norm = blob(rng, d.dim, dt, 0.1, 1.0);
  const Blob lm_own = tied ? Blob{} : blob(rng, d.vocab * d.dim, dt, 1.0 / std::sqrt(static_cast<double>(d.dim)));
  const Blob& lm = tied ? embed : lm_own;
  const std::vector<int32_t> tokens = random_ids(rng, n + 1, d.vocab);
  const std::vector<int32_t> inputs(tokens.begin(), tokens.end() - 1), targets(tokens.begin() + 1, tokens.end());
  const int32_t* in_d = up(inputs);
  const int32_t* tg_d = up(targets);

  // CPU.
  std::vector<float> x0(static_cast<size_t>(nd)), x1(x0.size()), x2(x0.size()), dx(x0.size()), dxa(x0.size());
  std::vector<float> gn(static_cast<size_t>(d.dim)), glm(static_cast<size_t>(d.vocab * d.dim), 0.0f),
      gemb(glm.size(), 0.0f);
  Grads g[2] = {make_grads(d), make_grads(d)};
  LossStats lc;
  ASSERT_TRUE(cpu_->embed_forward({.dtype = dt, .embed_tokens = embed.host()}, inputs.data(), B, T, x0.data()).ok());
  ASSERT_TRUE(cpu_->layer_forward(layers[0].weights(false), B, T, x0.data(), x1.data()).ok());
  ASSERT_TRUE(cpu_->layer_forward(layers[1].weights(false), B, T, x1.data(), x2.data()).ok());
  ASSERT_TRUE(cpu_->head_forward_backward({.dtype = dt, .norm = norm.host(), .lm_head = lm.host()}, x2.data(),
                                          targets.data(), nullptr, B, T, 1.0f, &lc, dx.data(),
                                          {.norm = gn.data(), .lm_head = glm.data()})
                  .ok());
  ASSERT_TRUE(cpu_->layer_backward(layers[1].weights(false), B, T, x1.data(), dx.data(), dx.data(), g[1].view(false)).ok());
  ASSERT_TRUE(cpu_->layer_backward(layers[0].weights(false), B, T, x0.data(), dx.data(), dxa.data(), g[0].view(false)).ok());
  ASSERT_TRUE(
      cpu_->embed_backward(inputs.data(), B, T, dxa.data(), tied ? glm.data() : gemb.data(), /*accumulate=*/tied).ok());

  // GPU: activations in place where the trainer would do so.
  float* x0_d = nan_buffer(nd);
  float* x1_d = nan_buffer(nd);
  float* x2_d = nan_buffer(nd);
  float* dx_d = nan_buffer(nd);
  float* dxa_d = nan_buffer(nd);
  float* gn_d = nan_buffer(d.dim);
  float* glm_d = nan_buffer(d.vocab * d.dim);
  float* gemb_d = tied ? nullptr : nan_buffer(d.vocab * d.dim);
  LossStats lg;
  ASSERT_TRUE(gpu_->embed_forward({.dtype = dt, .embed_tokens = embed.dev}, in_d, B, T, x0_d).ok());
  ASSERT_TRUE(gpu_->layer_forward(layers[0].weights(true), B, T, x0_d, x1_d).ok());
  ASSERT_TRUE(gpu_->layer_forward(layers[1].weights(true), B, T, x1_d, x2_d).ok());
  ASSERT_TRUE(gpu_->head_forward_backward({.dtype = dt, .norm = norm.dev, .lm_head = lm.dev}, x2_d, tg_d, nullptr, B,
                                          T, 1.0f, &lg, dx_d, {.norm = gn_d, .lm_head = glm_d})
                  .ok());
  ASSERT_TRUE(gpu_->layer_backward(layers[1].weights(true), B, T, x1_d, dx_d, dx_d, g[1].view(true)).ok());
  ASSERT_TRUE(gpu_->layer_backward(layers[0].weights(true), B, T, x0_d, dx_d, dxa_d, g[0].view(true)).ok());
  ASSERT_TRUE(gpu_->embed_backward(in_d, B, T, dxa_d, tied ? glm_d : gemb_d, tied).ok());
  ASSERT_TRUE(backend_->synchronize(stream_).ok());

  const double tol = tol_for(dt);
  EXPECT_EQ(lg.count, lc.count);
  EXPECT_NEAR(lg.sum, lc.sum, (dt == DType::kF32 ? 1e-5 : 5e-3) * std::abs(lc.sum)) << "loss";
  EXPECT_CLOSE(down(x2_d, nd), x2, tol, "hidden states after 2 layers");
  EXPECT_CLOSE(down(dxa_d, nd), dxa, tol, "gradient at the embedding output");
  EXPECT_CLOSE(down(gn_d, d.dim), gn, tol, "grad model.norm");
  EXPECT_CLOSE(down(glm_d, d.vocab * d.dim), glm, tol, tied ? "grad tied embedding (head + embedding)" : "grad lm_head");
  if (!tied) EXPECT_CLOSE(down(gemb_d, d.vocab * d.dim), gemb, 1e-6 + tol, "grad embed_tokens");
  expect_grads(g[1], tol, "layer 1");
  expect_grads(g[0], tol, "layer 0");
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaOpsModelTest,
                         ::testing::Values(ModelCase{DType::kF32, true}, ModelCase{DType::kF32, false},
                                           ModelCase{DType::kBF16, true}, ModelCase{DType::kBF16, false}),
                         [](const auto& info) {
                           return std::string(dtype_name(info.param.dtype)) + (info.param.tied ? "_tied" : "_untied");
                         });

// ---------------------------------------------------------------- errors

TEST_F(CudaOpsTest, HostVisibleArgumentErrorsAreReturned) {
  const LlamaDims d = test_dims();
  make_ops(d);
  std::mt19937_64 rng(7);
  const Layer layer = make_layer(rng, d, DType::kF32);
  float* x_d = nan_buffer(kMaxBatch * kMaxSeq * d.dim);
  EXPECT_EQ(gpu_->layer_forward(layer.weights(true), 1, kMaxSeq + 1, x_d, x_d).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->layer_forward(layer.weights(true), kMaxBatch + 1, kMaxSeq, x_d, x_d).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->layer_forward(layer.weights(true), 1, 4, nullptr, x_d).code(), StatusCode::kInvalidArgument);
  LayerWeights bad = layer.weights(true);
  bad.dtype = static_cast<DType>(7);
  EXPECT_EQ(gpu_->layer_forward(bad, 1, 4, x_d, x_d).code(), StatusCode::kInvalidArgument);
  const Blob norm = blob(rng, d.dim, DType::kF32, 1.0);
  const int32_t* t_d = up(std::vector<int32_t>(4, 1));
  LossStats l;
  EXPECT_EQ(gpu_->head_forward_backward({.dtype = DType::kF32, .norm = norm.dev, .lm_head = x_d}, x_d, t_d, nullptr, 1,
                                        4, 1.0f, &l, x_d, {.norm = x_d, .lm_head = x_d})
                .code(),
            StatusCode::kInvalidArgument)
      << "dx aliasing x must be refused";
}

TEST_F(CudaOpsTest, TokenOutsideVocabFailsTheStream) {
  const LlamaDims d = test_dims();
  make_ops(d);
  std::mt19937_64 rng(8);
  const Blob table = blob(rng, d.vocab * d.dim, DType::kF32, 1.0);
  std::vector<int32_t> tokens(4, 3);
  tokens[2] = static_cast<int32_t>(d.vocab);  // one past the end
  const int32_t* t_d = up(tokens);
  float* x_d = nan_buffer(4 * d.dim);
  ASSERT_TRUE(gpu_->embed_forward({.dtype = DType::kF32, .embed_tokens = table.dev}, t_d, 1, 4, x_d).ok())
      << "the call cannot see the ids";
  expect_stream_error_ = true;
  Status st = backend_->synchronize(stream_);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("embed_forward"), std::string::npos) << st.message();
}

}  // namespace

// Runs everywhere (also without a GPU): create_cuda_ops says why it cannot.
TEST(CudaOpsUnavailable, CreateSaysWhy) {
  auto module = load_cuda_backend();
  if (module.ok()) GTEST_SKIP() << "a CUDA device is present; the other tests cover it";
  DeviceBackendOptions o;
  o.kind = DeviceBackendKind::kHost;
  o.budget_bytes = 64ull << 20;
  auto host = create_device_backend(o);
  ASSERT_TRUE(host.ok()) << host.status().to_string();
  auto s = host.value()->create_stream("s");
  ASSERT_TRUE(s.ok());
  CudaOpsOptions co;
  co.dims = test_dims();
  co.max_batch = 1;
  co.max_seq = 8;
  auto ops = create_cuda_ops(*host.value(), s.value(), co);
  ASSERT_FALSE(ops.ok());
  EXPECT_EQ(ops.status().code(), StatusCode::kUnavailable) << ops.status().to_string();
  EXPECT_NE(ops.status().message().find(module.status().message()), std::string::npos)
      << "the loader's reason should be passed on: " << ops.status().message();
  EXPECT_TRUE(host.value()->destroy_stream(s.value()).ok());
}

}  // namespace strata::train
