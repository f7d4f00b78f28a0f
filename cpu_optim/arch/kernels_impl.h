// The optimizer algorithms, written once over a vector-traits struct V that
// each arch/<isa>/kernels.cpp defines and then includes this file (compiled
// with that ISA's flags). Internal; freestanding (see types.h).
//
// Why one algorithm for all ISAs: every element goes through the same
// sequence of IEEE operations (mul, fma, sqrt, div: all correctly rounded,
// no reassociation; the library builds with -ffp-contract=off), so the
// scalar, AVX2, AVX-512 and NEON paths produce identical bits, and so does a
// tail element handled outside the main loop. That makes results independent
// of the ISA and of how elements are split among threads, and lets the tests
// compare every SIMD path bit for bit with the scalar one.
//
// V provides:
//   using F; static constexpr int W;           vector of W floats
//   set1, load/store for float/Bf16/F16, add, mul, div, sqrt,
//   store_rounded(Bf16*, F): store, returning the value as stored,
//   store_rounded_sr(Bf16*, F, uint32_t lo, uint32_t key): the same with
//     stochastic rounding, lane j taking rounding_bits(key, lo + j)
//     (stochastic_round.h; the hash vectorised on 32-bit integer lanes),
//   stream(Bf16*/F16*, F): non-temporal store to an aligned address (or a
//     plain store where the ISA has none), fence(): orders those stores,
//   fma(a, b, c) = a*b + c (one rounding), max(a, b) = a > b ? a : b,
//   sign(x) = +1/-1/0 (0 for NaN),
//   sumsq16(const T* g, size_t n, double lanes[16]): n a multiple of 16;
//     lanes[j] += sum of g[i]^2 over i % 16 == j, in increasing i.
#pragma once

#include "cpu_optim/arch/kernel_table.h"
#include "cpu_optim/numeric.h"
#include "cpu_optim/stochastic_round.h"

#ifndef STRATA_CPU_OPTIM_NS
#error "define STRATA_CPU_OPTIM_NS (the per-ISA namespace) before including kernels_impl.h"
#endif

#ifndef STRATA_ALWAYS_INLINE
#define STRATA_ALWAYS_INLINE __attribute__((always_inline))
#endif

namespace strata::cpu_optim::detail::STRATA_CPU_OPTIM_NS {

struct NoOut {};

template <class A, class B>
inline constexpr bool kSame = false;
template <class A>
inline constexpr bool kSame<A, A> = true;

// The element pointers of one vector, and its first element's index in the
// buffers (stochastic rounding hashes it).
template <class G, class S, class O>
struct Ptrs {
  float* p;
  const G* g;
  S* s0;
  S* s1;
  S* s2;
  O* out;
  size_t i;
  Ptrs at(size_t k) const {
    return {p + k, g + k, s0 ? s0 + k : nullptr, s1 ? s1 + k : nullptr, s2 ? s2 + k : nullptr,
            out ? out + k : nullptr, i + k};
  }
};

// params_out is written and not read: non-temporal stores skip the
// read-for-ownership of its cache lines (2 of ~22-32 bytes per parameter).
// Only full vectors at V::W-aligned indices of a 64-byte aligned buffer use
// them; tails go through the stack copy.
template <class V, class O>
STRATA_ALWAYS_INLINE inline void store_out(O* o, typename V::F x, bool stream) {
  if constexpr (!kSame<O, NoOut>) {
    if (stream) V::stream(o, x);
    else V::store(o, x);
  }
}

// How bf16 states are rounded, captured by value in the loop bodies.
struct RoundCtx {
  bool sr;
  uint32_t lo0;
  uint32_t key[3];
};
inline RoundCtx round_ctx(const StepArgs& a) {
  return {a.sr_states, a.sr_lo0, {a.sr_key[0], a.sr_key[1], a.sr_key[2]}};
}

// Stores state slot `k` of the vector at element index `i` and returns the
// value as stored: with bf16 states the next operation uses the rounded
// value, as PyTorch does with bf16 state tensors.
template <class V, int k, class S>
STRATA_ALWAYS_INLINE inline typename V::F store_state(S* s, typename V::F x, const RoundCtx& r, size_t i) {
  if constexpr (kSame<S, float>) {
    (void)r;
    (void)i;
    V::store(s, x);
    return x;
  } else {
    if (r.sr) return V::store_rounded_sr(s, x, r.lo0 + static_cast<uint32_t>(i), r.key[k]);
    return V::store_rounded(s, x);
  }
}

// Runs body over [begin, end): full vectors in place, the remainder through
// zero-padded stack copies, so the tail takes exactly the vector code path
// (body's second argument says which, for the choice of store only).
// Bodies capture their constants by value and everything is force-inlined so
// that the constants stay in registers: with a reference capture gcc reloads
// each from the stack on every vector, which costs load slots the streams need.
template <class V, class G, class S, class O, class Body>
STRATA_ALWAYS_INLINE inline void drive(const Ptrs<G, S, O>& P, size_t begin, size_t end, Body&& body) {
  constexpr size_t W = V::W;
  size_t i = begin;
  for (; i + W <= end; i += W) body(P.at(i), false);
  if (i == end) return;
  const size_t n = end - i;
  const Ptrs<G, S, O> Q = P.at(i);
  alignas(64) float p[W] = {};
  alignas(64) G g[W] = {};
  alignas(64) S s0[W] = {}, s1[W] = {}, s2[W] = {};
  alignas(64) O o[W] = {};
  for (size_t k = 0; k < n; ++k) {
    p[k] = Q.p[k];
    g[k] = Q.g[k];
    if (Q.s0) s0[k] = Q.s0[k];
    if (Q.s1) s1[k] = Q.s1[k];
    if (Q.s2) s2[k] = Q.s2[k];
  }
  body(Ptrs<G, S, O>{p, g, Q.s0 ? s0 : nullptr, Q.s1 ? s1 : nullptr, Q.s2 ? s2 : nullptr,
                     Q.out ? o : nullptr, Q.i},
       true);
  for (size_t k = 0; k < n; ++k) {
    Q.p[k] = p[k];
    if (Q.s0) Q.s0[k] = s0[k];
    if (Q.s1) Q.s1[k] = s1[k];
    if (Q.s2) Q.s2[k] = s2[k];
    if constexpr (!kSame<O, NoOut>) {
      if (Q.out) Q.out[k] = o[k];
    }
  }
}

template <class G, class S, class O>
inline Ptrs<G, S, O> ptrs(const StepArgs& a) {
  return {a.params,
          static_cast<const G*>(a.grads),
          static_cast<S*>(a.state[0]),
          static_cast<S*>(a.state[1]),
          static_cast<S*>(a.state[2]),
          kSame<O, NoOut> ? nullptr : static_cast<O*>(a.out),
          0};
}

// Adam / AdamW, following torch.optim.Adam(W)'s single-tensor formulas:
//   AdamW: p -= lr*wd*p            Adam: g += wd*p
//   m = b1*m + (1-b1)*g            v = b2*v + (1-b2)*g*g
//   amsgrad: vmax = max(vmax, v), used in place of v
//   p += -(lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)
template <class V, class G, class S, class O, bool kAms, bool kDecoupled>
void adam_range(const StepArgs& a, size_t begin, size_t end) {
  using F = typename V::F;
  const F scale = V::set1(a.grad_scale), wd = V::set1(a.weight_decay), nlrwd = V::set1(a.neg_lr_wd);
  const F b1 = V::set1(a.beta1), c1 = V::set1(a.one_minus_beta1);
  const F b2 = V::set1(a.beta2), c2 = V::set1(a.one_minus_beta2);
  const F eps = V::set1(a.eps), nstep = V::set1(a.neg_step_size), rsbc2 = V::set1(a.inv_sqrt_bc2);
  const bool l2 = a.l2, dwd = a.decoupled_wd;
  const bool stream = a.stream_out && !kSame<O, NoOut>;
  const RoundCtx rnd = round_ctx(a);
  drive<V>(ptrs<G, S, O>(a), begin, end, [=](const Ptrs<G, S, O>& P, bool tail) STRATA_ALWAYS_INLINE {
    F g = V::mul(V::load(P.g), scale);
    F p = V::load(P.p);
    if constexpr (kDecoupled) {
      if (dwd) p = V::fma(nlrwd, p, p);
    } else {
      if (l2) g = V::fma(wd, p, g);
    }
    F m = store_state<V, 0>(P.s0, V::fma(b1, V::load(P.s0), V::mul(c1, g)), rnd, P.i);
    F v = store_state<V, 1>(P.s1, V::fma(V::mul(c2, g), g, V::mul(b2, V::load(P.s1))), rnd, P.i);
    if constexpr (kAms) v = store_state<V, 2>(P.s2, V::max(V::load(P.s2), v), rnd, P.i);
    F denom = V::fma(V::sqrt(v), rsbc2, eps);
    p = V::fma(nstep, V::div(m, denom), p);
    V::store(P.p, p);
    store_out<V>(P.out, p, stream && !tail);
  });
  if (stream) V::fence();  // order the non-temporal stores before the caller's next access
}

// Adagrad (torch.optim.Adagrad): g += wd*p; sum += g*g;
//   p += -(lr / (1 + (t-1)*lr_decay)) * g / (sqrt(sum) + eps)
template <class V, class G, class S, class O>
void adagrad_range(const StepArgs& a, size_t begin, size_t end) {
  using F = typename V::F;
  const F scale = V::set1(a.grad_scale), wd = V::set1(a.weight_decay);
  const F eps = V::set1(a.eps), nclr = V::set1(a.neg_step_size);
  const bool l2 = a.l2;
  const bool stream = a.stream_out && !kSame<O, NoOut>;
  const RoundCtx rnd = round_ctx(a);
  drive<V>(ptrs<G, S, O>(a), begin, end, [=](const Ptrs<G, S, O>& P, bool tail) STRATA_ALWAYS_INLINE {
    F g = V::mul(V::load(P.g), scale);
    F p = V::load(P.p);
    if (l2) g = V::fma(wd, p, g);
    F s = store_state<V, 0>(P.s0, V::fma(g, g, V::load(P.s0)), rnd, P.i);
    p = V::fma(nclr, V::div(g, V::add(V::sqrt(s), eps)), p);
    V::store(P.p, p);
    store_out<V>(P.out, p, stream && !tail);
  });
  if (stream) V::fence();  // order the non-temporal stores before the caller's next access
}

// Lion: p -= lr*wd*p; p += -lr * sign(b1*m + (1-b1)*g); m = b2*m + (1-b2)*g
template <class V, class G, class S, class O>
void lion_range(const StepArgs& a, size_t begin, size_t end) {
  using F = typename V::F;
  const F scale = V::set1(a.grad_scale), nlrwd = V::set1(a.neg_lr_wd);
  const F b1 = V::set1(a.beta1), c1 = V::set1(a.one_minus_beta1);
  const F b2 = V::set1(a.beta2), c2 = V::set1(a.one_minus_beta2);
  const F nlr = V::set1(a.neg_step_size);
  const bool dwd = a.decoupled_wd;
  const bool stream = a.stream_out && !kSame<O, NoOut>;
  const RoundCtx rnd = round_ctx(a);
  drive<V>(ptrs<G, S, O>(a), begin, end, [=](const Ptrs<G, S, O>& P, bool tail) STRATA_ALWAYS_INLINE {
    F g = V::mul(V::load(P.g), scale);
    F p = V::load(P.p);
    if (dwd) p = V::fma(nlrwd, p, p);
    F m = V::load(P.s0);
    F c = V::fma(b1, m, V::mul(c1, g));
    p = V::fma(nlr, V::sign(c), p);
    store_state<V, 0>(P.s0, V::fma(b2, m, V::mul(c2, g)), rnd, P.i);
    V::store(P.p, p);
    store_out<V>(P.out, p, stream && !tail);
  });
  if (stream) V::fence();  // order the non-temporal stores before the caller's next access
}

// SGD (torch.optim.SGD): g += wd*p; with momentum:
//   buf = (t == 1) ? g : momentum*buf + (1-dampening)*g
//   g = nesterov ? g + momentum*buf : buf
// then p += -lr * g
template <class V, class G, class S, class O>
void sgd_range(const StepArgs& a, size_t begin, size_t end) {
  using F = typename V::F;
  const F scale = V::set1(a.grad_scale), wd = V::set1(a.weight_decay);
  const F mom = V::set1(a.momentum), damp = V::set1(a.one_minus_dampening);
  const F nlr = V::set1(a.neg_step_size);
  const bool l2 = a.l2, has_mom = a.has_momentum, nesterov = a.nesterov, first = a.first_step;
  const bool stream = a.stream_out && !kSame<O, NoOut>;
  const RoundCtx rnd = round_ctx(a);
  drive<V>(ptrs<G, S, O>(a), begin, end, [=](const Ptrs<G, S, O>& P, bool tail) STRATA_ALWAYS_INLINE {
    F g = V::mul(V::load(P.g), scale);
    F p = V::load(P.p);
    if (l2) g = V::fma(wd, p, g);
    if (has_mom) {
      F buf = first ? g : V::fma(mom, V::load(P.s0), V::mul(damp, g));
      buf = store_state<V, 0>(P.s0, buf, rnd, P.i);
      g = nesterov ? V::fma(mom, buf, g) : buf;
    }
    p = V::fma(nlr, g, p);
    V::store(P.p, p);
    store_out<V>(P.out, p, stream && !tail);
  });
  if (stream) V::fence();  // order the non-temporal stores before the caller's next access
}

template <class G, class S, class O>
StepFn pick_kind(const StepArgs& a) {
  switch (a.kind) {
    case OptimizerKind::kAdamW:
      return a.amsgrad ? &adam_range<V, G, S, O, true, true> : &adam_range<V, G, S, O, false, true>;
    case OptimizerKind::kAdam:
      return a.amsgrad ? &adam_range<V, G, S, O, true, false> : &adam_range<V, G, S, O, false, false>;
    case OptimizerKind::kAdagrad:
      return &adagrad_range<V, G, S, O>;
    case OptimizerKind::kLion:
      return &lion_range<V, G, S, O>;
    case OptimizerKind::kSgd:
      return &sgd_range<V, G, S, O>;
  }
  return nullptr;
}

template <class G, class S>
StepFn pick_out(const StepArgs& a) {
  if (!a.out) return pick_kind<G, S, NoOut>(a);
  switch (a.out_dtype) {
    case DType::kBF16: return pick_kind<G, S, Bf16>(a);
    case DType::kF16: return pick_kind<G, S, F16>(a);
    case DType::kF32: return nullptr;
    case DType::kU8: case DType::kF64: case DType::kI32: case DType::kI64: return nullptr;  // storage only
  }
  return nullptr;
}

template <class G>
StepFn pick_state(const StepArgs& a) {
  switch (a.state_dtype) {
    case DType::kF32: return pick_out<G, float>(a);
    case DType::kBF16: return pick_out<G, Bf16>(a);
    case DType::kF16: return nullptr;  // fp16 moments underflow (v ~ g^2): not offered
    case DType::kU8: case DType::kF64: case DType::kI32: case DType::kI64: return nullptr;  // storage only
  }
  return nullptr;
}

inline StepFn select_step(const StepArgs& a) {
  switch (a.grad_dtype) {
    case DType::kF32: return pick_state<float>(a);
    case DType::kBF16: return pick_state<Bf16>(a);
    case DType::kF16: return pick_state<F16>(a);
    case DType::kU8: case DType::kF64: case DType::kI32: case DType::kI64: return nullptr;  // storage only
  }
  return nullptr;
}

// Fixed pairwise combination of the 16 lanes.
inline double combine16(double* lanes) {
  for (int step = 1; step < 16; step *= 2)
    for (int j = 0; j < 16; j += 2 * step) lanes[j] += lanes[j + step];
  return lanes[0];
}

template <class T>
double sumsq_range(const void* grads, size_t begin, size_t end) {
  const T* g = static_cast<const T*>(grads) + begin;
  const size_t n = end - begin;
  const size_t n16 = n / 16 * 16;
  double lanes[16] = {};
  V::sumsq16(g, n16, lanes);
  for (size_t i = n16; i < n; ++i) {
    double x = static_cast<double>(to_f32(g[i]));
    lanes[i % 16] += x * x;  // x*x is exact in double: same as the vector fma
  }
  return combine16(lanes);
}

// Accumulates in sub-ranges small enough to stay in L1, squaring each one
// right after writing it. The sub-ranges are multiples of 16 elements and
// sumsq16 adds into the lanes, so every lane sums its elements in the same
// order as one sumsq_range<float> over the whole range: the same bits.
template <class T>
double accumulate_range(float* dst, const void* src, size_t begin, size_t end, bool first) {
  constexpr size_t kSub = 2048;  // 8 KiB of fp32: a multiple of 16 and of every V::W
  const T* s = static_cast<const T*>(src);
  double lanes[16] = {};
  for (size_t lo = begin; lo < end; lo += kSub) {
    const size_t hi = end - lo < kSub ? end : lo + kSub;
    size_t i = lo;
    if (first) {
      for (; i + V::W <= hi; i += V::W) V::store(dst + i, V::load(s + i));
      for (; i < hi; ++i) dst[i] = to_f32(s[i]);
    } else {
      for (; i + V::W <= hi; i += V::W) V::store(dst + i, V::add(V::load(dst + i), V::load(s + i)));
      for (; i < hi; ++i) dst[i] = dst[i] + to_f32(s[i]);
    }
    const size_t n = hi - lo, n16 = n / 16 * 16;
    V::sumsq16(dst + lo, n16, lanes);
    for (size_t k = n16; k < n; ++k) {  // only in the last sub-range: the others are multiples of 16
      double x = static_cast<double>(dst[lo + k]);
      lanes[k % 16] += x * x;
    }
  }
  return combine16(lanes);
}

template <class T>
void convert_range(const float* src, void* dst, size_t begin, size_t end) {
  T* d = static_cast<T*>(dst);
  size_t i = begin;
  for (; i + V::W <= end; i += V::W) V::store(d + i, V::load(src + i));
  if (i == end) return;
  alignas(64) float s[V::W] = {};
  alignas(64) T t[V::W] = {};
  for (size_t k = 0; i + k < end; ++k) s[k] = src[i + k];
  V::store(t, V::load(s));
  for (size_t k = 0; i + k < end; ++k) d[i + k] = t[k];
}

inline void membw_range(float* b, const float* c, float s, size_t begin, size_t end) {
  const typename V::F sv = V::set1(s);
  size_t i = begin;
  for (; i + V::W <= end; i += V::W) V::store(b + i, V::fma(sv, V::load(c + i), V::load(b + i)));
  for (; i < end; ++i) b[i] = __builtin_fmaf(s, c[i], b[i]);
}

inline constexpr KernelTable make_table(const char* name) {
  return KernelTable{name,
                     &select_step,
                     {&sumsq_range<float>, &sumsq_range<Bf16>, &sumsq_range<F16>},
                     {&accumulate_range<float>, &accumulate_range<Bf16>, &accumulate_range<F16>},
                     {nullptr, &convert_range<Bf16>, &convert_range<F16>},
                     &membw_range};
}

}  // namespace strata::cpu_optim::detail::STRATA_CPU_OPTIM_NS
