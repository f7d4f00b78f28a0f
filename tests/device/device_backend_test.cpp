// Every DeviceBackend operation checked against a scalar reference, on each
// backend this build can run. The same source builds two programs:
//   test_device_host (label unit): the host backend, always;
//   test_device_cuda (label gpu):  the CUDA backend; skips with the loader's
//                                  reason where no module or GPU is usable.
// STRATA_TEST_DEVICE_KIND selects which ("host" or "cuda").
#include "device/device_backend.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/tunables.h"
#include "device/caching_allocator.h"
#include "device/cuda_backend.h"
#include "device/cuda_loader.h"
#include "device/host_backend.h"
#include "common/device_numeric.h"
#include "device/cuda_status.h"
#include "test_util/gpu.h"

#ifndef STRATA_TEST_DEVICE_KIND
#define STRATA_TEST_DEVICE_KIND "host"
#define STRATA_TEST_DEVICE_IS_CUDA 0
#endif

namespace strata {
namespace {

namespace dm = device_math;

// ---------------------------------------------------------------- references
// Written independently of common/device_numeric.h: rounding by comparing distances
// in double rather than by the bit trick.
uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t ref_f32_to_bf16(float x) {
  if (std::isnan(x)) return 0x7fc0;
  const uint32_t u = bits_of(x);
  if ((u & 0xffffu) == 0) return static_cast<uint16_t>(u >> 16);
  const uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
  // Distance in double; the value above the largest finite bf16 counts as 2^128.
  auto value = [](uint32_t b) {
    if ((b & 0x7fffffffu) == 0x7f800000u) return std::copysign(std::ldexp(1.0, 128), static_cast<double>(float_of(b)));
    return static_cast<double>(float_of(b));
  };
  const double dl = std::fabs(static_cast<double>(x) - value(lo));
  const double dh = std::fabs(value(hi) - static_cast<double>(x));
  if (dl < dh) return static_cast<uint16_t>(lo >> 16);
  if (dh < dl) return static_cast<uint16_t>(hi >> 16);
  return static_cast<uint16_t>(((lo >> 16) & 1u) ? hi >> 16 : lo >> 16);  // tie: even
}

#if defined(__FLT16_MAX__)
uint16_t ref_f32_to_f16(float x) {
  _Float16 h = static_cast<_Float16>(x);  // the compiler's IEEE conversion (round to nearest even)
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
float ref_f16_to_f32(uint16_t b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  return static_cast<float>(h);
}
#endif

// Special values for every conversion test: zeros, ties, denormals, the
// edges of each format's range, infinities and several NaNs.
std::vector<float> special_values() {
  std::vector<uint32_t> b = {
      0x00000000, 0x80000000, 0x3f800000, 0xbf800000,  // +-0, +-1
      0x3f808000, 0x3f818000, 0x3f808001, 0x3f80ffff,  // bf16 ties to even (down, up), just above, just below
      0xbf808000, 0xbf818000,                          // negative ties
      0x00000001, 0x00008000, 0x00018000, 0x007fffff,  // fp32 denormals incl. bf16 ties
      0x00800000, 0x80800001,                          // smallest normal
      0x7f7fffff, 0x7f7f7fff, 0x7f7f8000, 0xff7fffff,  // largest finite: rounds to inf / stays / tie
      0x7f800000, 0xff800000,                          // inf
      0x7fc00000, 0xffc00000, 0x7f800001, 0x7fbfffff, 0xffc00001,  // NaNs (quiet, signalling, payloads)
      0x477fe000, 0x477ff000, 0x477fefff, 0x47800000,              // fp16 max 65504, 65520 (-> inf), just below, 65536
      0x38800000, 0x387fc000, 0x33800000, 0x33000000, 0x33000001, 0x337fffff,  // fp16 normal/subnormal edges, 2^-25 tie
      0x3a800800, 0x3a801800,                                                  // fp16 subnormal-range ties
  };
  std::vector<float> v;
  for (uint32_t u : b) v.push_back(float_of(u));
  return v;
}

std::vector<float> random_floats(std::size_t n, uint32_t seed, bool any_bits) {
  std::mt19937 rng(seed);
  std::vector<float> v(n);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& x : v) x = any_bits ? float_of(rng()) : normal(rng);
  return v;
}

// ---------------------------------------------------------------- fixture
class PinnedBuffer {
 public:
  PinnedBuffer(DeviceBackend& b, std::size_t bytes) : b_(b) {
    auto a = b.alloc_pinned(bytes);
    EXPECT_TRUE(a.ok()) << a.status().to_string();
    if (a.ok()) a_ = a.value();
  }
  ~PinnedBuffer() { b_.free_pinned(a_); }
  void* data() { return a_.ptr; }

 private:
  DeviceBackend& b_;
  HostAllocation a_;
};

constexpr uint64_t kBudget = 256ull << 20;

#ifdef STRATA_TEST_CUDA_MODULE
// Point the loader at the module just built, before anything reads the
// tunables (they are parsed on first use, after static initialization) or
// loads the module (decided once per process).
const bool kModuleSet = [] { return setenv("STRATA_CUDA_MODULE", STRATA_TEST_CUDA_MODULE, 1) == 0; }();
#endif

Result<std::unique_ptr<DeviceBackend>> make_backend(const std::string& kind, uint64_t budget) {
  if (kind == "cuda") {
    STRATA_ASSIGN_OR_RETURN(CudaBackend m, load_cuda_backend());
    return create_cuda_backend(m, 0, budget);
  }
  HostBackendOptions o;
  o.budget_bytes = budget;
  return create_host_backend(o);
}

class DeviceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto b = make_backend(GetParam(), kBudget);
    if (!b.ok()) {
      ASSERT_EQ(b.status().code(), StatusCode::kUnavailable) << b.status().to_string();
      STRATA_SKIP_WITHOUT_GPU("no " << GetParam() << " backend here: " << b.status().message());
    }
    backend_ = std::move(b).value();
    auto s = backend_->create_stream("test");
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    stream_ = s.value();
  }
  void TearDown() override {
    if (!backend_) return;
    EXPECT_TRUE(backend_->destroy_stream(stream_).ok());
    for (void* p : allocs_) EXPECT_TRUE(backend_->free(p).ok());
    const DeviceMemoryStats st = backend_->memory_stats();
    EXPECT_EQ(st.in_use, 0u);
    EXPECT_EQ(st.live_blocks, 0u);
    backend_.reset();
  }
  bool is_host() const { return GetParam() == "host"; }

  void* dev_alloc(std::size_t bytes) {
    auto p = backend_->alloc(bytes);
    EXPECT_TRUE(p.ok()) << p.status().to_string();
    if (!p.ok()) return nullptr;
    allocs_.push_back(p.value());
    return p.value();
  }
  template <class T>
  T* upload(const std::vector<T>& v) {
    const std::size_t bytes = v.size() * sizeof(T);
    auto* d = static_cast<T*>(dev_alloc(bytes));
    PinnedBuffer h(*backend_, bytes);
    std::memcpy(h.data(), v.data(), bytes);
    EXPECT_TRUE(backend_->copy_async(d, h.data(), bytes, CopyKind::kHostToDevice, stream_).ok());
    EXPECT_TRUE(backend_->synchronize(stream_).ok());
    return d;
  }
  template <class T>
  std::vector<T> download(const T* d, std::size_t n) {
    std::vector<T> v(n);
    PinnedBuffer h(*backend_, n * sizeof(T));
    Status st = backend_->copy_async(h.data(), d, n * sizeof(T), CopyKind::kDeviceToHost, stream_);
    EXPECT_TRUE(st.ok()) << st.to_string();
    st = backend_->synchronize(stream_);
    EXPECT_TRUE(st.ok()) << st.to_string();
    std::memcpy(v.data(), h.data(), n * sizeof(T));
    return v;
  }

  std::unique_ptr<DeviceBackend> backend_;
  DeviceStream* stream_ = nullptr;
  std::vector<void*> allocs_;
};

std::string hex(uint32_t u) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", u);
  return b;
}

// ---------------------------------------------------------------- casts
TEST_P(DeviceTest, CastF32ToBf16RoundsToNearestEven) {
  std::vector<float> in = special_values();
  auto r = random_floats(1 << 20, 1, /*any_bits=*/true);
  in.insert(in.end(), r.begin(), r.end());
  const float* d_in = upload(in);
  auto* d_out = static_cast<uint16_t*>(dev_alloc(in.size() * 2));
  ASSERT_TRUE(backend_->cast_async(d_out, DType::kBF16, d_in, DType::kF32, in.size(), 1.0f, stream_).ok());
  auto out = download(d_out, in.size());
  int bad = 0;
  for (std::size_t i = 0; i < in.size() && bad < 10; ++i) {
    const uint16_t want = ref_f32_to_bf16(in[i]);
    if (out[i] != want) {
      ++bad;
      ADD_FAILURE() << "bf16(" << hex(bits_of(in[i])) << ") = " << std::hex << out[i] << ", want " << want;
    }
  }
}

TEST_P(DeviceTest, CastF32ToF16RoundsToNearestEven) {
#if !defined(__FLT16_MAX__)
  GTEST_SKIP() << "the compiler has no _Float16 to serve as the reference";
#else
  std::vector<float> in = special_values();
  auto r = random_floats(1 << 20, 2, /*any_bits=*/true);
  in.insert(in.end(), r.begin(), r.end());
  // Values in fp16's range, where rounding (not overflow) is exercised.
  for (float x : random_floats(1 << 16, 3, false)) in.push_back(x * 1e-5f);
  const float* d_in = upload(in);
  auto* d_out = static_cast<uint16_t*>(dev_alloc(in.size() * 2));
  ASSERT_TRUE(backend_->cast_async(d_out, DType::kF16, d_in, DType::kF32, in.size(), 1.0f, stream_).ok());
  auto out = download(d_out, in.size());
  int bad = 0;
  for (std::size_t i = 0; i < in.size() && bad < 10; ++i) {
    const uint16_t want = ref_f32_to_f16(in[i]);
    const bool ok = std::isnan(in[i])
                        ? ((out[i] & 0x7c00) == 0x7c00 && (out[i] & 0x3ff) != 0 && (out[i] & 0x8000) == (want & 0x8000))
                        : out[i] == want;
    if (!ok) {
      ++bad;
      ADD_FAILURE() << "fp16(" << hex(bits_of(in[i])) << ") = " << std::hex << out[i] << ", want " << want;
    }
  }
#endif
}

TEST_P(DeviceTest, WideningIsExactForEveryPattern) {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  const uint16_t* d_in = upload(all);
  auto* d_out = static_cast<float*>(dev_alloc(65536 * 4));
  ASSERT_TRUE(backend_->cast_async(d_out, DType::kF32, d_in, DType::kBF16, 65536, 1.0f, stream_).ok());
  auto bf = download(d_out, 65536);
  ASSERT_TRUE(backend_->cast_async(d_out, DType::kF32, d_in, DType::kF16, 65536, 1.0f, stream_).ok());
  auto hf = download(d_out, 65536);
  for (uint32_t i = 0; i < 65536; ++i) {
    ASSERT_EQ(bits_of(bf[i]), i << 16) << "bf16 " << i;
#if defined(__FLT16_MAX__)
    const float want = ref_f16_to_f32(static_cast<uint16_t>(i));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(hf[i])) << "fp16 " << i;
    } else {
      ASSERT_EQ(bits_of(hf[i]), bits_of(want)) << "fp16 " << i;
    }
#endif
  }
}

TEST_P(DeviceTest, ScaleInPlaceAndFusedScaleCast) {
  const std::size_t n = 100003;  // odd: no kernel may assume a multiple of anything
  auto x = random_floats(n, 4, false);
  x[7] = INFINITY;
  x[8] = NAN;
  float* d = upload(x);
  ASSERT_TRUE(backend_->scale_async(d, DType::kF32, n, 0.125f, stream_).ok());
  auto scaled = download(d, n);
  for (std::size_t i = 0; i < n; ++i) {
    const float want = x[i] * 0.125f;
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(scaled[i]));
    } else {
      ASSERT_EQ(scaled[i], want) << i;
    }
  }
  // Fused: bf16 = round(float * s), and in-place on a bf16 buffer.
  auto* b = static_cast<uint16_t*>(dev_alloc(n * 2));
  ASSERT_TRUE(backend_->cast_async(b, DType::kBF16, d, DType::kF32, n, 3.0f, stream_).ok());
  ASSERT_TRUE(backend_->scale_async(b, DType::kBF16, n, 0.5f, stream_).ok());
  auto out = download(b, n);
  for (std::size_t i = 0; i < n; ++i) {
    const uint16_t once = ref_f32_to_bf16(scaled[i] * 3.0f);
    const uint16_t want = ref_f32_to_bf16(float_of(static_cast<uint32_t>(once) << 16) * 0.5f);
    ASSERT_EQ(out[i], want) << i;
  }
}

// ---------------------------------------------------------------- accumulate
TEST_P(DeviceTest, AccumulateFp32AndBf16) {
  const std::size_t n = 65537;
  auto acc = random_floats(n, 5, false);
  auto g32 = random_floats(n, 6, false);
  auto g16f = random_floats(n, 7, false);
  std::vector<uint16_t> g16(n);
  for (std::size_t i = 0; i < n; ++i) g16[i] = ref_f32_to_bf16(g16f[i]);
  float* d_acc = upload(acc);
  const float* d_g32 = upload(g32);
  const uint16_t* d_g16 = upload(g16);
  ASSERT_TRUE(backend_->accumulate_async(d_acc, d_g32, DType::kF32, n, 1.0f, stream_).ok());
  ASSERT_TRUE(backend_->accumulate_async(d_acc, d_g16, DType::kBF16, n, 0.25f, stream_).ok());
  auto out = download(d_acc, n);
  for (std::size_t i = 0; i < n; ++i) {
    float want = acc[i] + g32[i];
    want = want + float_of(static_cast<uint32_t>(g16[i]) << 16) * 0.25f;
    ASSERT_EQ(out[i], want) << i;
  }
}

// ---------------------------------------------------------------- norm
TEST_P(DeviceTest, SquaredNormAndNonFiniteCount) {
  const std::size_t n = 1000001;
  auto x = random_floats(n, 8, false);
  std::vector<uint16_t> xb(n / 2);
  for (std::size_t i = 0; i < xb.size(); ++i) xb[i] = ref_f32_to_bf16(x[i]);
  const float* d_x = upload(x);
  const uint16_t* d_xb = upload(xb);
  auto* d_stats = static_cast<NormStats*>(dev_alloc(sizeof(NormStats)));

  double want = 0;
  for (float v : x) want += static_cast<double>(v) * v;
  for (uint16_t b : xb) {
    const double v = float_of(static_cast<uint32_t>(b) << 16);
    want += v * v;
  }
  ASSERT_TRUE(backend_->fill_zero_async(d_stats, sizeof(NormStats), stream_).ok());
  ASSERT_TRUE(backend_->sq_norm_async(d_x, DType::kF32, n, d_stats, stream_).ok());
  ASSERT_TRUE(backend_->sq_norm_async(d_xb, DType::kBF16, xb.size(), d_stats, stream_).ok());
  NormStats got = download(d_stats, 1)[0];
  // Double sums of ~1.5e6 terms of magnitude ~1: any order is within 1e-12.
  EXPECT_NEAR(got.sum_sq, want, 1e-12 * want);
  EXPECT_EQ(got.nonfinite, 0u);

  // inf and NaN are counted, not summed; huge finite values do not overflow.
  const float bigf = 3e38f;
  std::vector<float> y = {1.0f, INFINITY, 2.0f, -INFINITY, NAN, bigf, -bigf};
  const float* d_y = upload(y);
  ASSERT_TRUE(backend_->fill_zero_async(d_stats, sizeof(NormStats), stream_).ok());
  ASSERT_TRUE(backend_->sq_norm_async(d_y, DType::kF32, y.size(), d_stats, stream_).ok());
  got = download(d_stats, 1)[0];
  EXPECT_EQ(got.nonfinite, 3u);
  const double big = bigf;
  EXPECT_NEAR(got.sum_sq, 5.0 + 2 * big * big, 1e-12 * big * big);
  EXPECT_TRUE(std::isfinite(got.sum_sq));
}

// The norm decides clipping: it must be the same bits every run (CUDA: the
// blocks' partials are added in a fixed order, never by float atomics).
TEST_P(DeviceTest, SqNormIsTheSameBitsEveryRun) {
  const size_t n = (size_t{3} << 20) + 77;  // many blocks, a ragged tail
  std::vector<float> x(n);
  uint32_t s = 12345;
  for (auto& v : x) {
    s = s * 1664525u + 1013904223u;
    v = static_cast<float>(static_cast<int32_t>(s)) * 1e-9f;
  }
  const float* d_x = upload(x);
  auto* d_stats = static_cast<NormStats*>(dev_alloc(sizeof(NormStats)));
  double first = 0;
  for (int run = 0; run < 5; ++run) {
    ASSERT_TRUE(backend_->fill_zero_async(d_stats, sizeof(NormStats), stream_).ok());
    ASSERT_TRUE(backend_->sq_norm_async(d_x, DType::kF32, n, d_stats, stream_).ok());
    const NormStats got = download(d_stats, 1)[0];
    if (run == 0) first = got.sum_sq;
    EXPECT_EQ(std::memcmp(&got.sum_sq, &first, sizeof(double)), 0) << "run " << run << ": " << got.sum_sq << " vs " << first;
  }
}

// ---------------------------------------------------------------- AdamW
struct AdamCase {
  DType grad;
  bool with_out;
};

void run_adamw(DeviceTest* t, DeviceBackend& b, DeviceStream* s, AdamCase c) {
  (void)t;
  const std::size_t n = 4099;
  const int steps = 100;
  AdamWArgs a;
  a.count = n;
  a.lr = 1e-2;
  a.beta1 = 0.9;
  a.beta2 = 0.999;
  a.eps = 1e-8;
  a.weight_decay = 0.1;
  a.grad_dtype = c.grad;
  a.out_dtype = DType::kBF16;

  std::vector<float> p = random_floats(n, 9, false), m(n, 0.0f), v(n, 0.0f);
  std::vector<double> pd(p.begin(), p.end()), md(n, 0.0), vd(n, 0.0);
  std::vector<float> pf = p, mf = m, vf = v;  // the shared formula run here: must match bit for bit

  auto alloc = [&](std::size_t bytes) {
    auto r = b.alloc(bytes);
    EXPECT_TRUE(r.ok());
    return r.value();
  };
  void* d_p = alloc(n * 4);
  void* d_m = alloc(n * 4);
  void* d_v = alloc(n * 4);
  void* d_g = alloc(n * 4);
  void* d_out = alloc(n * 2);
  auto hp = b.alloc_pinned(n * 4 * 3);
  ASSERT_TRUE(hp.ok());
  auto* h = static_cast<float*>(hp->ptr);
  std::memcpy(h, p.data(), n * 4);
  ASSERT_TRUE(b.copy_async(d_p, h, n * 4, CopyKind::kHostToDevice, s).ok());
  ASSERT_TRUE(b.fill_zero_async(d_m, n * 4, s).ok());
  ASSERT_TRUE(b.fill_zero_async(d_v, n * 4, s).ok());
  auto hg = b.alloc_pinned(n * 4);
  ASSERT_TRUE(hg.ok());

  std::mt19937 rng(10);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int step = 1; step <= steps; ++step) {
    std::vector<float> g(n);
    for (auto& x : g) x = normal(rng) * 0.1f;
    if (c.grad == DType::kBF16) {
      auto* gb = static_cast<uint16_t*>(hg->ptr);
      for (std::size_t i = 0; i < n; ++i) {
        gb[i] = ref_f32_to_bf16(g[i]);
        g[i] = float_of(static_cast<uint32_t>(gb[i]) << 16);
      }
    } else {
      std::memcpy(hg->ptr, g.data(), n * 4);
    }
    ASSERT_TRUE(b.copy_async(d_g, hg->ptr, n * dtype_size(c.grad), CopyKind::kHostToDevice, s).ok());
    a.params = static_cast<float*>(d_p);
    a.exp_avg = static_cast<float*>(d_m);
    a.exp_avg_sq = static_cast<float*>(d_v);
    a.grads = d_g;
    a.out = c.with_out ? d_out : nullptr;
    a.step = step;
    ASSERT_TRUE(b.adamw_async(a, s).ok());
    // The pinned gradient buffer is reused next step: wait for the copy.
    ASSERT_TRUE(b.synchronize(s).ok());

    // Double reference (torch.optim.AdamW's formula).
    const double bc1 = 1 - std::pow(a.beta1, step), bc2 = 1 - std::pow(a.beta2, step);
    const auto k = dm::adamw_consts(a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, step, 1.0);
    for (std::size_t i = 0; i < n; ++i) {
      const double gd = g[i];
      pd[i] *= 1 - a.lr * a.weight_decay;
      md[i] = a.beta1 * md[i] + (1 - a.beta1) * gd;
      vd[i] = a.beta2 * vd[i] + (1 - a.beta2) * gd * gd;
      pd[i] -= a.lr / bc1 * md[i] / (std::sqrt(vd[i]) / std::sqrt(bc2) + a.eps);
      dm::adamw_element(k, g[i], pf[i], mf[i], vf[i]);
    }
  }
  ASSERT_TRUE(b.copy_async(h, d_p, n * 4, CopyKind::kDeviceToHost, s).ok());
  ASSERT_TRUE(b.copy_async(h + n, d_m, n * 4, CopyKind::kDeviceToHost, s).ok());
  ASSERT_TRUE(b.copy_async(h + 2 * n, d_v, n * 4, CopyKind::kDeviceToHost, s).ok());
  std::vector<uint16_t> out(n);
  auto ho = b.alloc_pinned(n * 2);
  ASSERT_TRUE(ho.ok());
  if (c.with_out) {
    ASSERT_TRUE(b.copy_async(ho->ptr, d_out, n * 2, CopyKind::kDeviceToHost, s).ok());
  }
  ASSERT_TRUE(b.synchronize(s).ok());
  std::memcpy(out.data(), ho->ptr, n * 2);

  // Tolerance against double: 100 fp32 steps of size <= lr = 1e-2 accumulate
  // rounding of a few ulp each; 2e-5 absolute is ~100x the observed error and
  // far below one step's size (1e-2), so a wrong formula cannot pass.
  double max_err = 0;
  for (std::size_t i = 0; i < n; ++i) {
    max_err = std::max(max_err, std::fabs(h[i] - pd[i]));
    ASSERT_NEAR(h[i], pd[i], 2e-5) << "param " << i;
    ASSERT_NEAR(h[n + i], md[i], 1e-6) << "exp_avg " << i;
    ASSERT_NEAR(h[2 * n + i], vd[i], 1e-7 + 1e-5 * vd[i]) << "exp_avg_sq " << i;
    // Bit-identical to the shared per-element formula (and so to the other backend).
    ASSERT_EQ(bits_of(h[i]), bits_of(pf[i])) << "param " << i;
    ASSERT_EQ(bits_of(h[n + i]), bits_of(mf[i])) << "exp_avg " << i;
    ASSERT_EQ(bits_of(h[2 * n + i]), bits_of(vf[i])) << "exp_avg_sq " << i;
    if (c.with_out) {
      ASSERT_EQ(out[i], ref_f32_to_bf16(h[i])) << "bf16 copy " << i;
    }
  }
  ::testing::Test::RecordProperty("max_abs_err_vs_double", std::to_string(max_err));
  b.free_pinned(hp.value());
  b.free_pinned(hg.value());
  b.free_pinned(ho.value());
  for (void* d : {d_p, d_m, d_v, d_g, d_out}) EXPECT_TRUE(b.free(d).ok());
}

TEST_P(DeviceTest, AdamWFp32GradsMatchesDoubleReference) {
  run_adamw(this, *backend_, stream_, {DType::kF32, false});
}
TEST_P(DeviceTest, AdamWBf16GradsWithBf16Copy) {
  run_adamw(this, *backend_, stream_, {DType::kBF16, true});
}

TEST_P(DeviceTest, AdamWRejectsStepZero) {
  AdamWArgs a;
  a.step = 0;
  a.count = 1;
  EXPECT_EQ(backend_->adamw_async(a, stream_).code(), StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------- copies
TEST_P(DeviceTest, CopiesRoundTripAtOddSizes) {
  for (std::size_t bytes : {std::size_t{1}, std::size_t{3}, std::size_t{4097}, (std::size_t{1} << 20) + 13}) {
    std::vector<uint8_t> src(bytes);
    std::mt19937 rng(static_cast<uint32_t>(bytes));
    for (auto& c : src) c = static_cast<uint8_t>(rng());
    PinnedBuffer h(*backend_, bytes);
    PinnedBuffer back(*backend_, bytes);
    std::memcpy(h.data(), src.data(), bytes);
    void* d1 = dev_alloc(bytes);
    void* d2 = dev_alloc(bytes);
    ASSERT_TRUE(backend_->copy_async(d1, h.data(), bytes, CopyKind::kHostToDevice, stream_).ok());
    ASSERT_TRUE(backend_->copy_async(d2, d1, bytes, CopyKind::kDeviceToDevice, stream_).ok());
    ASSERT_TRUE(backend_->copy_async(back.data(), d2, bytes, CopyKind::kDeviceToHost, stream_).ok());
    ASSERT_TRUE(backend_->synchronize(stream_).ok());
    ASSERT_EQ(std::memcmp(back.data(), src.data(), bytes), 0) << bytes << " bytes";
  }
}

// ---------------------------------------------------------------- ordering
// Stream A adds 1 to a buffer, stream B copies it out; events order them both
// ways (B after A's add; A's next add after B's copy). Any missing order shows
// as a snapshot that is not exactly i+1 everywhere.
TEST_P(DeviceTest, EventsOrderWorkAcrossStreams) {
  const std::size_t n = 16384;
  const int iters = 200;
  auto sa = backend_->create_stream("A");
  auto sb = backend_->create_stream("B");
  ASSERT_TRUE(sa.ok() && sb.ok());
  auto ea = backend_->create_event();
  auto eb = backend_->create_event();
  ASSERT_TRUE(ea.ok() && eb.ok());
  float* buf = upload(std::vector<float>(n, 0.0f));
  const float* ones = upload(std::vector<float>(n, 1.0f));
  PinnedBuffer snaps(*backend_, n * 4 * iters);
  auto* out = static_cast<float*>(snaps.data());
  for (int i = 0; i < iters; ++i) {
    ASSERT_TRUE(backend_->wait(*sa, *eb).ok());  // the previous copy has read buf
    ASSERT_TRUE(backend_->accumulate_async(buf, ones, DType::kF32, n, 1.0f, *sa).ok());
    ASSERT_TRUE(backend_->record(*ea, *sa).ok());
    ASSERT_TRUE(backend_->wait(*sb, *ea).ok());
    ASSERT_TRUE(backend_->copy_async(out + i * n, buf, n * 4, CopyKind::kDeviceToHost, *sb).ok());
    ASSERT_TRUE(backend_->record(*eb, *sb).ok());
  }
  ASSERT_TRUE(backend_->synchronize(*eb).ok());
  auto done = backend_->query(*eb);
  ASSERT_TRUE(done.ok() && done.value());
  for (int i = 0; i < iters; ++i)
    for (std::size_t j = 0; j < n; ++j) ASSERT_EQ(out[i * n + j], static_cast<float>(i + 1)) << "iteration " << i;
  backend_->destroy_event(*ea);
  backend_->destroy_event(*eb);
  EXPECT_TRUE(backend_->destroy_stream(*sa).ok());
  EXPECT_TRUE(backend_->destroy_stream(*sb).ok());
}

TEST_P(DeviceTest, UnrecordedEventIsComplete) {
  auto e = backend_->create_event();
  ASSERT_TRUE(e.ok());
  auto q = backend_->query(*e);
  ASSERT_TRUE(q.ok());
  EXPECT_TRUE(q.value());
  EXPECT_TRUE(backend_->wait(stream_, *e).ok());
  EXPECT_TRUE(backend_->synchronize(stream_).ok());
  backend_->destroy_event(*e);
}

// ---------------------------------------------------------------- memory
TEST_P(DeviceTest, BudgetExceededSaysAskedAndLeftAndLeaksNothing) {
  auto small = make_backend(GetParam(), 8ull << 20);
  ASSERT_TRUE(small.ok());
  DeviceBackend& b = *small.value();
  auto a = b.alloc(6ull << 20);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  auto over = b.alloc(4ull << 20);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kOutOfBudget);
  const std::string& msg = over.status().message();
  EXPECT_NE(msg.find("asked 4.0 MiB (4194304 bytes)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("left 2.0 MiB (2097152 bytes)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("budget 8.0 MiB"), std::string::npos) << msg;
  DeviceMemoryStats st = b.memory_stats();
  EXPECT_EQ(st.in_use, 6ull << 20);
  EXPECT_EQ(st.reserved, 6ull << 20);
  EXPECT_EQ(st.live_blocks, 1u);

  // Once freed, the cached 6 MiB block is given back to make room.
  ASSERT_TRUE(b.free(a.value()).ok());
  auto again = b.alloc(4ull << 20);
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  ASSERT_TRUE(b.free(again.value()).ok());
  EXPECT_EQ(b.free(again.value()).code(), StatusCode::kInvalidArgument);  // double free is refused

  // Steady state: the same sizes again make no new device allocations.
  const uint64_t slabs = b.memory_stats().slab_allocs;
  for (int i = 0; i < 100; ++i) {
    auto x = b.alloc(4ull << 20);
    auto y = b.alloc(1000);
    ASSERT_TRUE(x.ok() && y.ok());
    ASSERT_TRUE(b.free(x.value()).ok());
    ASSERT_TRUE(b.free(y.value()).ok());
  }
  EXPECT_LE(b.memory_stats().slab_allocs, slabs + 1);
  b.trim();
  st = b.memory_stats();
  EXPECT_EQ(st.in_use, 0u);
  EXPECT_EQ(st.reserved, 0u);
  EXPECT_EQ(st.slab_allocs, st.slab_frees);
  EXPECT_LE(st.peak_reserved, 8ull << 20);
}

TEST_P(DeviceTest, StreamOrderedFreeIsReusedOnlyAfterTheStream) {
  void* p = backend_->alloc(1 << 20).value();
  std::atomic<bool> release{false};
  ASSERT_TRUE(backend_
                  ->host_func_async(stream_,
                                    [&] {
                                      while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
                                      return Status();
                                    })
                  .ok());
  ASSERT_TRUE(backend_->free(p, stream_).ok());
  EXPECT_GT(backend_->memory_stats().pending, 0u);
  auto q = backend_->alloc(1 << 20);
  ASSERT_TRUE(q.ok());
  EXPECT_NE(q.value(), p) << "a block freed on a busy stream was handed out again";
  release = true;
  ASSERT_TRUE(backend_->synchronize(stream_).ok());
  auto r = backend_->alloc(1 << 20);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.value(), p) << "the block should be reused once the stream passed the free";
  ASSERT_TRUE(backend_->free(q.value()).ok());
  ASSERT_TRUE(backend_->free(r.value()).ok());
}

TEST_P(DeviceTest, BudgetPressureWaitsForStreamOrderedFrees) {
  auto small = make_backend(GetParam(), 4ull << 20);
  ASSERT_TRUE(small.ok());
  DeviceBackend& b = *small.value();
  auto s = b.create_stream("slow");
  ASSERT_TRUE(s.ok());
  auto p = b.alloc(3ull << 20);
  ASSERT_TRUE(p.ok());
  std::atomic<bool> done{false};
  ASSERT_TRUE(b.host_func_async(*s, [&] {
                 std::this_thread::sleep_for(std::chrono::milliseconds(30));
                 done = true;
                 return Status();
               }).ok());
  ASSERT_TRUE(b.free(p.value(), *s).ok());
  // Only the pending block can make room: the allocator must wait for it
  // rather than fail or hand it out early.
  auto q = b.alloc(2ull << 20);
  ASSERT_TRUE(q.ok()) << q.status().to_string();
  EXPECT_TRUE(done.load()) << "a block freed on a busy stream was reused before the stream passed the free";
  ASSERT_TRUE(b.free(q.value()).ok());
  EXPECT_TRUE(b.destroy_stream(*s).ok());
}

// Several threads, each with its own stream, allocating, computing and
// freeing stream-ordered at once: the allocator and the stream machinery
// under contention (run under ThreadSanitizer too).
TEST_P(DeviceTest, ConcurrentCallersOnOwnStreams) {
  constexpr int kThreadsN = 4, kIters = 40;
  constexpr std::size_t n = 4096;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreadsN; ++t) {
    threads.emplace_back([&, t] {
      auto s = backend_->create_stream("worker" + std::to_string(t));
      if (!s.ok()) {
        failures++;
        return;
      }
      auto h = backend_->alloc_pinned(n * 4);
      if (!h.ok()) {
        failures++;
        return;
      }
      auto* hf = static_cast<float*>(h->ptr);
      for (int i = 0; i < kIters; ++i) {
        auto d = backend_->alloc(n * 4 + static_cast<std::size_t>(i % 3) * 1000);
        if (!d.ok()) {
          failures++;
          break;
        }
        auto* df = static_cast<float*>(d.value());
        for (std::size_t j = 0; j < n; ++j) hf[j] = static_cast<float>(t * 1000 + i);
        bool ok = backend_->copy_async(df, hf, n * 4, CopyKind::kHostToDevice, *s).ok() &&
                  backend_->scale_async(df, DType::kF32, n, 2.0f, *s).ok() &&
                  backend_->copy_async(hf, df, n * 4, CopyKind::kDeviceToHost, *s).ok() &&
                  backend_->free(df, *s).ok() && backend_->synchronize(*s).ok();
        for (std::size_t j = 0; ok && j < n; ++j) ok = hf[j] == 2.0f * static_cast<float>(t * 1000 + i);
        if (!ok) failures++;
      }
      backend_->free_pinned(h.value());
      if (!backend_->destroy_stream(*s).ok()) failures++;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}

// ---------------------------------------------------------------- errors
TEST_P(DeviceTest, ErrorInsideAStreamSurfacesAtSynchronize) {
  auto s = backend_->create_stream("failing");
  ASSERT_TRUE(s.ok());
  std::atomic<int> ran_after{0};
  ASSERT_TRUE(backend_->host_func_async(*s, [] { return Status(StatusCode::kIoError, "injected failure"); }).ok());
  auto ev = backend_->create_event();
  ASSERT_TRUE(ev.ok());
  ASSERT_TRUE(backend_->record(*ev, *s).ok());
  ASSERT_TRUE(backend_
                  ->host_func_async(*s,
                                    [&] {
                                      ran_after++;
                                      return Status();
                                    })
                  .ok());
  Status st = backend_->synchronize(*s);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_NE(st.message().find("injected failure"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("failing"), std::string::npos) << "names the stream: " << st.message();
  EXPECT_FALSE(backend_->query(*s).ok());  // sticky
  if (is_host()) {
    EXPECT_EQ(ran_after.load(), 0) << "a failed stream skips its later work";
    EXPECT_EQ(backend_->synchronize(*ev).code(), StatusCode::kIoError);
    // A stream that waits on the failed point fails too.
    ASSERT_TRUE(backend_->wait(stream_, *ev).ok());
    Status w = backend_->synchronize(stream_);
    EXPECT_EQ(w.code(), StatusCode::kIoError);
    EXPECT_NE(w.message().find("injected failure"), std::string::npos) << w.message();
    // Replace the poisoned test stream for TearDown.
    EXPECT_FALSE(backend_->destroy_stream(stream_).ok());
    stream_ = backend_->create_stream("test").value();
  }
  backend_->destroy_event(*ev);
  EXPECT_EQ(backend_->destroy_stream(*s).code(), StatusCode::kIoError);
}

TEST_P(DeviceTest, DestroyingWithQueuedWorkDrains) {
  auto b = make_backend(GetParam(), 16ull << 20);
  ASSERT_TRUE(b.ok());
  std::atomic<int> ran{0};
  {
    std::unique_ptr<DeviceBackend> backend = std::move(b).value();
    auto s1 = backend->create_stream("one");
    auto s2 = backend->create_stream("two");
    ASSERT_TRUE(s1.ok() && s2.ok());
    auto e = backend->create_event();
    ASSERT_TRUE(e.ok());
    void* d = backend->alloc(1 << 20).value();
    for (int i = 0; i < 20; ++i) {
      ASSERT_TRUE(backend
                      ->host_func_async(*s1,
                                        [&] {
                                          std::this_thread::sleep_for(std::chrono::milliseconds(1));
                                          ran++;
                                          return Status();
                                        })
                      .ok());
      ASSERT_TRUE(backend->fill_zero_async(d, 1 << 20, *s1).ok());
    }
    ASSERT_TRUE(backend->record(*e, *s1).ok());
    ASSERT_TRUE(backend->wait(*s2, *e).ok());
    ASSERT_TRUE(backend
                    ->host_func_async(*s2,
                                      [&] {
                                        ran += 100;
                                        return Status();
                                      })
                    .ok());
    ASSERT_TRUE(backend->free(d, *s2).ok());
    // One stream destroyed explicitly with work queued, the rest by the backend.
    EXPECT_TRUE(backend->destroy_stream(*s1).ok());
    EXPECT_GE(ran.load(), 20);
  }
  EXPECT_EQ(ran.load(), 120);
}

TEST_P(DeviceTest, HostBackendChecksDeviceRanges) {
  if (!is_host()) GTEST_SKIP() << "only the host backend validates device pointers";
  void* d = dev_alloc(4096);
  std::vector<uint8_t> host(8192);
  EXPECT_EQ(backend_->copy_async(host.data(), d, 4096, CopyKind::kHostToDevice, stream_).code(),
            StatusCode::kInvalidArgument);
  Status over = backend_->copy_async(d, host.data(), 4097, CopyKind::kHostToDevice, stream_);
  EXPECT_EQ(over.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(over.message().find("4097 bytes"), std::string::npos) << over.message();
  EXPECT_EQ(backend_->cast_async(d, DType::kBF16, d, DType::kF32, 16, 1.0f, stream_).code(),
            StatusCode::kInvalidArgument);
  auto other = make_backend("host", 1 << 20);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other.value()->synchronize(stream_).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(backend_->synchronize(stream_).ok());
}

TEST_P(DeviceTest, NewHostMemoryIsPoisonedWithNaN) {
  if (!is_host()) GTEST_SKIP() << "only the host backend fills new memory";
  auto b = make_backend("host", 1 << 20);
  ASSERT_TRUE(b.ok());
  auto p = b.value()->alloc(64);
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(std::isnan(*static_cast<float*>(p.value())));
  ASSERT_TRUE(b.value()->free(p.value()).ok());
}

INSTANTIATE_TEST_SUITE_P(Backend, DeviceTest, ::testing::Values(std::string(STRATA_TEST_DEVICE_KIND)),
                         [](const auto& info) { return info.param; });

// ---------------------------------------------------------------- no backend
// ctest names must differ between the two programs: the suites below carry
// the program's kind, and the backend-free ones run in the host program only.
#if STRATA_TEST_DEVICE_IS_CUDA
#define STRATA_FACTORY_SUITE DeviceFactoryCudaProgram
#else
#define STRATA_FACTORY_SUITE DeviceFactory

TEST(DeviceMath, Bf16MatchesIndependentReferenceOnStridedPatterns) {
  // Every 251st bit pattern (about 17 million) plus its neighbours: all
  // exponents, both signs, all the rounding cases.
  for (uint64_t u = 0; u <= 0xffffffffull; u += 251) {
    for (uint64_t k = u; k < u + 2 && k <= 0xffffffffull; ++k) {
      const float f = float_of(static_cast<uint32_t>(k));
      ASSERT_EQ(dm::f32_to_bf16(f), ref_f32_to_bf16(f)) << hex(static_cast<uint32_t>(k));
    }
  }
}

TEST(DeviceMath, SizeClassesWasteAtMostAQuarter) {
  for (std::size_t n : {std::size_t{1}, std::size_t{1000}, std::size_t{1025}, std::size_t{4097}, std::size_t{1} << 20,
                        (std::size_t{1} << 20) + 1, std::size_t{100} << 20, (std::size_t{64} << 20) + 1}) {
    const std::size_t c = CachingAllocator::size_class(n);
    EXPECT_GE(c, n);
    EXPECT_EQ(c % 256, 0u) << n;
    if (n > 1024) {
      EXPECT_LE(c, n + n / 4) << n;
    }
  }
}

#endif  // !STRATA_TEST_DEVICE_IS_CUDA

TEST(STRATA_FACTORY_SUITE, HostIsAlwaysAvailable) {
  DeviceBackendOptions o;
  o.kind = DeviceBackendKind::kHost;
  auto b = create_device_backend(o);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ(b.value()->kind(), DeviceKind::kHost);
  EXPECT_EQ(b.value()->name(), "host");
  EXPECT_EQ(b.value()->host_registrar(), nullptr);
}

TEST(STRATA_FACTORY_SUITE, AutoPicksABackendAndCudaSaysWhyNot) {
  DeviceBackendOptions o;
  auto b = create_device_backend(o);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  o.kind = DeviceBackendKind::kCuda;
  auto c = create_device_backend(o);
  if (b.value()->kind() == DeviceKind::kHost) {
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), StatusCode::kUnavailable);
    EXPECT_FALSE(c.status().message().empty());
  } else {
    EXPECT_TRUE(c.ok()) << c.status().to_string();
  }
  EXPECT_EQ(parse_device_backend_kind("gpu").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(parse_device_backend_kind("host").value(), DeviceBackendKind::kHost);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// The module return codes decoded (pure: runs without a GPU). A sticky error
// is not "internal": it says the context is lost and not to retry.
TEST(CudaModuleStatus, StickyErrorsSayTheContextIsLost) {
  const Status illegal = cuda_module_status(700, "cudaStreamSynchronize: an illegal memory access", "cuda: sync");
  EXPECT_EQ(illegal.code(), StatusCode::kUnavailable);
  EXPECT_NE(illegal.message().find("context is lost"), std::string::npos) << illegal.message();
  EXPECT_NE(illegal.message().find("illegal memory access"), std::string::npos);
  EXPECT_EQ(cuda_module_status(719, "", "x").code(), StatusCode::kUnavailable);  // launch failure
  // Hopper's error containment, a terminated MPS client, an external device's error.
  for (int rc : {226, 810, 911}) EXPECT_EQ(cuda_module_status(rc, "", "x").code(), StatusCode::kUnavailable) << rc;
  EXPECT_EQ(cuda_module_status(600, "", "x").code(), StatusCode::kInternal);  // not ready: never fatal
  EXPECT_EQ(cuda_module_status(2, "out of memory", "x").code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(cuda_module_status(1, "invalid value", "x").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda_module_status(999, "", "x").code(), StatusCode::kInternal);
  EXPECT_NE(cuda_module_status(999, "", "x").message().find("error 999"), std::string::npos);
}

}  // namespace
}  // namespace strata
