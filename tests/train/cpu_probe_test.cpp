// probe_cpu_compute (train/cpu_probe.h), the measured compute rate of
// `strata plan --device cpu`: it runs the model's shape when that fits, fewer
// tokens before a narrower model when it does not, puts the micro-batch
// together from the parts it timed, and refuses what it cannot run.
#include <gtest/gtest.h>

#include "small_model.h"
#include "train/cpu_probe.h"

namespace strata::train {
namespace {

LlamaDims probe_dims() {
  LlamaDims d = testing::small_dims(/*ffn_dim=*/256, /*vocab=*/1024, /*tied=*/false);
  d.dim = 128;
  d.heads = 8;
  d.kv_heads = 2;
  d.head_dim = 16;
  return d;
}

TEST(CpuProbe, RunsTheModelsShapeAndAddsUpTheMicroBatch) {
  const LlamaDims d = probe_dims();
  auto p = probe_cpu_compute(d, /*layers=*/3, DType::kF32, /*batch=*/2, /*seq=*/48, {.threads = 1, .reps = 1});
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->scale, 1);
  EXPECT_EQ(p->batch, 2);
  EXPECT_EQ(p->seq, 48);
  EXPECT_EQ(p->dims.dim, d.dim);
  EXPECT_EQ(p->dims.ffn_dim, d.ffn_dim);
  EXPECT_EQ(p->dims.vocab, d.vocab);
  EXPECT_GT(p->layer_forward_s, 0);
  EXPECT_GT(p->layer_backward_s, 0);
  EXPECT_GT(p->head_s, 0);
  EXPECT_GT(p->embed_s, 0);
  EXPECT_DOUBLE_EQ(p->micro_batch_s, 3 * (p->layer_forward_s + p->layer_backward_s) + p->head_s + p->embed_s);
  EXPECT_NE(p->description().find("dim 128, batch 2 x seq 48: layer forward"), std::string::npos)
      << p->description();
}

TEST(CpuProbe, HalfPrecisionWeightsAndTiedHeadsRun) {
  LlamaDims d = probe_dims();
  d.tied = true;
  for (DType dt : {DType::kBF16, DType::kF16}) {
    auto p = probe_cpu_compute(d, 2, dt, 1, 32, {.threads = 1, .reps = 1});
    ASSERT_TRUE(p.ok()) << dtype_name(dt) << ": " << p.status().to_string();
    EXPECT_GT(p->micro_batch_s, 0);
  }
}

TEST(CpuProbe, AFrozenModelRunsWithoutWeightGradients) {
  const LlamaDims d = probe_dims();
  auto p = probe_cpu_compute(d, 2, DType::kBF16, 2, 32, {.threads = 1, .reps = 1, .frozen = true});
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_GT(p->layer_backward_s, 0);
  EXPECT_DOUBLE_EQ(p->micro_batch_s, 2 * (p->layer_forward_s + p->layer_backward_s) + p->head_s + p->embed_s);
  // LoRA: a frozen bf16 base with fp32 adapters on every projection; the
  // rank survives narrowing.
  LlamaDims lora = d;
  lora.lora_targets = kAllLoraTargets;
  lora.lora_rank = 4;
  lora.lora_scaling = 2;
  p = probe_cpu_compute(lora, 2, DType::kBF16, 2, 32, {.threads = 1, .reps = 1, .frozen = true});
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_GT(p->layer_backward_s, 0);
  p = probe_cpu_compute(lora, 2, DType::kBF16, 4, 1024, {.threads = 1, .max_bytes = 6 << 20, .reps = 1, .frozen = true});
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_GT(p->scale, 1);
  EXPECT_EQ(p->dims.lora_rank, 4);
  EXPECT_EQ(p->dims.lora_targets, kAllLoraTargets);
}

TEST(CpuProbe, FewerTokensBeforeANarrowerModel) {
  const LlamaDims d = probe_dims();
  // Too many FLOPs at batch 4 x seq 1024, few enough at 1 x 256: the model's
  // width is kept.
  auto p = probe_cpu_compute(d, 2, DType::kF32, 4, 1024, {.threads = 1, .max_flops = 1e9, .reps = 1});
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->scale, 1);
  EXPECT_EQ(p->batch, 1);
  EXPECT_EQ(p->seq, 256);
  // Too many bytes even then: every width divided by the same power of two,
  // head_dim and the GQA ratio kept.
  p = probe_cpu_compute(d, 2, DType::kF32, 4, 1024, {.threads = 1, .max_bytes = 6 << 20, .reps = 1});
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  ASSERT_GT(p->scale, 1);
  EXPECT_EQ(p->batch, 1);
  EXPECT_EQ(p->seq, 256);
  EXPECT_EQ(p->dims.dim * p->scale, d.dim);
  EXPECT_EQ(p->dims.heads * p->scale, d.heads);
  EXPECT_EQ(p->dims.kv_heads * p->scale, d.kv_heads);
  EXPECT_EQ(p->dims.ffn_dim * p->scale, d.ffn_dim);
  EXPECT_EQ(p->dims.vocab * p->scale, d.vocab);
  EXPECT_EQ(p->dims.head_dim, d.head_dim);
  EXPECT_NE(p->description().find("(the model's / " + std::to_string(p->scale) + ")"), std::string::npos)
      << p->description();
  // A short sequence is not cut below itself, and past the FLOP budget alone
  // the narrowest model runs.
  p = probe_cpu_compute(d, 2, DType::kF32, 8, 100, {.threads = 1, .max_flops = 1, .reps = 1});
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->batch, 1);
  EXPECT_EQ(p->seq, 100);
  EXPECT_EQ(p->dims.kv_heads, 1);
}

TEST(CpuProbe, RefusesWhatItCannotRun) {
  LlamaDims d = probe_dims();
  d.kv_heads = 1;  // one kv head: no narrower model keeps the GQA ratio
  d.heads = 8;
  auto p = probe_cpu_compute(d, 2, DType::kF32, 1, 256, {.threads = 1, .max_bytes = 1 << 16, .reps = 1});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(p.status().message().find("cannot be narrowed"), std::string::npos) << p.status().to_string();

  d = probe_dims();
  EXPECT_EQ(probe_cpu_compute(d, 0, DType::kF32, 1, 16, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(probe_cpu_compute(d, 1, DType::kF32, 0, 16, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(probe_cpu_compute(d, 1, DType::kU8, 1, 16, {}).status().code(), StatusCode::kInvalidArgument);
  LlamaDims bad = d;
  bad.heads = 3;  // not a multiple of kv_heads
  EXPECT_EQ(probe_cpu_compute(bad, 1, DType::kF32, 1, 16, {}).status().code(), StatusCode::kInvalidArgument);
  LlamaDims lora = d;
  lora.lora_targets = 1;
  lora.lora_rank = 0;  // targets without a rank
  EXPECT_EQ(probe_cpu_compute(lora, 1, DType::kF32, 1, 16, {}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::train
