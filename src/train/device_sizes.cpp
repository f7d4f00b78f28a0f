#include "train/device_sizes.h"

#include <algorithm>
#include <map>
#include <string>

#include "model/llama_weights.h"

namespace strata::train {

DeviceSizes trainer_device_sizes(const ModelSpec& spec, uint64_t dim, uint32_t layers, bool tied, uint64_t tokens,
                                 uint32_t prefetch_depth) {
  DeviceSizes z;
  // The gradient buffer holds a group's trainable gradients only (frozen
  // tensors, a LoRA base, have none); the group buffers hold every compute copy.
  std::map<std::string, uint64_t> group_grad, group_bytes;
  uint64_t embed_grad = 0, largest = 0, largest_compute = 0;
  for (const ParamSpec& ps : spec.params) {
    const uint64_t b = group_bytes[ps.group] += ps.numel() * dtype_size(ps.compute_dtype);
    largest_compute = std::max(largest_compute, b);
    if (!ps.trainable) continue;
    largest = std::max(largest, group_grad[ps.group] += ps.numel());
    if (ps.name == weight_row(kEmbedTokens).name) embed_grad = ps.numel();
  }
  z.grad_buf_elems = largest;
  z.grad_bytes = (largest + (tied ? embed_grad : 0)) * sizeof(float);
  z.reserve_base = z.grad_bytes + (64ull << 20);
  const uint64_t act = tokens * dim * sizeof(float);
  const uint64_t tok = tokens * sizeof(int32_t);
  z.extra = pool_bytes(act * (uint64_t{layers} + 1)) + 2 * pool_bytes(act) + 2 * pool_bytes(tok);
  z.group_buffers = 2 * (uint64_t{prefetch_depth} + 2) * largest_compute;
  return z;
}

}  // namespace strata::train
