// End-to-end tests of the offload engine (runtime/engine.h): a 4-layer MLP
// (tanh, MSE to fixed targets) trained through the engine's protocol
// (acquire / release / reduce_grad / step) and compared with a reference
// written here in plain C++ on top of cpu_optim::step, which mirrors the
// engine's documented arithmetic: compute copy = bf16/fp16(master), gradient
// accumulator = sum over micro-batches of float(g) in fp32, norm by
// cpu_optim::grad_stats over optimizer chunks summed per group then over
// groups, coefficient min(1, clip / (norm + 1e-6)), AdamW with grad_scale =
// 1/(micro-batches x loss scale) x coefficient. Every comparison is
// bit-exact (tolerance 0) except the hand-computed norm (relative 1e-9).
//
// Built three times from this file: ENGINE_TEST_NVME=0 (label unit: RAM
// tiers and error paths), =1 (label nvme: everything through swap files
// under STRATA_TEST_DIR or /tmp), and ENGINE_TEST_CUDA=1 (label gpu: the
// same end-to-end tests on the cuda backend; skipped without a GPU). The
// test's own compute runs on the host: activations and gradients move with
// DeviceBackend::copy_async, so the same code runs on both backends.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "common/float_convert.h"
#include "common/host_memory.h"
#include "cpu_optim/optimizer.h"
#include "device/host_backend.h"
#include "io/fault_injection.h"
#include "runtime/engine.h"
#include "test_util/det_random.h"
#include "test_util/temp_dir.h"
#include "test_util/gpu.h"

#ifndef ENGINE_TEST_NVME
#define ENGINE_TEST_NVME 0
#endif
#ifndef ENGINE_TEST_CUDA
#define ENGINE_TEST_CUDA 0
#endif

namespace strata {
namespace {

// A temp directory named for these tests (test_util/temp_dir.h).
class TempDir : public ::strata::testing::TempDir {
 public:
  explicit TempDir(const char* base = nullptr) : ::strata::testing::TempDir("strata-engine", base) {}
};

// ---------------------------------------------------------------- the model

constexpr int kLayers = 4;
constexpr int kDims[kLayers + 1] = {64, 96, 40, 24, 12};  // W1 is 96x64 = 6144 elements: 3 optimizer chunks
constexpr int kBatch = 4;

ModelSpec make_model(DType dt, const std::vector<int>& frozen = {}, const std::vector<int>& lr_group1 = {}) {
  ModelSpec m;
  for (int l = 0; l < kLayers; ++l) {
    const std::string g = "layers." + std::to_string(l);
    m.params.push_back({g + ".weight", {uint64_t(kDims[l + 1]), uint64_t(kDims[l])}, dt, g});
    m.params.push_back({g + ".bias", {uint64_t(kDims[l + 1])}, dt, g});
  }
  for (int p : frozen) m.params[static_cast<size_t>(p)].trainable = false;
  for (int p : lr_group1) m.params[static_cast<size_t>(p)].lr_group = 1;
  return m;
}

// A deterministic generator (the same bits on every run and machine).
float rnd(uint64_t seed, uint64_t i) { return ::strata::testing::det_uniform(seed, i); }

uint16_t to16(float f, DType dt) { return dt == DType::kBF16 ? f32_to_bf16_bits(f) : f32_to_f16_bits(f); }
float from16(uint16_t h, DType dt) { return dt == DType::kBF16 ? bf16_bits_to_f32(h) : f16_bits_to_f32(h); }

// Initial parameter values (representable in the compute dtype).
std::vector<uint16_t> init_param(int p, uint64_t n, DType dt) {
  std::vector<uint16_t> v(n);
  const float s = (p % 2 == 0) ? 0.3f : 0.05f;
  for (uint64_t i = 0; i < n; ++i) v[i] = to16(s * rnd(1000 + p, i), dt);
  return v;
}

struct Batch {
  std::vector<float> x, t;
};
Batch make_batch(int step, int micro) {
  Batch b;
  b.x.resize(kBatch * kDims[0]);
  b.t.resize(kBatch * kDims[kLayers]);
  for (size_t i = 0; i < b.x.size(); ++i) b.x[i] = rnd(7 + step * 31 + micro, i);
  for (size_t i = 0; i < b.t.size(); ++i) b.t[i] = 0.5f * rnd(99991 + step * 31 + micro, i);
  return b;
}

// One layer: out = act(W in + b), act = tanh except on the last layer.
std::vector<float> layer_forward(int l, const std::vector<float>& W, const std::vector<float>& b,
                                 const std::vector<float>& in) {
  const int di = kDims[l], dout = kDims[l + 1];
  std::vector<float> out(kBatch * dout);
  for (int n = 0; n < kBatch; ++n)
    for (int o = 0; o < dout; ++o) {
      float z = b[o];
      for (int i = 0; i < di; ++i) z += W[o * di + i] * in[n * di + i];
      out[n * dout + o] = l < kLayers - 1 ? std::tanh(z) : z;
    }
  return out;
}

// Given dL/d(out), returns dW, db and dL/d(in).
void layer_backward(int l, const std::vector<float>& W, const std::vector<float>& in, const std::vector<float>& out,
                    const std::vector<float>& dout_, std::vector<float>* dW, std::vector<float>* db,
                    std::vector<float>* din) {
  const int di = kDims[l], dout = kDims[l + 1];
  dW->assign(dout * di, 0.f);
  db->assign(dout, 0.f);
  din->assign(kBatch * di, 0.f);
  for (int n = 0; n < kBatch; ++n)
    for (int o = 0; o < dout; ++o) {
      const float y = out[n * dout + o];
      const float dz = dout_[n * dout + o] * (l < kLayers - 1 ? 1.f - y * y : 1.f);
      (*db)[o] += dz;
      for (int i = 0; i < di; ++i) {
        (*dW)[o * di + i] += dz * in[n * di + i];
        (*din)[n * di + i] += dz * W[o * di + i];
      }
    }
}

float loss_and_grad(const std::vector<float>& y, const std::vector<float>& t, std::vector<float>* dy) {
  dy->resize(y.size());
  float loss = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    const float d = y[i] - t[i];
    loss += 0.5f * d * d / kBatch;
    (*dy)[i] = d / kBatch;
  }
  return loss;
}

// ---------------------------------------------------------------- what a run does

struct RunOptions {
  int micro = 1;
  double clip = 0;
  bool overlap = false;
  bool fp16 = false;           // fp16 compute, dynamic loss scaling
  DType grad_dtype = DType::kBF16;
  int inf_step = -1;           // inject an inf gradient in this step (last micro-batch)
  int peek_from = -1, peek_to = -1;  // steps that acquire layers.3 once before forward (order change)
  std::vector<int> frozen;           // frozen parameters (no gradient, never updated)
  std::vector<int> lr_group1;        // parameters in lr group 1, whose lr is set to lr1
  double lr1 = -1;
  // After each reduce_grad the trainer overwrites its gradient buffer on its
  // stream at once (NaN bytes), as a trainer reusing one buffer does: the
  // engine must have read it first.
  bool poison_grad_buffers = false;
  bool is_frozen(size_t p) const { return std::find(frozen.begin(), frozen.end(), int(p)) != frozen.end(); }
};

DType compute_dtype(const RunOptions& o) { return o.fp16 ? DType::kF16 : DType::kBF16; }

// The model's elements and its compute copies' bytes.
[[maybe_unused]] std::pair<uint64_t, uint64_t> model_sizes(const RunOptions& o) {
  uint64_t elems = 0, compute = 0;
  for (const auto& p : make_model(compute_dtype(o)).params) {
    elems += p.numel();
    compute += p.numel() * dtype_size(p.compute_dtype);
  }
  return {elems, compute};
}

struct StepLog {
  float loss = 0;
  StepResult r;
};

// Rounds a gradient to the dtype it is reduced in and back (what the engine accumulates).
void round_grad(std::vector<float>& g, DType dt) {
  if (dt == DType::kF32) return;
  for (auto& v : g) v = from16(to16(v, dt), dt);
}

// ---------------------------------------------------------------- the reference

struct Reference {
  RunOptions o;
  cpu_optim::OptimizerConfig cfg;
  std::vector<std::vector<float>> master, m, v;
  double prev_norm = -1, scale = 1;
  int64_t t = 0;
  int hyst = 2;
  std::vector<double> norms, coefs;

  explicit Reference(const RunOptions& opts) : o(opts) {
    cfg.kind = cpu_optim::OptimizerKind::kAdamW;
    cfg.lr = 1e-2;
    cfg.weight_decay = 0.01;
    const ModelSpec spec = make_model(compute_dtype(o));
    for (size_t p = 0; p < spec.params.size(); ++p) {
      auto init = init_param(int(p), spec.params[p].numel(), compute_dtype(o));
      std::vector<float> f(init.size());
      for (size_t i = 0; i < f.size(); ++i) f[i] = from16(init[i], compute_dtype(o));
      master.push_back(f);
      m.emplace_back(f.size(), 0.f);
      v.emplace_back(f.size(), 0.f);
    }
    if (o.fp16) scale = 256;  // 2^initial_scale_power (8)
  }
  std::vector<float> compute(size_t p) const {
    std::vector<float> c(master[p].size());
    for (size_t i = 0; i < c.size(); ++i) c[i] = from16(to16(master[p][i], compute_dtype(o)), compute_dtype(o));
    return c;
  }
  float run_step(int step) {
    std::vector<std::vector<float>> acc(master.size());
    float loss = 0;
    for (int mb = 0; mb < o.micro; ++mb) {
      Batch b = make_batch(step, mb);
      std::vector<std::vector<float>> h{b.x};
      for (int l = 0; l < kLayers; ++l) h.push_back(layer_forward(l, compute(2 * l), compute(2 * l + 1), h.back()));
      std::vector<float> d;
      loss += loss_and_grad(h.back(), b.t, &d) / o.micro;
      for (int l = kLayers - 1; l >= 0; --l) {
        std::vector<float> dW, db, din;
        layer_backward(l, compute(2 * l), h[l], h[l + 1], d, &dW, &db, &din);
        for (auto* g : {&dW, &db})
          for (auto& x : *g) x = static_cast<float>(x * scale);
        if (step == o.inf_step && mb == o.micro - 1 && l == 0) dW[0] = std::numeric_limits<float>::infinity();
        round_grad(dW, o.grad_dtype);
        round_grad(db, o.grad_dtype);
        for (int k = 0; k < 2; ++k) {
          auto& g = k == 0 ? dW : db;
          auto& a = acc[2 * l + k];
          if (a.empty()) a = g;
          else for (size_t i = 0; i < a.size(); ++i) a[i] = a[i] + g[i];
        }
        d = din;
      }
    }
    const double gs = 1.0 / (o.micro * scale);
    double total = 0;
    bool nonfinite = false;
    for (int l = 0; l < kLayers; ++l) {
      // The engine's documented sum: each parameter's norm blocks in order,
      // parameters in group order, then scaled; groups in order.
      double group = 0;
      for (int k = 0; k < 2; ++k) {
        if (o.is_frozen(2 * l + k)) continue;
        const auto& a = acc[2 * l + k];
        for (size_t off = 0; off < a.size(); off += cpu_optim::kNormBlock) {
          auto r = cpu_optim::grad_stats(a.data() + off, DType::kF32,
                                         std::min<size_t>(cpu_optim::kNormBlock, a.size() - off), 1.0);
          group += r->sum_sq;
          nonfinite |= r->has_inf_nan;
        }
      }
      total += group * (gs * gs);
    }
    const double norm = std::sqrt(total);
    norms.push_back(norm);
    if (nonfinite) {
      // DeepSpeed's hysteresis (2): the first overflow only uses it up.
      if (hyst <= 1) scale = std::max(scale / 2, 1.0);
      else --hyst;
      coefs.push_back(0);
      return loss;
    }
    double coef = 1;
    if (o.clip > 0) {
      const double basis = o.overlap ? prev_norm : norm;
      if (basis >= 0) coef = std::min(1.0, o.clip / (basis + 1e-6));
    }
    coefs.push_back(coef);
    prev_norm = norm;
    ++t;
    auto c = cfg;
    c.grad_scale = gs * coef;
    for (size_t p = 0; p < master.size(); ++p) {
      if (o.is_frozen(p)) continue;
      cpu_optim::StepBuffers bufs;
      bufs.params = master[p].data();
      bufs.grads = acc[p].data();
      bufs.state[0] = m[p].data();
      bufs.state[1] = v[p].data();
      EXPECT_TRUE(cpu_optim::step(c, t, bufs, master[p].size()).ok());
    }
    return loss;
  }
};

// ---------------------------------------------------------------- the engine side

struct Device {
  std::unique_ptr<DeviceBackend> dev;
  std::string skip;
};

Device make_device() {
  Device d;
#if ENGINE_TEST_CUDA
  DeviceBackendOptions o;
  o.kind = DeviceBackendKind::kCuda;
  o.budget_bytes = 512ull << 20;
  auto r = create_device_backend(o);
  if (!r.ok()) d.skip = "no usable CUDA device: " + r.status().message();
  else d.dev = std::move(*r);
#else
  auto r = create_host_backend({.budget_bytes = 512ull << 20});
  d.dev = std::move(*r);
#endif
  return d;
}

enum class Place { kAuto, kHost, kNvme };

Config make_config(const RunOptions& o, Place place, const std::string& nvme_dir, uint32_t prefetch = 2) {
  Config c;
  c.optimizer.type = OptimizerType::kAdamW;
  c.optimizer.lr = 1e-2;
  c.optimizer.weight_decay = 0.01;
  c.gradient_accumulation_steps = o.micro;
  c.gradient_clipping = o.clip;
  c.strata.overlap_backward = o.overlap;
  c.strata.device_reserve = 1 << 20;
  c.strata.optimizer_chunk = 2048;
  c.strata.prefetch_depth = prefetch;
  if (o.fp16) {
    c.fp16.enabled = true;
    c.fp16.initial_scale_power = 8;
    c.fp16.hysteresis = 2;
  }
  if (place != Place::kAuto) {
    const Tier t = place == Place::kHost ? Tier::kHost : Tier::kNvme;
    c.strata.groups.push_back(GroupTierRule{"*", t, t, t, t});
  }
  if (!nvme_dir.empty()) c.strata.nvme.push_back(NvmeDir{nvme_dir, 0});
  return c;
}

struct Trainer {
  DeviceBackend* dev;
  DeviceStream* s = nullptr;
  std::unique_ptr<Engine> e;
  RunOptions o;
  std::vector<void*> grad_buf;  // device, one per parameter
  bool expect_ok = true;        // false: a failed acquire is returned by run_step, not a test failure
  Status failed;                // the last failed acquire

  Trainer(DeviceBackend* d, const RunOptions& opts) : dev(d), o(opts) {}
  ~Trainer() {
    for (void* p : grad_buf) (void)dev->free(p);
    if (s) (void)dev->destroy_stream(s);
  }
  Status init(const Config& cfg, bool load_init = true, std::shared_ptr<io::FaultInjector> faults = nullptr) {
    EngineOptions eo;
    eo.config = cfg;
    eo.io_faults = std::move(faults);
    eo.model = make_model(compute_dtype(o), o.frozen, o.lr_group1);
    eo.device = dev;
    eo.budgets_override.device_bytes = 256ull << 20;
    eo.budgets_override.host_bytes = 1ull << 30;
    auto r = Engine::create(eo);
    if (!r.ok()) return r.status();
    e = std::move(*r);
    if (!o.lr_group1.empty()) {
      Status gs = e->set_group_lr(1, o.lr1);
      if (!gs.ok()) return gs;
    }
    auto st = dev->create_stream("trainer");
    if (!st.ok()) return st.status();
    s = *st;
    for (const auto& p : e->model().params) {
      auto b = dev->alloc(p.numel() * 4);
      if (!b.ok()) return b.status();
      grad_buf.push_back(*b);
    }
    if (load_init)
      for (ParamId p = 0; p < e->model().params.size(); ++p) {
        auto v = init_param(int(p), e->model().params[p].numel(), compute_dtype(o));
        Status ls = e->load_param(p, v.data(), compute_dtype(o));
        if (!ls.ok()) return ls;
      }
    return {};
  }
  // Device -> host (the caller's stream; synchronized).
  std::vector<float> read_weights(void* ptr, uint64_t n) {
    std::vector<uint16_t> h(n);
    EXPECT_TRUE(dev->copy_async(h.data(), ptr, n * 2, CopyKind::kDeviceToHost, s).ok());
    EXPECT_TRUE(dev->synchronize(s).ok());
    std::vector<float> f(n);
    for (uint64_t i = 0; i < n; ++i) f[i] = from16(h[i], compute_dtype(o));
    return f;
  }
  void write_grad(ParamId p, const std::vector<float>& g) {
    std::vector<uint8_t> bytes(g.size() * dtype_size(o.grad_dtype));
    if (o.grad_dtype == DType::kF32) std::memcpy(bytes.data(), g.data(), bytes.size());
    else
      for (size_t i = 0; i < g.size(); ++i) {
        const uint16_t h = to16(g[i], o.grad_dtype);
        std::memcpy(bytes.data() + 2 * i, &h, 2);
      }
    EXPECT_TRUE(dev->copy_async(grad_buf[p], bytes.data(), bytes.size(), CopyKind::kHostToDevice, s).ok());
    EXPECT_TRUE(dev->synchronize(s).ok());
  }
  std::pair<std::vector<float>, std::vector<float>> layer_weights(GroupId g) {
    auto v = e->acquire(g, s);
    if (expect_ok) {
      EXPECT_TRUE(v.ok()) << v.status().to_string();
    }
    if (!v.ok()) {
      failed = v.status();
      return {};
    }
    auto W = read_weights(v->ptr[0], uint64_t(kDims[g + 1]) * kDims[g]);
    auto b = read_weights(v->ptr[1], kDims[g + 1]);
    return {W, b};
  }
  Result<StepLog> run_step(int step) {
    StepLog log;
    const double scale = e->loss_scale();
    for (int mb = 0; mb < o.micro; ++mb) {
      STRATA_RETURN_IF_ERROR(e->begin_micro_batch(mb == o.micro - 1));
      if (step >= o.peek_from && step <= o.peek_to && mb == 0) {
        auto v = e->acquire(3, s);
        if (!v.ok()) return v.status();
        STRATA_RETURN_IF_ERROR(e->release(3, s));
      }
      Batch b = make_batch(step, mb);
      std::vector<std::vector<float>> h{b.x};
      e->trace_begin("forward");
      for (int l = 0; l < kLayers; ++l) {
        auto [W, bias] = layer_weights(l);
        if (!failed.ok()) return failed;
        h.push_back(layer_forward(l, W, bias, h.back()));
        STRATA_RETURN_IF_ERROR(e->release(l, s));
      }
      e->trace_end();
      std::vector<float> d;
      log.loss += loss_and_grad(h.back(), b.t, &d) / o.micro;
      e->trace_begin("backward");
      for (int l = kLayers - 1; l >= 0; --l) {
        auto [W, bias] = layer_weights(l);
        if (!failed.ok()) return failed;
        std::vector<float> dW, db, din;
        layer_backward(l, W, h[l], h[l + 1], d, &dW, &db, &din);
        for (auto* g : {&dW, &db})
          for (auto& x : *g) x = static_cast<float>(x * scale);
        if (step == o.inf_step && mb == o.micro - 1 && l == 0) dW[0] = std::numeric_limits<float>::infinity();
        for (int k = 0; k < 2; ++k) {
          const ParamId p = static_cast<ParamId>(2 * l + k);
          if (o.is_frozen(p)) continue;  // a frozen parameter has no gradient to give
          write_grad(p, k == 0 ? dW : db);
          STRATA_RETURN_IF_ERROR(e->reduce_grad(p, grad_buf[p], o.grad_dtype, s));
          if (o.poison_grad_buffers) {
            const size_t n = (k == 0 ? dW : db).size() * dtype_size(o.grad_dtype);
            STRATA_RETURN_IF_ERROR(dev->fill_bytes_async(grad_buf[p], n, 0xFF, s));
          }
        }
        STRATA_RETURN_IF_ERROR(e->release(l, s));
        d = din;
      }
      e->trace_end();
    }
    STRATA_ASSIGN_OR_RETURN(log.r, e->step());
    return log;
  }
  std::vector<std::vector<float>> params() {
    std::vector<std::vector<float>> out;
    for (ParamId p = 0; p < e->model().params.size(); ++p) {
      std::vector<float> v(e->model().params[p].numel());
      EXPECT_TRUE(e->read_param(p, v.data(), DType::kF32).ok());
      out.push_back(v);
    }
    return out;
  }
  // The compute copies as the device sees them (through acquire).
  std::vector<std::vector<float>> compute_copies() {
    std::vector<std::vector<float>> out;
    for (GroupId g = 0; g < kLayers; ++g) {
      auto [W, b] = layer_weights(g);
      EXPECT_TRUE(e->release(g, s).ok());
      out.push_back(W);
      out.push_back(b);
    }
    return out;
  }
};

bool bits_equal(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * 4) != 0) return false;
  return true;
}

#define SKIP_WITHOUT_DEVICE(d)                 \
  do {                                         \
    if (!(d).skip.empty()) STRATA_SKIP_WITHOUT_GPU((d).skip); \
  } while (0)

struct RunResult {
  std::vector<StepLog> logs;
  std::vector<std::vector<float>> params, compute;
  EngineStats stats;
};

RunResult train(DeviceBackend* dev, const RunOptions& o, const Config& cfg, int steps) {
  RunResult res;
  Trainer t(dev, o);
  Status st = t.init(cfg);
  EXPECT_TRUE(st.ok()) << st.to_string();
  if (!st.ok()) return res;
  for (int i = 0; i < steps; ++i) {
    auto r = t.run_step(i);
    EXPECT_TRUE(r.ok()) << "step " << i << ": " << r.status().to_string();
    if (!r.ok()) return res;
    res.logs.push_back(*r);
  }
  res.params = t.params();
  res.compute = t.compute_copies();
  res.stats = t.e->stats();
  return res;
}

// As after `strata finetune` exits 1: a new engine (a new process) loads
// checkpoint `ck` and steps from..to-1 as the uninterrupted run did.
[[maybe_unused]] void expect_resumes(DeviceBackend* dev, const RunOptions& o, const Config& cfg, const std::string& ck, int from,
                    int to, const RunResult& straight) {
  Trainer t(dev, o);
  ASSERT_TRUE(t.init(cfg, /*load_init=*/false).ok());
  Status ls = t.e->load_checkpoint(ck);
  ASSERT_TRUE(ls.ok()) << ls.to_string();
  for (int i = from; i < to; ++i) {
    auto r = t.run_step(i);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->loss, straight.logs[i].loss) << "step " << i;
  }
  EXPECT_TRUE(bits_equal(t.params(), straight.params));
}

void expect_matches_reference(const RunResult& run, Reference& ref, int steps) {
  ASSERT_EQ(run.logs.size(), size_t(steps));
  for (int i = 0; i < steps; ++i) {
    const float loss = ref.run_step(i);
    EXPECT_EQ(run.logs[i].loss, loss) << "step " << i;
    EXPECT_EQ(run.logs[i].r.grad_norm, ref.norms[i]) << "step " << i;
  }
  EXPECT_TRUE(bits_equal(run.params, ref.master)) << "masters differ from the reference";
  std::vector<std::vector<float>> c;
  for (size_t p = 0; p < ref.master.size(); ++p) c.push_back(ref.compute(p));
  EXPECT_TRUE(bits_equal(run.compute, c)) << "compute copies differ from the reference";
}

constexpr int kSteps = 20;

// ---------------------------------------------------------------- tests

#if !ENGINE_TEST_NVME || ENGINE_TEST_CUDA
TEST(Engine, RamTiersMatchReferenceBitExactly) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  RunOptions o;
  // Compute copies uploaded from host RAM, and (auto plan) resident on the device.
  RunResult host = train(d.dev.get(), o, make_config(o, Place::kHost, ""), kSteps);
  RunResult dev = train(d.dev.get(), o, make_config(o, Place::kAuto, ""), kSteps);
  Reference ref(o);
  expect_matches_reference(host, ref, kSteps);
  EXPECT_TRUE(bits_equal(host.params, dev.params));
  EXPECT_TRUE(bits_equal(host.compute, dev.compute));
  // Steady state: the backward's first group is still cached and prefetch ran ahead.
  EXPECT_GT(host.stats.prefetch_hits, 0u);
  EXPECT_EQ(host.stats.hot_path_allocs, 0u);
  EXPECT_EQ(host.stats.order_changes, 0u);
  EXPECT_EQ(host.stats.steps, kSteps);
}

TEST(Engine, AccumulationAndClippingMatchReference) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  RunOptions o;
  o.micro = 3;
  o.clip = 0.05;
  o.grad_dtype = DType::kF32;
  RunResult run = train(d.dev.get(), o, make_config(o, Place::kHost, ""), 8);
  Reference ref(o);
  expect_matches_reference(run, ref, 8);
  // Clipping was active and its coefficient is the documented formula.
  int clipped = 0;
  for (size_t i = 0; i < run.logs.size(); ++i) {
    const auto& r = run.logs[i].r;
    EXPECT_DOUBLE_EQ(r.clip_coef, std::min(1.0, 0.05 / (r.grad_norm + 1e-6)));
    EXPECT_EQ(r.clip_coef, ref.coefs[i]);
    clipped += r.clip_coef < 1;
  }
  EXPECT_GT(clipped, 0);
}

TEST(Engine, NormMatchesHandComputation) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  RunOptions o;
  o.micro = 2;
  o.grad_dtype = DType::kF32;
  Trainer t(d.dev.get(), o);
  ASSERT_TRUE(t.init(make_config(o, Place::kHost, "")).ok());
  auto r = t.run_step(0);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  // By hand: the same forward/backward, averaged in double.
  std::vector<std::vector<double>> sum(2 * kLayers);
  std::vector<std::vector<float>> w;
  for (int p = 0; p < 2 * kLayers; ++p) {
    auto v = init_param(p, make_model(DType::kBF16).params[p].numel(), DType::kBF16);
    std::vector<float> f(v.size());
    for (size_t i = 0; i < f.size(); ++i) f[i] = bf16_bits_to_f32(v[i]);
    w.push_back(f);
    sum[p].assign(f.size(), 0.0);
  }
  for (int mb = 0; mb < 2; ++mb) {
    Batch b = make_batch(0, mb);
    std::vector<std::vector<float>> h{b.x};
    for (int l = 0; l < kLayers; ++l) h.push_back(layer_forward(l, w[2 * l], w[2 * l + 1], h.back()));
    std::vector<float> dd;
    loss_and_grad(h.back(), b.t, &dd);
    for (int l = kLayers - 1; l >= 0; --l) {
      std::vector<float> dW, db, din;
      layer_backward(l, w[2 * l], h[l], h[l + 1], dd, &dW, &db, &din);
      for (size_t i = 0; i < dW.size(); ++i) sum[2 * l][i] += dW[i];
      for (size_t i = 0; i < db.size(); ++i) sum[2 * l + 1][i] += db[i];
      dd = din;
    }
  }
  double sq = 0;
  for (auto& p : sum)
    for (double g : p) sq += (g / 2) * (g / 2);
  EXPECT_NEAR(r->r.grad_norm, std::sqrt(sq), 1e-9 * std::sqrt(sq));
}

TEST(Engine, Fp16OverflowSkipsTheStepAndLowersTheScale) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  RunOptions o;
  o.fp16 = true;
  o.grad_dtype = DType::kF16;
  Trainer t(d.dev.get(), o);
  ASSERT_TRUE(t.init(make_config(o, Place::kHost, "")).ok());
  Reference ref(o);
  EXPECT_EQ(t.e->loss_scale(), 256.0);
  for (int i = 0; i < 6; ++i) {
    // Steps 2 and 3 overflow: the first uses up the hysteresis (scale kept),
    // the second halves the scale. Neither changes a parameter.
    t.o.inf_step = ref.o.inf_step = (i == 2 || i == 3) ? i : -1;
    auto before = t.params();
    auto r = t.run_step(i);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    ref.run_step(i);
    const bool overflow = i == 2 || i == 3;
    EXPECT_EQ(r->r.skipped, overflow) << "step " << i;
    if (overflow) {
      EXPECT_TRUE(bits_equal(before, t.params())) << "a skipped step changed parameters";
    }
    EXPECT_EQ(r->r.loss_scale, ref.scale) << "step " << i;
    EXPECT_EQ(t.e->loss_scale(), i < 3 ? 256.0 : 128.0) << "step " << i;
  }
  EXPECT_TRUE(bits_equal(t.params(), ref.master));
  EXPECT_EQ(t.e->stats().skipped_steps, 2);
  EXPECT_EQ(t.e->step_count(), 4);
}

TEST(Engine, OverlapWithoutClippingEqualsNormalMode) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  // Host-homed compute copies, and device-homed ones (the auto plan: the
  // optimizer pass uploads them; with overlap they are rebuilt from the
  // masters in step()).
  for (Place place : {Place::kHost, Place::kAuto}) {
    SCOPED_TRACE(place == Place::kHost ? "host" : "auto (device-homed compute copies)");
    RunOptions o;
    o.micro = 2;
    RunResult normal = train(d.dev.get(), o, make_config(o, place, ""), 10);
    RunOptions ov = o;
    ov.overlap = true;
    RunResult overlap = train(d.dev.get(), ov, make_config(ov, place, ""), 10);
    ASSERT_EQ(normal.logs.size(), overlap.logs.size());
    for (size_t i = 0; i < normal.logs.size(); ++i) {
      EXPECT_EQ(normal.logs[i].loss, overlap.logs[i].loss);
      EXPECT_EQ(normal.logs[i].r.grad_norm, overlap.logs[i].r.grad_norm);
    }
    EXPECT_TRUE(bits_equal(normal.params, overlap.params));
    EXPECT_TRUE(bits_equal(normal.compute, overlap.compute));
    if (place == Place::kAuto) {
      EXPECT_GT(normal.stats.tier_bytes[static_cast<int>(Tier::kDevice)], 0u);
    }
  }
}

TEST(Engine, OverlapClipsByThePreviousNorm) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  RunOptions o;
  o.overlap = true;
  o.clip = 0.05;
  RunResult run = train(d.dev.get(), o, make_config(o, Place::kHost, ""), 8);
  Reference ref(o);
  expect_matches_reference(run, ref, 8);
  EXPECT_EQ(run.logs[0].r.clip_coef, 1.0);  // no previous norm
  for (size_t i = 1; i < run.logs.size(); ++i)
    EXPECT_EQ(run.logs[i].r.clip_coef, std::min(1.0, 0.05 / (run.logs[i - 1].r.grad_norm + 1e-6)));
}

TEST(Engine, OverlapRefusesDynamicFp16) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  RunOptions o;
  o.fp16 = true;
  o.overlap = true;
  Trainer t(d.dev.get(), o);
  Status st = t.init(make_config(o, Place::kHost, ""));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("overlap_backward"), std::string::npos) << st.message();
}

// An audit's silent loss: with overlap_backward, a micro-batch begun after
// the last one reduced into groups whose update had started, and its
// gradient was dropped (grad norm halved, no error).
TEST(Engine, OverlapRefusesAMicroBatchAfterTheLastOne) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  RunOptions o;
  o.overlap = true;
  Trainer t(d.dev.get(), o);
  ASSERT_TRUE(t.init(make_config(o, Place::kHost, "")).ok());
  ASSERT_TRUE(t.e->begin_micro_batch(true).ok());
  Status st = t.e->begin_micro_batch(false);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("after the micro-batch that ended the accumulation"), std::string::npos)
      << st.message();
  EXPECT_EQ(t.e->begin_micro_batch(true).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(t.e->discard_step(t.s).ok());
  EXPECT_TRUE(t.e->begin_micro_batch(true).ok());  // a new step
}

TEST(Engine, ChangedOrderCostsNothingButSpeed) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  RunOptions o;
  o.peek_from = 6;
  o.peek_to = 8;
  RunResult with = train(d.dev.get(), o, make_config(o, Place::kHost, "", 2), 14);
  RunResult without = train(d.dev.get(), o, make_config(o, Place::kHost, "", 0), 14);
  EXPECT_TRUE(bits_equal(with.params, without.params));
  EXPECT_TRUE(bits_equal(with.compute, without.compute));
  EXPECT_GT(with.stats.order_changes, 0u);
  EXPECT_GT(with.stats.prefetch_hits, without.stats.prefetch_hits);
}

TEST(Engine, BudgetTooSmallAndWorldSizeTwoWithoutACommunicatorAreRefused) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  RunOptions o;
  EngineOptions eo;
  eo.config = make_config(o, Place::kHost, "");
  eo.model = make_model(DType::kBF16);
  eo.device = d.dev.get();
  eo.budgets_override.device_bytes = 256ull << 20;
  eo.budgets_override.host_bytes = 64 << 10;  // far less than the host tier needs
  auto r = Engine::create(eo);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfBudget);
  EXPECT_NE(r.status().message().find("short"), std::string::npos) << r.status().message();
  eo.budgets_override.host_bytes = 1ull << 30;
  eo.model.world_size = 2;
  r = Engine::create(eo);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("needs a communicator"), std::string::npos) << r.status().message();
}

// A detected host budget (none given) on the host backend is MemAvailable
// less the device budget: the device's memory is RAM too, and the two tiers
// together must not plan more RAM than there is (a 1.2 B model at batch 4 x
// 2048 on 23 GiB planned 4.2 GiB of device and 22.8 GiB of host). On a GPU
// the host budget is MemAvailable.
TEST(Engine, DetectedHostBudgetLeavesTheHostBackendsDeviceBudgetOut) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  const uint64_t before = host_memory_available();
  if (before < (8ull << 30)) GTEST_SKIP() << "needs 8 GiB of MemAvailable, has " << before;
  RunOptions o;
  EngineOptions eo;
  eo.config = make_config(o, Place::kHost, "");
  eo.model = make_model(DType::kBF16);
  eo.device = d.dev.get();
  const uint64_t device = 4ull << 30;  // a budget, not an allocation
  eo.budgets_override.device_bytes = device;
  auto r = Engine::create(eo);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const uint64_t after = host_memory_available();
  const uint64_t host = (*r)->plan().budgets.host_bytes;
  // MemAvailable moves with other processes: a wide margin, far below 4 GiB.
  const uint64_t slack = 1ull << 30;
  if (d.dev->kind() == DeviceKind::kHost) {
    EXPECT_LE(host + device, std::max(before, after) + slack) << "host " << host << ", MemAvailable " << before;
    EXPECT_GE(host + device + slack, std::min(before, after)) << "host " << host << ", MemAvailable " << before;
  } else {
    EXPECT_GE(host + slack, std::min(before, after)) << "host " << host << ", MemAvailable " << before;
  }
  if (d.dev->kind() != DeviceKind::kHost) return;
  // A device budget given that takes all of MemAvailable: refused by name,
  // not planned with a host tier of 0 B.
  eo.budgets_override.device_bytes = 1ull << 50;
  auto all = Engine::create(eo);
  ASSERT_FALSE(all.ok());
  EXPECT_EQ(all.status().code(), StatusCode::kOutOfBudget);
  EXPECT_NE(all.status().message().find("engine, host backend (strata.device_memory, strata.host_memory): the device "
                                        "budget 1.0 PiB is RAM here and leaves nothing of this rank's MemAvailable"),
            std::string::npos)
      << all.status().message();
}

TEST(Engine, TraceHasCopiesAccumulationsOptimizerAndComputeSpans) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  TempDir dir;
  RunOptions o;
  Config cfg = make_config(o, Place::kHost, "");
  cfg.strata.trace = dir.path() + "/trace.json";
  {
    Trainer t(d.dev.get(), o);
    ASSERT_TRUE(t.init(cfg).ok());
    ASSERT_NE(t.e->tracer(), nullptr);
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(t.run_step(i).ok());
  }  // the engine writes the trace when destroyed
  std::ifstream f(cfg.strata.trace);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  for (const char* name : {"\"h2d\"", "\"d2h\"", "\"accumulate\"", "\"optimizer_chunk\"", "\"forward\"",
                           "\"backward\"", "\"upload_group\""})
    EXPECT_NE(text.find(name), std::string::npos) << name << " missing from the trace";
}

TEST(Engine, ProtocolErrors) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  RunOptions o;
  Trainer t(d.dev.get(), o);
  ASSERT_TRUE(t.init(make_config(o, Place::kHost, "")).ok());
  ASSERT_TRUE(t.e->acquire(0, t.s).ok());
  EXPECT_EQ(t.e->step().status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.e->begin_micro_batch(true).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(t.e->release(0, t.s).ok());
  EXPECT_EQ(t.e->release(0, t.s).code(), StatusCode::kInvalidArgument);
  // A missing release is caught: 65536 holds of one group are refused.
  for (uint32_t i = 0; i < Engine::kMaxHolds; ++i) ASSERT_TRUE(t.e->acquire(0, t.s).ok()) << i;
  auto too_many = t.e->acquire(0, t.s);
  EXPECT_EQ(too_many.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_many.status().message().find("a release is missing"), std::string::npos);
  ASSERT_TRUE(t.e->discard_step(t.s).ok());
  ASSERT_TRUE(t.e->reduce_grad(0, t.grad_buf[0], DType::kBF16, t.s).ok());
  EXPECT_EQ(t.e->reduce_grad(0, t.grad_buf[0], DType::kBF16, t.s).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.e->acquire(99, t.s).status().code(), StatusCode::kInvalidArgument);
}
#endif

#if ENGINE_TEST_NVME || ENGINE_TEST_CUDA
TEST(EngineNvme, NvmeTiersBitIdenticalToRam) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  TempDir dir;
  RunOptions o;
  o.micro = 2;
  o.clip = 0.2;
  RunResult ram = train(d.dev.get(), o, make_config(o, Place::kHost, ""), kSteps);
  RunResult nvme = train(d.dev.get(), o, make_config(o, Place::kNvme, dir.path() + "/swap"), kSteps);
  ASSERT_EQ(ram.logs.size(), nvme.logs.size());
  for (size_t i = 0; i < ram.logs.size(); ++i) {
    EXPECT_EQ(ram.logs[i].loss, nvme.logs[i].loss) << "step " << i;
    EXPECT_EQ(ram.logs[i].r.grad_norm, nvme.logs[i].r.grad_norm) << "step " << i;
  }
  EXPECT_TRUE(bits_equal(ram.params, nvme.params));
  EXPECT_TRUE(bits_equal(ram.compute, nvme.compute));
  Reference ref(o);
  expect_matches_reference(nvme, ref, kSteps);
  EXPECT_EQ(nvme.stats.tier_bytes[static_cast<int>(Tier::kHost)], 0u);
  // Every step's optimizer pass reads and writes the master and both
  // moments on NVMe (counted in stats: before, only uploads and gradients
  // were), and writes the updated compute copy: at least this many bytes.
  const auto [elems, compute] = model_sizes(o);
  EXPECT_GE(nvme.stats.nvme_read_bytes, kSteps * elems * (4 + 4 + 4));
  EXPECT_GE(nvme.stats.nvme_write_bytes, kSteps * (elems * (4 + 4 + 4) + compute));
  EXPECT_GT(nvme.stats.prefetch_hits, 0u);
  EXPECT_EQ(nvme.stats.hot_path_allocs, 0u);
}

// Frozen parameters (a LoRA base): a weight, a bias of another group and a
// whole group frozen. The trainable ones follow the reference bit for bit,
// the frozen ones never change, reduce_grad refuses them, and they take no
// master, optimizer or gradient bytes; a checkpoint resumes bit-identically.
TEST(EngineNvme, FrozenParametersAreStreamedButNeverUpdated) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  TempDir dir;
  for (bool overlap : {false, true})
    for (Place place : {Place::kHost, Place::kNvme}) {
      SCOPED_TRACE(::testing::Message() << (place == Place::kNvme ? "nvme" : "host") << (overlap ? ", overlap" : ""));
      RunOptions o;
      o.micro = 2;
      o.overlap = overlap;
      o.frozen = {0, 5, 6, 7};
      const Config cfg = make_config(o, place, dir.path() + "/swap");
      RunResult run = train(d.dev.get(), o, cfg, 6);
      Reference ref(o);
      expect_matches_reference(run, ref, 6);
      for (int p : o.frozen) {
        const auto init = init_param(p, run.params[static_cast<size_t>(p)].size(), compute_dtype(o));
        for (size_t i = 0; i < init.size(); ++i)
          ASSERT_EQ(run.params[static_cast<size_t>(p)][i], from16(init[i], compute_dtype(o))) << "param " << p;
      }
      // Bytes: the frozen params' masters, states and grads are not there.
      RunOptions all = o;
      all.frozen.clear();
      Trainer full(d.dev.get(), all), part(d.dev.get(), o);
      ASSERT_TRUE(full.init(cfg).ok());
      ASSERT_TRUE(part.init(cfg).ok());
      uint64_t frozen_elems = 0;
      for (int p : o.frozen) frozen_elems += part.e->model().params[static_cast<size_t>(p)].numel();
      uint64_t full_bytes = 0, part_bytes = 0;
      for (int t = 0; t < 4; ++t) {
        full_bytes += full.e->stats().tier_bytes[t];
        part_bytes += part.e->stats().tier_bytes[t];
      }
      EXPECT_GE(full_bytes - part_bytes, frozen_elems * (4 + 8 + 4)) << full_bytes << " vs " << part_bytes;
      Status st = part.e->reduce_grad(0, part.grad_buf[0], DType::kF32, part.s);
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(st.message().find("frozen"), std::string::npos) << st.message();
    }
  // A checkpoint of a run with frozen parameters resumes bit-identically.
  RunOptions o;
  o.frozen = {0, 5, 6, 7};
  const Config cfg = make_config(o, Place::kNvme, dir.path() + "/swap2");
  RunResult straight = train(d.dev.get(), o, cfg, 6);
  {
    Trainer t(d.dev.get(), o);
    ASSERT_TRUE(t.init(cfg).ok());
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(t.run_step(i).ok());
    ASSERT_TRUE(t.e->save_checkpoint(dir.path() + "/ck").ok());
  }
  Trainer t(d.dev.get(), o);
  ASSERT_TRUE(t.init(cfg, /*load_init=*/false).ok());
  Status ls = t.e->load_checkpoint(dir.path() + "/ck");
  ASSERT_TRUE(ls.ok()) << ls.to_string();
  for (int i = 3; i < 6; ++i) ASSERT_TRUE(t.run_step(i).ok());
  EXPECT_TRUE(bits_equal(t.params(), straight.params));
  // A model that freezes other parameters does not load it.
  RunOptions other = o;
  other.frozen = {0};
  Trainer t2(d.dev.get(), other);
  ASSERT_TRUE(t2.init(make_config(other, Place::kNvme, dir.path() + "/swap3"), false).ok());
  EXPECT_EQ(t2.e->load_checkpoint(dir.path() + "/ck").code(), StatusCode::kInvalidArgument);
}

// A learning-rate group at lr 0 (set_group_lr) leaves its parameters' bits
// alone while they still get gradients; without clipping every other
// parameter trains exactly as when those are frozen. With overlap the group
// lrs are the ones set before the last micro-batch began.
TEST(EngineNvme, LearningRateGroups) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  TempDir dir;
  for (bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlap" : "normal");
    RunOptions frozen;
    frozen.micro = 2;
    frozen.overlap = overlap;
    frozen.frozen = {2, 3};
    RunOptions grouped = frozen;
    grouped.frozen.clear();
    grouped.lr_group1 = {2, 3};
    grouped.lr1 = 0.0;
    RunResult a = train(d.dev.get(), frozen, make_config(frozen, Place::kNvme, dir.path() + "/a"), 5);
    RunResult b = train(d.dev.get(), grouped, make_config(grouped, Place::kNvme, dir.path() + "/b"), 5);
    ASSERT_EQ(a.params.size(), b.params.size());
    EXPECT_TRUE(bits_equal(a.params, b.params));
    // lr group 1 back on the step's lr: its parameters move.
    grouped.lr1 = -1.0;
    RunResult c = train(d.dev.get(), grouped, make_config(grouped, Place::kNvme, dir.path() + "/c"), 5);
    EXPECT_NE(c.params[2], b.params[2]);
  }
}

TEST(EngineNvme, NoDeviceOrPinnedGrowthAfterTheFirstStep) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  TempDir dir;
  RunOptions o;
  Trainer t(d.dev.get(), o);
  ASSERT_TRUE(t.init(make_config(o, Place::kNvme, dir.path() + "/swap")).ok());
  ASSERT_TRUE(t.run_step(0).ok());
  const auto slabs = d.dev->memory_stats().slab_allocs;
  const auto pinned = t.e->stats().pinned_bytes;
  for (int i = 1; i < 5; ++i) ASSERT_TRUE(t.run_step(i).ok());
  EXPECT_EQ(d.dev->memory_stats().slab_allocs, slabs);
  EXPECT_EQ(t.e->stats().pinned_bytes, pinned);
  EXPECT_EQ(t.e->stats().hot_path_allocs, 0u);
}

// The plan counts every pinned buffer the engine takes (staging, optimizer
// ring, gradient pieces); the pool rounds each buffer up to 2 MiB and keeps
// one 2 MiB slab more, so it holds at least the plan's total and at most
// that plus 2 MiB per buffer.
TEST(EngineNvme, PinnedPoolHoldsWhatThePlanCounts) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  TempDir dir;
  RunOptions o;
  Trainer t(d.dev.get(), o);
  ASSERT_TRUE(t.init(make_config(o, Place::kNvme, dir.path() + "/swap")).ok());
  const Plan& plan = t.e->plan();
  EXPECT_EQ(plan.grad_pinned, (uint64_t{std::max<uint32_t>(plan.grad_pieces, 2)} + 1) * plan.grad_piece_elems * 4);
  EXPECT_EQ(plan.pinned_total(), plan.staging_ring + plan.optimizer_ring + plan.grad_pinned);
  const uint64_t pool = t.e->stats().pinned_bytes;
  const uint64_t buffers = std::max<uint32_t>(plan.grad_pieces, 2) + 1 + plan.options.optimizer_ring_buffers +
                           1 + plan.prefetch_groups;
  EXPECT_GE(pool, plan.pinned_total());
  EXPECT_LE(pool, plan.pinned_total() + (buffers + 1) * (2ull << 20));
}

TEST(EngineNvme, CheckpointResumeIsBitIdentical) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  TempDir dir;
  RunOptions o;
  o.micro = 2;
  o.clip = 0.2;
  const Config cfg = make_config(o, Place::kNvme, dir.path() + "/swap");
  RunResult straight = train(d.dev.get(), o, cfg, 12);
  const std::string ck = dir.path() + "/ck";
  {
    Trainer t(d.dev.get(), o);
    ASSERT_TRUE(t.init(cfg).ok());
    for (int i = 0; i < 6; ++i) ASSERT_TRUE(t.run_step(i).ok());
    Status st = t.e->save_checkpoint(ck, R"({"data_position": 6})");
    ASSERT_TRUE(st.ok()) << st.to_string();
  }
  Trainer t(d.dev.get(), o);
  ASSERT_TRUE(t.init(cfg, /*load_init=*/false).ok());
  std::string extra;
  Status st = t.e->load_checkpoint(ck, &extra);
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_NE(extra.find("data_position"), std::string::npos) << extra;
  EXPECT_EQ(t.e->step_count(), 6);
  std::vector<StepLog> logs;
  for (int i = 6; i < 12; ++i) {
    auto r = t.run_step(i);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->loss, straight.logs[i].loss) << "step " << i;
  }
  EXPECT_TRUE(bits_equal(t.params(), straight.params));
  EXPECT_TRUE(bits_equal(t.compute_copies(), straight.compute));

  // A flipped byte in one data file: refused, naming the file.
  std::string victim;
  for (const auto& f : std::filesystem::directory_iterator(ck))
    if (f.path().filename().string().find("layers.1.weight.exp_avg.") == 0) victim = f.path().string();
  ASSERT_FALSE(victim.empty());
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    char c = 0x5a;
    f.write(&c, 1);
  }
  st = t.e->load_checkpoint(ck);
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_NE(st.message().find(std::filesystem::path(victim).filename().string()), std::string::npos)
      << st.message();
}
// After each step the optimizer reads the first chunks of the next step's
// masters and moments ahead (gradients in RAM: nothing it reads depends on
// them). A checkpoint loaded into the same engine, or load_param /
// load_state, replaces that state: the read-ahead must be dropped, and the
// run repeats bit-identically, in the pipelined and the synchronous step.
TEST(EngineNvme, ReadAheadIsDroppedWhenACheckpointIsLoaded) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  for (bool pipelined : {true, false}) {
    SCOPED_TRACE(pipelined ? "pipelined step" : "synchronous step");
    TempDir dir;
    RunOptions o;
    o.clip = 0.2;
    Config cfg = make_config(o, Place::kNvme, dir.path() + "/swap");
    cfg.strata.groups[0].grad = Tier::kHost;
    cfg.strata.pipelined_step = pipelined;
    RunResult straight = train(d.dev.get(), o, cfg, 8);
    const std::string ck = dir.path() + "/ck";
    Trainer t(d.dev.get(), o);
    ASSERT_TRUE(t.init(cfg).ok());
    EXPECT_EQ(t.e->pipelined_step(), pipelined);
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(t.run_step(i).ok());
    Status st = t.e->save_checkpoint(ck);
    ASSERT_TRUE(st.ok()) << st.to_string();
    for (int i = 4; i < 8; ++i) ASSERT_TRUE(t.run_step(i).ok());
    ASSERT_TRUE(t.e->synchronize().ok());
    const uint64_t ahead = t.e->stats().optimizer_read_ahead;
    EXPECT_GE(ahead, 4u * 7) << "every step after the first takes its first ring-full of chunks from the read-ahead";
    // The next forward's first groups (compute copies on NVMe) took the
    // optimizer's output instead of reading it back: after every step.
    EXPECT_GE(t.e->stats().optimizer_handoffs, 7u);
    st = t.e->load_checkpoint(ck);  // the read-ahead holds step 9's state
    ASSERT_TRUE(st.ok()) << st.to_string();
    for (int i = 4; i < 8; ++i) {
      auto r = t.run_step(i);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      EXPECT_EQ(r->loss, straight.logs[i].loss) << "step " << i;
    }
    EXPECT_TRUE(bits_equal(t.params(), straight.params));

    // The same through load_param / load_state (a trainer restoring its own
    // state_dict): the masters, moments and step counts after step 8, put
    // back after two more steps, repeat those two steps.
    const size_t np = t.e->model().params.size();
    std::vector<std::vector<float>> master(np), m(np), v(np);
    std::vector<int64_t> steps(np);
    for (ParamId p = 0; p < np; ++p) {
      const size_t n = t.e->model().params[p].numel();
      master[p].resize(n);
      m[p].resize(n);
      v[p].resize(n);
      ASSERT_TRUE(t.e->read_param(p, master[p].data(), DType::kF32).ok());
      ASSERT_TRUE(t.e->read_state(p, 0, m[p].data()).ok());
      ASSERT_TRUE(t.e->read_state(p, 1, v[p].data()).ok());
      auto ps = t.e->param_steps(p);
      ASSERT_TRUE(ps.ok());
      steps[p] = *ps;
    }
    std::vector<double> first;
    for (int i = 8; i < 10; ++i) first.push_back(t.run_step(i)->loss);
    for (ParamId p = 0; p < np; ++p) {
      ASSERT_TRUE(t.e->load_param(p, master[p].data(), DType::kF32).ok());
      ASSERT_TRUE(t.e->load_state(p, 0, m[p].data()).ok());
      ASSERT_TRUE(t.e->load_state(p, 1, v[p].data()).ok());
      ASSERT_TRUE(t.e->set_param_steps(p, steps[p]).ok());
    }
    for (int i = 8; i < 10; ++i) EXPECT_EQ(t.run_step(i)->loss, first[i - 8]) << "step " << i << " after load_state";
    // A hand-off made by the last step is dropped by load_param: the next
    // forward reads what was loaded (the masters after step 8, whose
    // compute copies differ from step 10's output).
    for (ParamId p = 0; p < np; ++p) ASSERT_TRUE(t.e->load_param(p, master[p].data(), DType::kF32).ok());
    const uint64_t before = t.e->stats().optimizer_handoffs;
    Trainer u(d.dev.get(), o);
    ASSERT_TRUE(u.init(cfg, false).ok());
    for (ParamId p = 0; p < np; ++p) ASSERT_TRUE(u.e->load_param(p, master[p].data(), DType::kF32).ok());
    auto lt = t.layer_weights(0), lu = u.layer_weights(0);
    ASSERT_TRUE(t.e->release(0, t.s).ok());
    ASSERT_TRUE(u.e->release(0, u.s).ok());
    EXPECT_TRUE(bits_equal({lt.first, lt.second}, {lu.first, lu.second})) << "the first group's upload after load_param";
    EXPECT_EQ(t.e->stats().optimizer_handoffs, before);
  }
}

// bf16 optimizer states, rounded stochastically: the random bits hash each
// element's global index, its tensor's name and its step, so RAM and NVMe
// tiers with different chunkings train the same bits, and a checkpoint
// resumes bit-identically (the steps are in the checkpoint).
TEST(EngineNvme, Bf16StatesStochasticRoundingSameBitsOnEveryTierChunkingAndResume) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  TempDir dir;
  RunOptions o;
  o.micro = 2;
  o.clip = 0.2;
  Config ram_cfg = make_config(o, Place::kHost, "");
  ram_cfg.strata.optimizer_state_dtype = DType::kBF16;
  ram_cfg.strata.optimizer_state_rounding = cpu_optim::StateRounding::kStochastic;
  ram_cfg.strata.optimizer_chunk = 1 << 20;  // whole tensors in one call
  Config cfg = make_config(o, Place::kNvme, dir.path() + "/swap");
  cfg.strata.optimizer_state_dtype = DType::kBF16;  // 2048-element chunks
  cfg.strata.optimizer_state_rounding = cpu_optim::StateRounding::kStochastic;
  RunResult ram = train(d.dev.get(), o, ram_cfg, 8);
  RunResult nvme = train(d.dev.get(), o, cfg, 8);
  ASSERT_EQ(ram.logs.size(), nvme.logs.size());
  for (size_t i = 0; i < ram.logs.size(); ++i) EXPECT_EQ(ram.logs[i].loss, nvme.logs[i].loss) << "step " << i;
  EXPECT_TRUE(bits_equal(ram.params, nvme.params));
  EXPECT_TRUE(bits_equal(ram.compute, nvme.compute));
  // Round to nearest trains other bits (the key is honoured).
  Config rne = ram_cfg;
  rne.strata.optimizer_state_rounding = cpu_optim::StateRounding::kNearest;
  EXPECT_FALSE(bits_equal(train(d.dev.get(), o, rne, 8).params, ram.params));

  // Steps 0-3, a checkpoint, then a fresh engine from it for steps 4-7.
  const std::string ck = dir.path() + "/ck";
  for (int phase = 0; phase < 2; ++phase) {
    Trainer t(d.dev.get(), o);
    ASSERT_TRUE(t.init(cfg, /*load_init=*/phase == 0).ok());
    Status st = phase == 1 ? t.e->load_checkpoint(ck) : Status();
    ASSERT_TRUE(st.ok()) << st.to_string();
    for (int i = 4 * phase; i < 4 * phase + 4; ++i) {
      auto r = t.run_step(i);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      EXPECT_EQ(r->loss, nvme.logs[i].loss) << "step " << i;
    }
    if (phase == 0) {
      st = t.e->save_checkpoint(ck, "{}");
      ASSERT_TRUE(st.ok()) << st.to_string();
    } else {
      EXPECT_TRUE(bits_equal(t.params(), nvme.params));
      EXPECT_TRUE(bits_equal(t.compute_copies(), nvme.compute));
    }
  }
}

// Bytes of a swap file that change behind Strata's back (a failing SSD, a
// stray writer) are caught by the block checksums: a checkpoint save refuses
// to copy them (and leaves nothing behind), the step that reads them fails
// naming the tensor and the file, and the checkpoint from before still
// resumes bit-identically.
TEST(EngineNvme, SwapFileCorruptionIsFoundNeverCheckpointedAndTheRunResumes) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  TempDir dir;
  RunOptions o;
  o.clip = 0.2;
  const Config cfg = make_config(o, Place::kNvme, dir.path() + "/swap");
  ASSERT_TRUE(cfg.strata.swap_checksums);  // the default
  constexpr int kBefore = 2, kTotal = 4;
  RunResult straight = train(d.dev.get(), o, cfg, kTotal);
  const std::string ck = dir.path() + "/ck", ck2 = dir.path() + "/ck2";
  Trainer t(d.dev.get(), o);
  t.expect_ok = false;
  ASSERT_TRUE(t.init(cfg).ok());
  for (int i = 0; i < kBefore; ++i) ASSERT_TRUE(t.run_step(i).ok());
  ASSERT_TRUE(t.e->save_checkpoint(ck).ok());
  // One byte in every 4 KiB of every swap file.
  int files = 0;
  for (const auto& f : std::filesystem::recursive_directory_iterator(dir.path() + "/swap")) {
    if (f.path().extension() != ".swap") continue;
    ++files;
    std::fstream io(f.path(), std::ios::in | std::ios::out | std::ios::binary);
    const auto size = static_cast<std::streamoff>(std::filesystem::file_size(f.path()));
    for (std::streamoff at = 1234; at < size; at += 4096) {
      char c = 0;
      io.seekg(at);
      io.read(&c, 1);
      c = static_cast<char>(c ^ 0x10);
      io.seekp(at);
      io.write(&c, 1);
    }
  }
  ASSERT_EQ(files, 1);
  Status st = t.e->save_checkpoint(ck2);
  EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.to_string();
  EXPECT_NE(st.message().find("swap file changed after it was written"), std::string::npos) << st.message();
  EXPECT_FALSE(std::filesystem::exists(ck2));
  for (const auto& f : std::filesystem::directory_iterator(dir.path()))
    EXPECT_EQ(f.path().filename().string().find("ck2"), std::string::npos) << "left behind: " << f.path();
  st = t.run_step(kBefore).status();
  EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.to_string();
  EXPECT_NE(st.message().find("rank00000.stripe0.swap offset"), std::string::npos) << st.message();
  std::printf("the step's error: %s\n", st.to_string().c_str());

  expect_resumes(d.dev.get(), o, cfg, ck, kBefore, kTotal, straight);
}

// Checksums off (strata.swap_checksums false) trains the same bits.
TEST(EngineNvme, ChecksumsOffTrainsTheSameBits) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  TempDir dir;
  RunOptions o;
  o.micro = 2;
  Config cfg = make_config(o, Place::kNvme, dir.path() + "/swap");
  RunResult on = train(d.dev.get(), o, cfg, 3);
  cfg.strata.swap_checksums = false;
  RunResult off = train(d.dev.get(), o, cfg, 3);
  EXPECT_TRUE(bits_equal(on.params, off.params));
}

// strata.pipelined_step (the default): step() returns once the step is
// decided and the groups' updates run behind the next forward. Bit-identical
// to the synchronous step, with accumulation, clipping, a frozen parameter,
// an lr group, fp16 loss scaling with a skipped step, and checkpoints.
TEST(EngineNvme, PipelinedStepIsBitIdenticalToTheSynchronousStep) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  TempDir dir;
  for (bool fp16 : {false, true}) {
    SCOPED_TRACE(fp16 ? "fp16, an overflow in step 3" : "bf16");
    RunOptions o;
    o.micro = 2;
    o.clip = 0.2;
    o.frozen = {3};
    o.lr_group1 = {0, 1};
    o.lr1 = 3e-3;
    if (fp16) {
      o.fp16 = true;
      o.inf_step = 3;
    }
    Config sync_cfg = make_config(o, Place::kNvme, dir.path() + "/sync");
    sync_cfg.strata.pipelined_step = false;
    const Config pipe_cfg = make_config(o, Place::kNvme, dir.path() + "/pipe");
    Trainer a(d.dev.get(), o), b(d.dev.get(), o);
    ASSERT_TRUE(a.init(sync_cfg).ok());
    ASSERT_TRUE(b.init(pipe_cfg).ok());
    EXPECT_FALSE(a.e->pipelined_step());
    EXPECT_TRUE(b.e->pipelined_step());
    for (int i = 0; i < 8; ++i) {
      auto ra = a.run_step(i), rb = b.run_step(i);
      ASSERT_TRUE(ra.ok() && rb.ok());
      EXPECT_EQ(ra->loss, rb->loss) << "step " << i;
      EXPECT_EQ(ra->r.grad_norm, rb->r.grad_norm) << "step " << i;
      EXPECT_EQ(ra->r.skipped, rb->r.skipped) << "step " << i;
      EXPECT_EQ(rb->r.step, ra->r.step);
      if (i == 4) {  // a checkpoint taken right after a pipelined step has its updates
        ASSERT_TRUE(b.e->save_checkpoint(dir.path() + "/ck").ok());
      }
    }
    ASSERT_TRUE(b.e->synchronize().ok());
    EXPECT_TRUE(bits_equal(a.params(), b.params()));
    EXPECT_TRUE(bits_equal(a.compute_copies(), b.compute_copies()));
    // Both took the next forward's first groups from the optimizer's output
    // (the group with the frozen parameter is not handed off) ...
    EXPECT_GT(a.e->stats().optimizer_handoffs, 0u);
    EXPECT_GT(b.e->stats().optimizer_handoffs, 0u);
    // ... and train the bits of a run that reads every compute copy back
    // from NVMe (no prefetch: no staging buffer to hand off into).
    {
      Trainer n(d.dev.get(), o);
      ASSERT_TRUE(n.init(make_config(o, Place::kNvme, dir.path() + "/nohand", /*prefetch=*/0)).ok());
      for (int i = 0; i < 8; ++i) ASSERT_TRUE(n.run_step(i).ok());
      ASSERT_TRUE(n.e->synchronize().ok());
      EXPECT_EQ(n.e->stats().optimizer_handoffs, 0u);
      EXPECT_TRUE(bits_equal(n.params(), b.params()));
      EXPECT_TRUE(bits_equal(n.compute_copies(), b.compute_copies()));
    }
    for (ParamId p = 0; p < a.e->model().params.size(); ++p) {
      auto sa = a.e->param_steps(p), sb = b.e->param_steps(p);  // frozen: an error on both
      ASSERT_EQ(sa.ok(), sb.ok()) << "param " << p;
      if (sa.ok()) {
        EXPECT_EQ(*sa, *sb) << "param " << p;
      }
    }
    // Resumed from the checkpoint of step 5: the same three steps again.
    Trainer c(d.dev.get(), o);
    ASSERT_TRUE(c.init(make_config(o, Place::kNvme, dir.path() + "/resume"), false).ok());
    ASSERT_TRUE(c.e->load_checkpoint(dir.path() + "/ck").ok());
    for (int i = 5; i < 8; ++i) ASSERT_TRUE(c.run_step(i).ok());
    EXPECT_TRUE(bits_equal(c.params(), b.params()));
  }
  // Compute copies homed on the device (the auto plan here): queued like
  // the others, their update uploads them; the same bits.
  {
    RunOptions o;
    o.micro = 2;
    o.clip = 0.2;
    Config sync_cfg = make_config(o, Place::kAuto, "");
    sync_cfg.strata.pipelined_step = false;
    Trainer a(d.dev.get(), o), b(d.dev.get(), o);
    ASSERT_TRUE(a.init(sync_cfg).ok());
    ASSERT_TRUE(b.init(make_config(o, Place::kAuto, "")).ok());
    EXPECT_TRUE(b.e->pipelined_step());
    for (int i = 0; i < 6; ++i) {
      auto ra = a.run_step(i), rb = b.run_step(i);
      ASSERT_TRUE(ra.ok() && rb.ok());
      EXPECT_EQ(ra->loss, rb->loss) << "step " << i;
    }
    ASSERT_TRUE(b.e->synchronize().ok());
    EXPECT_TRUE(bits_equal(a.params(), b.params()));
    EXPECT_TRUE(bits_equal(a.compute_copies(), b.compute_copies()));
  }
  // Not pipelined: overlap_backward.
  RunOptions o;
  o.overlap = true;
  Trainer ov(d.dev.get(), o);
  ASSERT_TRUE(ov.init(make_config(o, Place::kHost, "")).ok());
  EXPECT_FALSE(ov.e->pipelined_step());
}

// strata.gradient_staging (issue 13 §3): each gradient piece is copied to
// an engine-owned device buffer and the trainer's stream waits only for that
// copy; the trainer overwrites its buffer right after every reduce_grad
// (on its stream, without waiting), with and without staging, on host and
// NVMe accumulators, and still trains the reference's bits. A gradient in
// host memory cannot be staged on the host backend: refused, retryable.
TEST(EngineNvme, GradientStagingLetsTheTrainerReuseItsBufferAtOnce) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  TempDir dir;
  for (Place place : {Place::kHost, Place::kNvme}) {
    for (bool staging : {true, false}) {
      SCOPED_TRACE(std::string(place == Place::kHost ? "host" : "nvme") + (staging ? ", staged" : ", not staged"));
      RunOptions o;
      o.micro = 2;
      o.clip = 0.2;
      o.poison_grad_buffers = true;
      Config cfg = make_config(o, place, place == Place::kNvme ? dir.path() + "/swap" : "");
      cfg.strata.gradient_staging = staging;
      RunResult run = train(d.dev.get(), o, cfg, 6);
      Reference ref(o);
      expect_matches_reference(run, ref, 6);
    }
  }
  // fp32 gradients of a bf16 model: rounded to bf16 in the staging copy
  // (strata.gradient_in_compute_dtype, the default with staging), so the run
  // is the one whose trainer hands bf16 gradients, with half the
  // device -> host bytes; with it false, the fp32 run.
  {
    RunOptions given;
    given.micro = 2;
    given.clip = 0.2;
    given.grad_dtype = DType::kF32;
    RunOptions rounded = given;
    rounded.grad_dtype = DType::kBF16;
    const uint64_t elems = model_sizes(given).first;
    for (bool narrow : {true, false}) {
      SCOPED_TRACE(narrow ? "fp32 gradients sent as bf16" : "fp32 gradients sent as fp32");
      Config cfg = make_config(given, Place::kHost, "");
      cfg.strata.gradient_staging = true;
      if (!narrow) cfg.strata.gradient_in_compute_dtype = false;
      RunResult run = train(d.dev.get(), given, cfg, 4);
      Reference ref(narrow ? rounded : given);
      expect_matches_reference(run, ref, 4);
      EXPECT_EQ(run.stats.d2h_bytes, 4u * 2 * elems * (narrow ? 2 : 4));
    }
    Config bad = make_config(given, Place::kHost, "");
    bad.strata.gradient_staging = false;
    bad.strata.gradient_in_compute_dtype = true;
    Trainer t(d.dev.get(), given);
    Status st = t.init(bad);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find("gradient_in_compute_dtype"), std::string::npos) << st.message();
  }
  RunOptions o;
  Config cfg = make_config(o, Place::kHost, "");
  cfg.strata.gradient_staging = true;
  Trainer t(d.dev.get(), o);
  ASSERT_TRUE(t.init(cfg).ok());
  std::vector<float> host(uint64_t(kDims[1]) * kDims[0], 1.0f);
  Status st = t.e->reduce_grad(0, host.data(), DType::kF32, t.s);
  if (t.dev->kind() == DeviceKind::kHost) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find("nothing was accumulated; the call may be retried"), std::string::npos)
        << st.message();
    ASSERT_TRUE(t.e->reduce_grad(0, t.grad_buf[0], DType::kF32, t.s).ok());
  }
}

// Device-homed compute copies (issue 13 §3) come out of the optimizer pass:
// uploaded from its ring chunk by chunk, with no master read back, pipelined
// (queued like every group; acquire waits for the group's update) or not.
// The reference's bits either way; per step, NVMe reads and writes are
// exactly master + moments + gradient and host->device exactly the compute
// copies (the planner's minimum for this placement).
TEST(EngineNvme, DeviceHomedComputeCopiesAreUploadedByTheOptimizerPass) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  TempDir dir;
  RunOptions o;
  o.clip = 0.2;
  const auto [elems, compute] = model_sizes(o);
  for (bool pipelined : {true, false}) {
    SCOPED_TRACE(pipelined ? "pipelined" : "synchronous");
    Config cfg = make_config(o, Place::kAuto, dir.path() + (pipelined ? "/p" : "/s"));
    cfg.strata.groups.push_back(GroupTierRule{"*", Tier::kDevice, Tier::kNvme, Tier::kNvme, Tier::kNvme});
    cfg.strata.pipelined_step = pipelined;
    Trainer t(d.dev.get(), o);
    Status init = t.init(cfg);
    ASSERT_TRUE(init.ok()) << init.to_string();
    EXPECT_EQ(t.e->pipelined_step(), pipelined);
    for (const auto& g : t.e->plan().groups)
      ASSERT_EQ(g.tier[static_cast<int>(StateKind::kCompute)], Tier::kDevice) << g.name;
    Reference ref(o);
    constexpr int kMeasured = 5;
    EngineStats before;
    for (int i = 0; i < kSteps; ++i) {
      if (i == kSteps - kMeasured) {
        ASSERT_TRUE(t.e->synchronize().ok());
        before = t.e->stats();
      }
      auto r = t.run_step(i);
      ASSERT_TRUE(r.ok()) << "step " << i << ": " << r.status().to_string();
      EXPECT_EQ(r->loss, ref.run_step(i)) << "step " << i;
      EXPECT_EQ(r->r.grad_norm, ref.norms.back()) << "step " << i;
    }
    ASSERT_TRUE(t.e->synchronize().ok());
    const EngineStats after = t.e->stats();
    EXPECT_EQ(after.nvme_read_bytes - before.nvme_read_bytes, kMeasured * elems * (4 + 4 + 4 + 4));
    EXPECT_EQ(after.nvme_write_bytes - before.nvme_write_bytes, kMeasured * elems * (4 + 4 + 4 + 4));
    EXPECT_EQ(after.h2d_bytes - before.h2d_bytes, kMeasured * compute);
    EXPECT_TRUE(bits_equal(t.params(), ref.master)) << "masters differ from the reference";
    std::vector<std::vector<float>> c;
    for (size_t p = 0; p < ref.master.size(); ++p) c.push_back(ref.compute(p));
    EXPECT_TRUE(bits_equal(t.compute_copies(), c)) << "compute copies differ from the reference";
  }
}

// The fault campaign (issue 10, RELIABILITY.md): every NVMe I/O of a step
// fails in turn (EIO and ENOSPC on reads and writes), and separately every
// piece is cut short. A failed I/O ends in a Status naming it (never a crash
// or a hang); the checkpoint saved before stays intact, and loading it into
// the same engine continues bit-identically to a run that never failed. A
// short transfer is resubmitted: the step succeeds with the same bits.
// Some failures are also repaired in the same engine: discard_step, then
// load_checkpoint (a pipelined step's failure leaves it refusing saves and
// steps until then). One test per kind of failure, so that the four
// campaigns spread over the cores ctest has.
struct FailedIo {
  io::IoOpKind op;
  int err;
};
void PrintTo(const FailedIo& f, std::ostream* os) {
  *os << (f.op == io::IoOpKind::kRead ? "read" : "write") << " errno " << f.err;
}
class EngineNvmeFaults : public ::testing::TestWithParam<FailedIo> {};

TEST_P(EngineNvmeFaults, EveryFailedIoOfAStepIsAnErrorAndTheCheckpointStillResumes) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  TempDir dir;
  RunOptions o;
  o.clip = 0.2;
  const Config cfg = make_config(o, Place::kNvme, dir.path() + "/swap");
  constexpr int kBefore = 2, kTotal = 4;
  RunResult straight = train(d.dev.get(), o, cfg, kTotal);
  const std::string ck = dir.path() + "/ck";
  const FailedIo k = GetParam();
  int failed_runs = 0, injected_total = 0, torn_repaired = 0;
  for (uint64_t n = 1; n <= 400; ++n) {
    SCOPED_TRACE(::testing::Message() << (k.op == io::IoOpKind::kRead ? "read" : "write") << " #" << n
                                      << " fails with errno " << k.err);
    auto faults = std::make_shared<io::FaultInjector>();
    Trainer t(d.dev.get(), o);
    t.expect_ok = false;
    ASSERT_TRUE(t.init(cfg, true, faults).ok());
    for (int i = 0; i < kBefore; ++i) ASSERT_TRUE(t.run_step(i).ok());
    std::filesystem::remove_all(ck);
    ASSERT_TRUE(t.e->save_checkpoint(ck).ok());
    faults->set_plan({.op = k.op, .fail_nth = n, .fail_errno = k.err});
    Status st;
    for (int i = kBefore; i < kTotal && st.ok(); ++i) st = t.run_step(i).status();
    if (st.ok()) st = t.e->synchronize();  // the last step's pipelined updates
    const bool hit = faults->faults_injected() > 0;
    faults->set_plan({});
    if (!hit) {
      EXPECT_TRUE(st.ok()) << st.to_string();
      break;  // every I/O of these steps has failed once
    }
    ++injected_total;
    if (st.ok()) continue;  // the failed I/O was not needed (e.g. a prefetch replaced later)
    ++failed_runs;
    EXPECT_NE(st.message().find(k.err == EIO ? "Input/output error" : "No space left"), std::string::npos)
        << st.to_string();
    const bool torn = st.message().find("optimizer step") != std::string::npos;  // not a failed upload
    if (failed_runs % 64 == 1 || (torn && torn_repaired < 3)) {
      // The same engine: it refuses to save or step on the torn state, and
      // loading the checkpoint repairs it (a pipelined step's failure is
      // cleared by the load, as a synchronous one's).
      (void)t.e->discard_step(t.s);
      if (torn) {
        ++torn_repaired;
        EXPECT_FALSE(t.e->save_checkpoint(dir.path() + "/torn").ok());
        EXPECT_FALSE(t.e->step().ok());
      }
      Status ls = t.e->load_checkpoint(ck);
      ASSERT_TRUE(ls.ok()) << ls.to_string();
      t.expect_ok = true;
      t.failed = Status();
      for (int i = kBefore; i < kTotal; ++i) {
        auto r = t.run_step(i);
        ASSERT_TRUE(r.ok()) << st.to_string() << " then " << r.status().to_string();
        EXPECT_EQ(r->loss, straight.logs[i].loss) << "step " << i;
      }
      EXPECT_TRUE(t.e->synchronize().ok());
      EXPECT_TRUE(bits_equal(t.params(), straight.params));
    }
    // A new engine (a new process) loads the checkpoint from before the
    // failure and the run continues as if nothing had happened.
    expect_resumes(d.dev.get(), o, cfg, ck, kBefore, kTotal, straight);
  }
  EXPECT_GT(failed_runs, 0);
  EXPECT_GT(torn_repaired, 0);
  std::printf("fault campaign (%s, errno %d): %d I/Os failed one at a time, %d of them ended the step with an "
              "error; %d optimizer-step failures repaired in the same engine\n",
              k.op == io::IoOpKind::kRead ? "reads" : "writes", k.err, injected_total, failed_runs, torn_repaired);
}
INSTANTIATE_TEST_SUITE_P(ReadsAndWrites, EngineNvmeFaults,
                         ::testing::Values(FailedIo{io::IoOpKind::kRead, EIO}, FailedIo{io::IoOpKind::kWrite, EIO},
                                           FailedIo{io::IoOpKind::kWrite, ENOSPC},
                                           FailedIo{io::IoOpKind::kRead, ENOSPC}),
                         [](const ::testing::TestParamInfo<FailedIo>& i) {
                           return std::string(i.param.op == io::IoOpKind::kRead ? "Read" : "Write") +
                                  (i.param.err == EIO ? "Eio" : "Enospc");
                         });

// Every piece cut short: resubmitted, same bits.
TEST(EngineNvme, EveryShortTransferIsResubmittedWithTheSameBits) {
  Device d = make_device();
  SKIP_WITHOUT_DEVICE(d);
  TempDir dir;
  RunOptions o;
  o.clip = 0.2;
  const Config cfg = make_config(o, Place::kNvme, dir.path() + "/swap");
  constexpr int kTotal = 4;
  RunResult straight = train(d.dev.get(), o, cfg, kTotal);
  auto faults = std::make_shared<io::FaultInjector>();
  faults->set_plan({.op = std::nullopt, .short_every = 1});
  Trainer t(d.dev.get(), o);
  ASSERT_TRUE(t.init(cfg, true, faults).ok());
  for (int i = 0; i < kTotal; ++i) ASSERT_TRUE(t.run_step(i).ok());
  EXPECT_GT(faults->shorts_injected(), 0u);
  EXPECT_TRUE(bits_equal(t.params(), straight.params));
}
#endif

}  // namespace
}  // namespace strata
