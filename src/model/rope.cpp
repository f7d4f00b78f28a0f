#include "model/rope.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>

namespace strata::model {

const char* rope_type_name(RopeType t) {
  switch (t) {
    case RopeType::kDefault: return "default";
    case RopeType::kLinear: return "linear";
    case RopeType::kLlama3: return "llama3";
    case RopeType::kYarn: return "yarn";
  }
  return "?";
}

namespace {

// base ** (arange(0, dim, 2).float() / dim): the exponent is an fp32 division
// (as torch divides the fp32 arange), the power in double rounded to fp32.
std::vector<float> powers(double base, int64_t dim) {
  std::vector<float> p(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(dim);
    p[static_cast<size_t>(i)] = static_cast<float>(std::pow(base, static_cast<double>(e)));
  }
  return p;
}

// 1.0 / tensor: fp32.
std::vector<float> inverse(const std::vector<float>& p) {
  std::vector<float> r(p.size());
  for (size_t i = 0; i < p.size(); ++i) r[i] = 1.0f / p[i];
  return r;
}

double yarn_mscale(double scale, double mscale) {
  if (scale <= 1) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

}  // namespace

RopeFrequencies rope_frequencies(const RopeSettings& r, int64_t head_dim) {
  RopeFrequencies out;
  const int64_t dim = head_dim;
  const std::vector<float> pos = powers(r.theta, dim);
  std::vector<float> inv = inverse(pos);
  const float factor = static_cast<float>(r.factor);
  switch (r.type) {
    case RopeType::kDefault:
      break;
    case RopeType::kLinear:
      for (float& f : inv) f /= factor;  // inv_freq /= factor (fp32)
      break;
    case RopeType::kLlama3: {
      // Python floats (double) for the wavelengths' bounds, fp32 tensors for
      // the per-frequency values, as transformers mixes them.
      const double old = r.original_max_position_embeddings;
      // torch compares an fp32 tensor with a Python float in fp32.
      const float low_wavelen = static_cast<float>(old / r.low_freq_factor),
                  high_wavelen = static_cast<float>(old / r.high_freq_factor);
      const float two_pi = static_cast<float>(2 * std::numbers::pi);
      for (float& f : inv) {
        const float wavelen = two_pi / f;  // 2 * math.pi / inv_freq: fp32
        float llama = wavelen > low_wavelen ? f / factor : f;
        const float smooth = (static_cast<float>(old) / wavelen - static_cast<float>(r.low_freq_factor)) /
                             static_cast<float>(r.high_freq_factor - r.low_freq_factor);
        const float smoothed = (1.0f - smooth) * llama / factor + smooth * llama;
        const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
        f = medium ? smoothed : llama;
      }
      break;
    }
    case RopeType::kYarn: {
      double attention = 0;
      if (r.attention_factor) {
        attention = *r.attention_factor;
      } else if (r.mscale && r.mscale_all_dim && *r.mscale != 0 && *r.mscale_all_dim != 0) {
        attention = yarn_mscale(r.factor, *r.mscale) / yarn_mscale(r.factor, *r.mscale_all_dim);
      } else {
        attention = yarn_mscale(r.factor, 1.0);
      }
      out.attention_scaling = static_cast<float>(attention);
      const double pi = std::numbers::pi;
      auto correction_dim = [&](double rotations) {
        return (static_cast<double>(dim) * std::log(r.original_max_position_embeddings / (rotations * 2 * pi))) /
               (2 * std::log(r.theta));
      };
      double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
      if (r.truncate) low = std::floor(low), high = std::ceil(high);
      low = std::max(low, 0.0);
      high = std::min(high, static_cast<double>(dim - 1));
      if (low == high) high += 0.001;  // transformers' guard against a zero range
      for (size_t i = 0; i < inv.size(); ++i) {
        // linear_ramp_factor: (arange(dim//2, fp32) - min) / (max - min), clamped to [0, 1].
        float ramp = (static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(high - low);
        ramp = std::clamp(ramp, 0.0f, 1.0f);
        const float extrapolation_factor = 1.0f - ramp;
        const float extrapolation = 1.0f / pos[i];
        const float interpolation = 1.0f / (factor * pos[i]);
        inv[i] = interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
      }
      break;
    }
  }
  out.inv_freq = std::move(inv);
  return out;
}

std::string rope_describe(const RopeSettings& r) {
  switch (r.type) {
    case RopeType::kDefault: return fmt::format("default theta={}", r.theta);
    case RopeType::kLinear: return fmt::format("linear theta={} factor={}", r.theta, r.factor);
    case RopeType::kLlama3:
      return fmt::format("llama3 theta={} factor={} low_freq_factor={} high_freq_factor={} original={}", r.theta,
                         r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings);
    case RopeType::kYarn:
      return fmt::format("yarn theta={} factor={} original={} beta_fast={} beta_slow={}{}", r.theta, r.factor,
                         r.original_max_position_embeddings, r.beta_fast, r.beta_slow,
                         r.attention_factor ? fmt::format(" attention_factor={}", *r.attention_factor) : "");
  }
  return "?";
}

}  // namespace strata::model
