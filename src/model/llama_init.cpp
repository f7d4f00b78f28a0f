#include "model/llama_init.h"

#include <cmath>
#include <vector>

#include "model/llama_weights.h"

namespace strata::model {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

}  // namespace

float init_normal(uint64_t seed, uint64_t stream, uint64_t i) {
  // One Box-Muller pair per two elements: even i takes the cosine, odd the sine.
  const uint64_t pair = i >> 1;
  const uint64_t key = splitmix64(splitmix64(seed) ^ stream);
  const uint64_t a = splitmix64(key ^ splitmix64(2 * pair));
  const uint64_t b = splitmix64(key ^ splitmix64(2 * pair + 1));
  const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]: log is finite
  const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;          // [0, 1)
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double t = 6.283185307179586476925 * u2;
  return static_cast<float>((i & 1) ? r * std::sin(t) : r * std::cos(t));
}

bool is_norm_weight(std::string_view name) {
  for (const WeightRow& r : kModelWeights)
    if (r.norm && name == r.name) return true;
  // A layer row's name follows "model.layers.<i>.".
  for (const WeightRow& r : kLayerWeights)
    if (r.norm && name.size() > r.name.size() && name.ends_with(r.name) && name[name.size() - r.name.size() - 1] == '.')
      return true;
  return false;
}

void llama_init_values(std::string_view name, uint64_t seed, double stddev, uint64_t begin, uint64_t count,
                       float* out) {
  if (is_norm_weight(name)) {
    for (uint64_t k = 0; k < count; ++k) out[k] = 1.0f;
    return;
  }
  const uint64_t stream = fnv1a(name);
  for (uint64_t k = 0; k < count; ++k)
    out[k] = static_cast<float>(stddev * static_cast<double>(init_normal(seed, stream, begin + k)));
}

Status write_random_llama(const std::string& dir, const LlamaConfig& config, StDType dtype, uint64_t seed,
                          uint64_t max_shard_bytes, const std::atomic<bool>* stop) {
  STRATA_RETURN_IF_ERROR(validate_llama_config(config));
  if (!to_dtype(dtype))
    return Status(StatusCode::kInvalidArgument,
                  std::string("random init writes F32, BF16 or F16, not ") + st_dtype_name(dtype));
  auto decls = llama_tensor_decls(config, dtype);
  STRATA_ASSIGN_OR_RETURN(auto w, ShardedWriter::create(dir, decls, max_shard_bytes));
  constexpr uint64_t kChunk = 1u << 20;
  std::vector<float> buf;
  for (const auto& d : decls) {
    const uint64_t n = d.numel();
    buf.resize(std::min(n, kChunk));
    for (uint64_t at = 0; at < n; at += kChunk) {
      const uint64_t c = std::min(kChunk, n - at);
      if (stop != nullptr && stop->load(std::memory_order_relaxed))
        return Status(StatusCode::kCancelled, "interrupted (a stop signal) while writing the weights into " + dir);
      llama_init_values(d.name, seed, config.initializer_range, at, c, buf.data());
      STRATA_RETURN_IF_ERROR(w->write_from(DType::kF32, buf.data(), c));
    }
  }
  STRATA_RETURN_IF_ERROR(w->finish());
  return save_llama_config(config, dir + "/config.json");
}

}  // namespace strata::model
