// The CPU ops against an independent PyTorch Llama (tests/train/
// torch_reference.py, written from Hugging Face's modeling_llama.py): logits,
// loss and every parameter's gradient of a small random 2-layer model with
// grouped-query attention, masked targets, tied and untied embeddings.
// Skips, saying why, when no Python with torch is configured
// (STRATA_TEST_PYTHON, /tmp/torchvenv/bin/python or python3).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "small_model.h"
#include "test_util/reference_python.h"
#include "train/model_ops.h"

namespace strata::train {
namespace {

using testing::DeviceCopy;
using testing::HostModel;
using testing::StepResult;

std::string temp_dir() {
  const char* d = std::getenv("STRATA_TEST_DIR");
  return d && *d ? d : "/tmp";
}

template <typename T>
void put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}
template <typename T>
void put_vec(std::string& out, const std::vector<T>& v) {
  out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// Max |a - b| over the tensor, relative to max |b|.
double rel_err(const float* a, const float* b, size_t n) {
  double md = 0, mx = 0;
  for (size_t i = 0; i < n; ++i) {
    md = std::max(md, std::abs(static_cast<double>(a[i]) - b[i]));
    mx = std::max(mx, std::abs(static_cast<double>(b[i])));
  }
  return mx > 0 ? md / mx : md;
}

class OpsVsTorch : public ::testing::TestWithParam<bool> {};

TEST_P(OpsVsTorch, LogitsLossAndGradients) {
  const std::string python = STRATA_OPS_TORCH_PYTHON;
  if (python.empty())
    STRATA_REFERENCE_MISSING("no Python that can import torch was found at configure time "
                             "(set STRATA_TEST_PYTHON, or install torch for python3)");
  if (std::system((python + " -c 'import torch' >/dev/null 2>&1").c_str()) != 0)
    STRATA_REFERENCE_MISSING(python + " cannot import torch");

  const bool tied = GetParam();
  const LlamaDims d = testing::small_dims(/*ffn_dim=*/160, /*vocab=*/97, tied);
  const int64_t layers = 2, B = 2, T = 24, n = B * T;
  std::mt19937_64 rng(tied ? 31 : 32);
  HostModel m;
  m.init(rng, d, layers, 0.15);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(d.vocab - 1));
  std::vector<int32_t> tokens(n), targets(n);
  std::vector<uint8_t> mask(n);
  for (int64_t i = 0; i < n; ++i) {
    tokens[i] = tok(rng);
    targets[i] = i % 9 == 4 ? -100 : tok(rng);
    mask[i] = i % 13 == 7 ? 0 : 1;
  }

  auto ops_r = create_cpu_ops({.dims = d, .max_batch = B, .max_seq = T});
  ASSERT_TRUE(ops_r.ok()) << ops_r.status().to_string();
  DeviceCopy w;
  w.make(m, DType::kF32);
  StepResult ours;
  testing::run_step(**ops_r, m, w, tokens, targets, mask.data(), B, T, &ours);

  // The reference.
  std::string in = "STRATAOPS1";
  for (int64_t v : {d.dim, d.heads, d.kv_heads, d.head_dim, d.ffn_dim, d.vocab, layers, B, T,
                    static_cast<int64_t>(tied)})
    put(in, v);
  put(in, d.rms_eps);
  put(in, d.rope_theta);
  put_vec(in, tokens);
  put_vec(in, targets);
  put_vec(in, mask);
  for (const auto* t : m.tensors()) put_vec(in, *t);
  const std::string base = temp_dir() + "/strata_ops_torch_" + std::to_string(getpid()) +
                           (tied ? "_tied" : "_untied");
  const std::string in_path = base + ".in", out_path = base + ".out";
  {
    std::ofstream f(in_path, std::ios::binary);
    f.write(in.data(), static_cast<std::streamsize>(in.size()));
    ASSERT_TRUE(f.good()) << "writing " << in_path;
  }
  const std::string cmd = python + " " + STRATA_OPS_TORCH_SCRIPT + " " + in_path + " " + out_path;
  const int rc = std::system(cmd.c_str());
  std::ifstream f(out_path, std::ios::binary);
  std::string out((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::remove(in_path.c_str());
  std::remove(out_path.c_str());
  ASSERT_EQ(rc, 0) << cmd;

  size_t expect = 16 + n * d.vocab * 4;
  for (const auto* t : m.tensors()) expect += t->size() * 4;
  ASSERT_EQ(out.size(), expect) << "reference output size";
  double ref_loss;
  int64_t ref_count;
  std::memcpy(&ref_loss, out.data(), 8);
  std::memcpy(&ref_count, out.data() + 8, 8);
  const float* p = reinterpret_cast<const float*>(out.data() + 16);

  // Tolerances: both sides compute in fp32 (different summation orders,
  // torch's own exp/cos); measured differences are ~1e-6 relative, the
  // bounds leave 10-50x margin while a wrong term (a missing rotation, a
  // mis-grouped kv head, an unmasked target) is an O(1e-1..1) difference.
  EXPECT_EQ(ours.loss.count, ref_count);
  EXPECT_NEAR(ours.loss.mean(), ref_loss, 2e-5 * std::max(1.0, std::abs(ref_loss)));
  const double logit_err = rel_err(ours.logits.data(), p, ours.logits.size());
  EXPECT_LT(logit_err, 5e-5) << "logits";
  p += ours.logits.size();
  const auto tensors = m.tensors();
  std::printf("torch reference (%s): loss ours %.9f torch %.9f; logits rel err %.2e\n",
              tied ? "tied" : "untied", ours.loss.mean(), ref_loss, logit_err);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t sz = tensors[i]->size();
    const double e = rel_err(ours.grads[i].data(), p, sz);
    const std::string name = m.tensor_name(i);
    std::printf("  grad %-46s rel err %.2e\n", name.c_str(), e);
    EXPECT_LT(e, 2e-4) << name;
    p += sz;
  }
}

INSTANTIATE_TEST_SUITE_P(Tied, OpsVsTorch, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "tied" : "untied"; });

}  // namespace
}  // namespace strata::train
