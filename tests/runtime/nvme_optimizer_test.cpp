// The pipelined optimizer step over NVMe-resident state (runtime/nvme_optimizer)
// against cpu_optim::step on the same data in RAM: bit-identical over several
// steps, odd sizes, mixed host/swap placement, fp32 and bf16 states, ring
// depths 2..4; I/O errors mid-step (fault injection), resuming a failed step,
// the step counter's guards, and a pool too small for the ring. Real files
// under STRATA_TEST_DIR (else /tmp): label nvme.
#include "runtime/nvme_optimizer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "io/fault_injection.h"
#include "test_util/temp_dir.h"

namespace strata {
namespace {

using cpu_optim::OptimizerConfig;

// A temp directory named for these tests (test_util/temp_dir.h).
class TempDir : public ::strata::testing::TempDir {
 public:
  explicit TempDir(const char* base = nullptr) : ::strata::testing::TempDir("strata-nvmeopt", base) {}
};

// One tensor held both ways: the reference in RAM and the tested placement.
struct Model {
  std::size_t count = 0;
  std::vector<float> master, grads;
  std::vector<std::vector<unsigned char>> state;  // raw bytes, state dtype
  std::vector<std::uint16_t> out;
  // Tested copies: host arrays (used when the placement is host) and swap tensors.
  std::vector<float> h_master, h_grads;
  std::vector<std::vector<unsigned char>> h_state;
  std::vector<std::uint16_t> h_out;
  io::SwapTensor s_master, s_grads, s_state[2], s_out;
  bool swap_master = true, swap_grads = true, swap_states = true, swap_out = true;
  std::string name;
  std::uint64_t first_index = 0;  // OptimizerTensor::first_index (a shard's offset)
};

class NvmeOptimizerTest : public ::testing::TestWithParam<std::tuple<DType, unsigned>> {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    faults_ = std::make_shared<io::FaultInjector>();
    io::IoEngineOptions eo;
    eo.backend = "";  // STRATA_IO_BACKEND picks one (CI runs each), else auto
    eo.block_bytes = 64 << 10;  // several pieces per chunk, so faults land mid-chunk
    eo.faults = faults_;
    auto e = io::make_io_engine(eo);
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    engine_ = std::move(e).value();
    io::SwapStoreOptions so;
    so.dirs = {dir_.path() + "/a", dir_.path() + "/b"};
    so.stripe_bytes = 64 << 10;
    auto s = io::SwapStore::create(*engine_, so);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    store_ = std::move(s).value();
    io::PinnedPoolOptions po;
    po.budget_bytes = 64 << 20;
    po.slab_bytes = 8 << 20;
    po.registrars = {engine_->buffer_registrar()};
    auto p = io::PinnedPool::create(po);
    ASSERT_TRUE(p.ok());
    pool_ = std::move(p).value();
    config_.weight_decay = 0.01;
    config_.lr = 1e-2;
  }
  void TearDown() override {
    if (store_) {
      EXPECT_TRUE(store_->close().ok());
    }
  }

  DType state_dtype() const { return std::get<0>(GetParam()); }
  unsigned depth() const { return std::get<1>(GetParam()); }
  std::size_t ssize() const { return dtype_size(state_dtype()); }

  void write_swap(const io::SwapTensor& t, const void* p, std::size_t bytes) {
    ASSERT_TRUE(store_->write(t, 0, bytes, p).wait().ok());
  }
  template <typename T>
  void read_swap(const io::SwapTensor& t, std::vector<T>* v) {
    ASSERT_TRUE(store_->read(t, 0, v->size() * sizeof(T), v->data()).wait().ok());
  }

  void add(const std::string& name, std::size_t n, bool swap_master, bool swap_grads, bool swap_states,
           bool swap_out) {
    Model m;
    m.name = name;
    m.count = n;
    m.swap_master = swap_master, m.swap_grads = swap_grads, m.swap_states = swap_states, m.swap_out = swap_out;
    std::normal_distribution<float> d(0.f, 1.f);
    m.master.resize(n);
    for (auto& x : m.master) x = d(rng_);
    m.grads.assign(n, 0.f);
    m.state.assign(2, std::vector<unsigned char>(n * ssize(), 0));
    m.out.assign(n, 0);
    m.h_master = m.master, m.h_grads = m.grads, m.h_state = m.state, m.h_out = m.out;
    auto add_t = [&](const char* what, std::size_t bytes) {
      auto t = store_->add_tensor(name + what, bytes);
      EXPECT_TRUE(t.ok());
      return *t;
    };
    m.s_master = add_t(".master", n * 4);
    m.s_grads = add_t(".grads", n * 4);
    for (int k = 0; k < 2; ++k) m.s_state[k] = add_t(".state", n * ssize());
    m.s_out = add_t(".out", n * 2);
    write_swap(m.s_master, m.master.data(), n * 4);
    for (int k = 0; k < 2; ++k) write_swap(m.s_state[k], m.state[k].data(), n * ssize());
    models_.push_back(std::move(m));
  }

  std::vector<OptimizerTensor> tensors() {
    std::vector<OptimizerTensor> ts;
    for (auto& m : models_) {
      OptimizerTensor t;
      t.name = m.name;
      t.count = m.count;
      t.master = m.swap_master ? Placement::in_swap(m.s_master) : Placement::in_host(m.h_master.data());
      t.grads = m.swap_grads ? Placement::in_swap(m.s_grads) : Placement::in_host(m.h_grads.data());
      for (int k = 0; k < 2; ++k)
        t.state[k] = m.swap_states ? Placement::in_swap(m.s_state[k]) : Placement::in_host(m.h_state[k].data());
      t.params_out = m.swap_out ? Placement::in_swap(m.s_out) : Placement::in_host(m.h_out.data());
      t.first_index = m.first_index;
      ts.push_back(t);
    }
    return ts;
  }

  // New gradients for the next step, in both copies.
  void new_grads() {
    std::normal_distribution<float> d(0.f, 0.1f);
    for (auto& m : models_) {
      for (auto& g : m.grads) g = d(rng_);
      m.h_grads = m.grads;
      write_swap(m.s_grads, m.grads.data(), m.count * 4);
    }
  }

  // The reference: cpu_optim::step on whole tensors in RAM; model i with
  // (*configs)[i] when given, else config_.
  void reference_step(std::int64_t t, const std::vector<OptimizerConfig>* configs = nullptr) {
    for (size_t i = 0; i < models_.size(); ++i) {
      Model& m = models_[i];
      cpu_optim::StepBuffers b;
      b.params = m.master.data();
      b.grads = m.grads.data();
      b.state[0] = m.state[0].data();
      b.state[1] = m.state[1].data();
      b.state_dtype = state_dtype();
      b.params_out = m.out.data();
      // bf16 states round stochastically by each element's global index:
      // whole tensors here, chunks in the optimizer.
      b.index_base = m.first_index;
      ASSERT_TRUE(cpu_optim::step(configs ? (*configs)[i] : config_, t, b, m.count).ok());
    }
  }

  void expect_identical(const char* when) {
    for (auto& m : models_) {
      std::vector<float> master(m.count);
      std::vector<std::uint16_t> out(m.count);
      std::vector<unsigned char> st(m.count * ssize());
      if (m.swap_master) read_swap(m.s_master, &master); else master = m.h_master;
      if (m.swap_out) read_swap(m.s_out, &out); else out = m.h_out;
      EXPECT_EQ(0, std::memcmp(master.data(), m.master.data(), m.count * 4)) << m.name << " master " << when;
      EXPECT_EQ(0, std::memcmp(out.data(), m.out.data(), m.count * 2)) << m.name << " params_out " << when;
      for (int k = 0; k < 2; ++k) {
        if (m.swap_states) read_swap(m.s_state[k], &st); else st = m.h_state[k];
        EXPECT_EQ(0, std::memcmp(st.data(), m.state[k].data(), st.size())) << m.name << " state" << k << " " << when;
      }
    }
  }

  Result<std::unique_ptr<NvmeOptimizer>> make(std::size_t chunk = 4096, DeviceOutput* device_out = nullptr) {
    NvmeOptimizerOptions o;
    o.chunk_elems = chunk;
    o.ring_buffers = depth();
    o.state_dtype = state_dtype();
    o.device_out = device_out;
    return NvmeOptimizer::create(store_.get(), *pool_, config_, o);
  }

  void add_default_models() {
    add("odd", 100003, true, true, true, true);        // many chunks and a ragged last one
    add("tiny", 5, true, true, true, false);           // one chunk, smaller than a page
    add("host_states", 2048 * 3 + 17, false, true, false, true);  // master + states in RAM, grads on NVMe
    add("host_grads", 40000, true, false, true, false);          // grads in RAM
    models_.back().first_index = 123457;                          // a shard from the middle of its tensor
  }

  TempDir dir_;
  std::shared_ptr<io::FaultInjector> faults_;
  std::unique_ptr<io::IoEngine> engine_;
  std::unique_ptr<io::SwapStore> store_;
  std::unique_ptr<io::PinnedPool> pool_;
  OptimizerConfig config_;
  std::vector<Model> models_;
  std::mt19937 rng_{42};
};

TEST_P(NvmeOptimizerTest, BitIdenticalToInMemoryStepOverSeveralSteps) {
  add_default_models();
  auto opt = make();
  ASSERT_TRUE(opt.ok()) << opt.status().to_string();
  const std::size_t pinned = pool_->used_bytes();  // the ring, allocated once
  for (std::int64_t t = 1; t <= 3; ++t) {
    new_grads();
    config_.grad_scale = 1.0 / (t + 1);  // a pre-scale that changes (loss scale, accumulation, clipping)
    reference_step(t);
    auto ts = tensors();
    Status s = (*opt)->step(config_, t, ts);
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_TRUE((*opt)->progress().complete);
    expect_identical(("after step " + std::to_string(t)).c_str());
    EXPECT_EQ(pool_->used_bytes(), pinned);
  }
}

// out_is_master (an fp32 model's compute copy): the output is the updated
// master's bits, on every combination of master and output tier, with the
// master and states still bit-identical to the in-memory step.
TEST_P(NvmeOptimizerTest, Fp32OutputIsACopyOfTheUpdatedMaster) {
  add("swap_swap", 100003, true, true, true, true);
  add("swap_host", 2048 * 3 + 17, true, true, true, false);
  add("host_swap", 40000, false, true, false, true);
  add("host_host", 5000, false, false, false, false);
  std::vector<io::SwapTensor> s_out32;
  std::vector<std::vector<float>> h_out32;
  for (auto& m : models_) {
    auto t = store_->add_tensor(m.name + ".out32", m.count * 4);
    ASSERT_TRUE(t.ok());
    s_out32.push_back(*t);
    h_out32.emplace_back(m.count, -1.0f);
  }
  auto opt = make();
  ASSERT_TRUE(opt.ok()) << opt.status().to_string();
  for (std::int64_t t = 1; t <= 3; ++t) {
    new_grads();
    reference_step(t);
    auto ts = tensors();
    for (size_t i = 0; i < ts.size(); ++i) {
      ts[i].out_is_master = true;
      ts[i].params_out = models_[i].swap_out ? Placement::in_swap(s_out32[i]) : Placement::in_host(h_out32[i].data());
    }
    Status s = (*opt)->step(config_, t, ts);
    ASSERT_TRUE(s.ok()) << s.to_string();
    for (size_t i = 0; i < models_.size(); ++i) {
      const Model& m = models_[i];
      std::vector<float> master(m.count), out(m.count);
      if (m.swap_master) read_swap(m.s_master, &master); else master = m.h_master;
      if (m.swap_out) read_swap(s_out32[i], &out); else out = h_out32[i];
      EXPECT_EQ(0, std::memcmp(master.data(), m.master.data(), m.count * 4)) << m.name << " master, step " << t;
      EXPECT_EQ(0, std::memcmp(out.data(), m.master.data(), m.count * 4)) << m.name << " fp32 output, step " << t;
    }
  }
}

// A DeviceOutput that copies only when waited for: an optimizer that wrote a
// slot's output again, or let a read overwrite the master chunk an fp32
// output is uploaded from, before waiting would upload the wrong bytes; one
// that returned with copies not waited for leaves them in flight.
class LazyDeviceOutput final : public DeviceOutput {
 public:
  explicit LazyDeviceOutput(unsigned slots) : pending_(slots) {}
  Status copy(unsigned slot, void* dst, const void* src, std::size_t bytes) override {
    if (slot >= pending_.size()) return Status(StatusCode::kInternal, "slot out of range");
    if (++copies == fail_at) return Status(StatusCode::kIoError, "injected device copy failure");
    pending_[slot].push_back({dst, src, bytes});
    total_bytes += bytes;
    return {};
  }
  Status wait(unsigned slot) override {
    for (const auto& c : pending_[slot]) std::memcpy(c.dst, c.src, c.bytes);
    pending_[slot].clear();
    return {};
  }
  std::size_t in_flight() const {
    std::size_t n = 0;
    for (const auto& p : pending_) n += p.size();
    return n;
  }
  std::uint64_t total_bytes = 0;
  int copies = 0, fail_at = -1;

 private:
  struct Copy {
    void* dst;
    const void* src;
    std::size_t bytes;
  };
  std::vector<std::vector<Copy>> pending_;
};

// Device-resident params_out: every chunk's output reaches the device copy
// with the in-RAM step's bits (bf16, and fp32 copies of the master), nothing
// is left in flight when step() returns, and the bytes are exactly the
// outputs'.
TEST_P(NvmeOptimizerTest, DeviceOutputsAreUploadedFromTheRingBeforeTheSlotIsReused) {
  add_default_models();
  add("host_master_fp32", 9000, false, true, true, true);
  LazyDeviceOutput dev(depth());
  auto opt = make(4096, &dev);
  ASSERT_TRUE(opt.ok()) << opt.status().to_string();
  std::vector<std::vector<std::uint16_t>> d16;
  std::vector<std::vector<float>> d32;
  std::uint64_t elems = 0;
  for (const auto& m : models_) {
    d16.emplace_back(m.count, 0xFFFF);
    d32.emplace_back(m.count, -1.0f);
    elems += m.count;
  }
  for (std::int64_t t = 1; t <= 4; ++t) {
    const bool fp32 = t > 2;
    new_grads();
    reference_step(t);
    auto ts = tensors();
    for (size_t i = 0; i < ts.size(); ++i) {
      ts[i].params_out = fp32 ? Placement::on_device(d32[i].data()) : Placement::on_device(d16[i].data());
      ts[i].out_is_master = fp32;
    }
    const std::uint64_t bytes0 = dev.total_bytes;
    Status s = (*opt)->step(config_, t, ts);
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(dev.in_flight(), 0u) << "step " << t;
    EXPECT_EQ(dev.total_bytes - bytes0, elems * (fp32 ? 4 : 2)) << "step " << t;
    for (size_t i = 0; i < models_.size(); ++i) {
      const Model& m = models_[i];
      if (fp32) {
        EXPECT_EQ(0, std::memcmp(d32[i].data(), m.master.data(), m.count * 4)) << m.name << " step " << t;
      } else {
        EXPECT_EQ(0, std::memcmp(d16[i].data(), m.out.data(), m.count * 2)) << m.name << " step " << t;
      }
    }
  }
  // Refused by name: a device params_out without a DeviceOutput, or any
  // other array on the device.
  auto plain = make();
  ASSERT_TRUE(plain.ok());
  auto ts = tensors();
  ts[0].params_out = Placement::on_device(d16[0].data());
  Status s = (*plain)->step(config_, 1, ts);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("no device_out"), std::string::npos) << s.message();
  ts = tensors();
  ts[0].master = Placement::on_device(d32[0].data());
  s = (*opt)->step(config_, 5, ts);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("master is on the device"), std::string::npos) << s.message();
}

TEST_P(NvmeOptimizerTest, TraceShowsEveryReadUpdateAndWrite) {
  add("a", 50000, true, true, true, true);
  const std::string path = dir_.path() + "/step.trace.json";
  auto tracer = Tracer::open(path);
  ASSERT_TRUE(tracer.ok());
  NvmeOptimizerOptions o;
  o.chunk_elems = 4096;
  o.ring_buffers = depth();
  o.state_dtype = state_dtype();
  o.tracer = tracer->get();
  auto opt = NvmeOptimizer::create(store_.get(), *pool_, config_, o);
  ASSERT_TRUE(opt.ok());
  new_grads();
  auto ts = tensors();
  ASSERT_TRUE((*opt)->step(config_, 1, ts).ok());
  ASSERT_TRUE((*tracer)->close().ok());
  auto j = nlohmann::json::parse(std::ifstream(path));
  std::map<std::string, int> count;
  int slot_tracks = 0;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "X") ++count[e["name"].get<std::string>()];
    if (e["ph"] == "M" && e["args"]["name"].get<std::string>().rfind("optimizer ring slot", 0) == 0) ++slot_tracks;
  }
  const int chunks = (50000 + 4095) / 4096;
  EXPECT_EQ(count["nvme_read"], chunks);
  EXPECT_EQ(count["nvme_write"], chunks);
  EXPECT_EQ(count["optimizer_chunk"], chunks);
  EXPECT_EQ(count["optimizer_step"], 1);
  EXPECT_EQ(slot_tracks, static_cast<int>(depth()));
}

INSTANTIATE_TEST_SUITE_P(StatesAndDepths, NvmeOptimizerTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(2u, 3u, 4u)),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) + "_ring" +
                                  std::to_string(std::get<1>(info.param));
                         });

// One pass over tensors with their own hyper-parameters (the engine's
// parameter groups: lr, betas, no weight decay) gives each tensor the bits of
// a separate step with its config. The completion callback counts whole
// tensors in increasing order, ends at the tensor count, and never reports a
// tensor before its device output is uploaded (the lazy output copies only
// when waited for).
TEST_P(NvmeOptimizerTest, OnePassWithPerTensorConfigsReportsTensorsInOrder) {
  add_default_models();
  LazyDeviceOutput dev(depth());
  auto opt = make(4096, &dev);
  ASSERT_TRUE(opt.ok()) << opt.status().to_string();
  std::vector<OptimizerConfig> cfg(models_.size(), config_);
  for (size_t i = 0; i < cfg.size(); ++i) {
    cfg[i].lr = 1e-2 * static_cast<double>(i + 1);
    if (i % 2 == 1) cfg[i].weight_decay = 0;
    if (i == 2) cfg[i].beta1 = 0.8;
  }
  std::vector<std::vector<std::uint16_t>> d16;
  for (const auto& m : models_) d16.emplace_back(m.count, 0xFFFF);
  for (std::int64_t t = 1; t <= 2; ++t) {
    new_grads();
    reference_step(t, &cfg);  // each with its own config
    auto ts = tensors();
    for (size_t i = 0; i < ts.size(); ++i) {
      ts[i].config = &cfg[i];
      ts[i].params_out = Placement::on_device(d16[i].data());
    }
    std::vector<std::size_t> calls;
    std::atomic<int> early{0};
    Status s = (*opt)->step(config_, t, ts, [&](std::size_t done) {
      calls.push_back(done);
      for (std::size_t j = 0; j < done; ++j)
        if (std::memcmp(d16[j].data(), models_[j].out.data(), models_[j].count * 2) != 0) ++early;
    });
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(early.load(), 0) << "a tensor was reported before its output was uploaded (step " << t << ")";
    ASSERT_FALSE(calls.empty());
    EXPECT_TRUE(std::is_sorted(calls.begin(), calls.end()) &&
                std::adjacent_find(calls.begin(), calls.end()) == calls.end())
        << "reported out of order or twice";
    EXPECT_EQ(calls.back(), ts.size());
    for (size_t i = 0; i < models_.size(); ++i) {
      const Model& m = models_[i];
      std::vector<float> master(m.count);
      if (m.swap_master) read_swap(m.s_master, &master); else master = m.h_master;
      EXPECT_EQ(0, std::memcmp(master.data(), m.master.data(), m.count * 4)) << m.name << " step " << t;
      EXPECT_EQ(0, std::memcmp(d16[i].data(), m.out.data(), m.count * 2)) << m.name << " step " << t;
    }
  }
  // A config for another optimizer kind (another state count) is refused by name.
  OptimizerConfig sgd = config_;
  sgd.kind = cpu_optim::OptimizerKind::kSgd;
  auto ts = tensors();
  ts[1].config = &sgd;
  Status s = (*opt)->step(config_, 3, ts);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("its config needs"), std::string::npos) << s.message();
}

// Read-ahead: the first ring-full of chunks read before the step (masters and
// moments; gradients in RAM) is used by the step, with the same bits as
// without it. It stops at a tensor whose gradients are in the swap store. A
// read-ahead for other tensors than the step's is not used; one dropped after
// the state changed does not leak the old bytes; an optimizer destroyed with
// reads ahead in flight waits for them.
TEST_P(NvmeOptimizerTest, ReadAheadIsUsedOnlyWhenItHoldsWhatTheStepReads) {
  add("a", 100003, true, false, true, true);  // gradients in RAM: read ahead
  add("b", 5000, true, false, true, false);
  add("c", 9000, true, true, true, true);     // gradients on NVMe: the read-ahead stops here
  auto opt = make();
  ASSERT_TRUE(opt.ok()) << opt.status().to_string();
  std::int64_t t = 1;
  auto step = [&](const char* when) {
    new_grads();
    reference_step(t);
    auto ts = tensors();
    Status s = (*opt)->step(config_, t, ts);
    ASSERT_TRUE(s.ok()) << s.to_string();
    expect_identical(when);
    ++t;
  };
  step("step 1");
  auto ts = tensors();
  (*opt)->prefetch(ts);
  step("after a read-ahead");
  EXPECT_EQ((*opt)->prefetch_hits(), depth()) << "tensor a's first chunks came from the read-ahead";

  // The state changes after the read-ahead (a checkpoint load): dropped, the
  // step reads the new bytes.
  ts = tensors();
  (*opt)->prefetch(ts);
  std::normal_distribution<float> d(0.f, 1.f);
  for (auto& x : models_[0].master) x = d(rng_);
  write_swap(models_[0].s_master, models_[0].master.data(), models_[0].count * 4);
  (*opt)->drop_prefetch();
  step("after a dropped read-ahead");
  EXPECT_EQ((*opt)->prefetch_hits(), depth());

  // Read ahead for a list the step does not take (b first): none of it used.
  ts = tensors();
  std::swap(ts[0], ts[1]);
  (*opt)->prefetch(ts);
  step("after a read-ahead of other chunks");
  EXPECT_EQ((*opt)->prefetch_hits(), depth());

  // Gradients in the swap store from the first tensor on: nothing read ahead.
  ts = tensors();
  std::rotate(ts.begin(), ts.begin() + 2, ts.end());
  (*opt)->prefetch(ts);
  std::rotate(models_.begin(), models_.begin() + 2, models_.end());
  step("after a read-ahead that stopped at once");
  EXPECT_EQ((*opt)->prefetch_hits(), depth());

  ts = tensors();
  (*opt)->prefetch(ts);
  opt->reset();  // waits for the reads in flight (ASan/TSan would see them land in freed memory)
}

class NvmeOptimizerErrors : public NvmeOptimizerTest {};

TEST_P(NvmeOptimizerErrors, ReadErrorMidStepIsClearAndTheStepResumesExactly) {
  add_default_models();
  auto opt = make();
  ASSERT_TRUE(opt.ok());
  new_grads();
  reference_step(1);
  auto ts = tensors();
  faults_->set_plan({.op = io::IoOpKind::kRead, .fail_nth = 40, .fail_errno = EIO});
  Status s = (*opt)->step(config_, 1, ts);
  faults_->set_plan({});
  ASSERT_FALSE(s.ok());
  std::printf("the error: %s\n", s.to_string().c_str());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("optimizer step 1: reading "), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("Input/output error"), std::string::npos) << s.message();
  const StepProgress p = (*opt)->progress();
  EXPECT_FALSE(p.complete);
  EXPECT_FALSE(p.torn);
  EXPECT_GT(p.done_elems, 0u);
  EXPECT_LT(p.done_elems, p.total_elems);
  // Another step number is refused until step 1 is done; the same one resumes.
  Status wrong = (*opt)->step(config_, 2, ts);
  EXPECT_EQ(wrong.code(), StatusCode::kInvalidArgument) << wrong.to_string();
  EXPECT_NE(wrong.message().find("step 1 is incomplete"), std::string::npos) << wrong.message();
  s = (*opt)->step(config_, 1, ts);
  ASSERT_TRUE(s.ok()) << s.to_string();
  expect_identical("after a resumed step");  // chunks done before the error were not updated twice
  // A completed step cannot be applied again.
  EXPECT_EQ((*opt)->step(config_, 1, ts).code(), StatusCode::kInvalidArgument);
  new_grads();
  reference_step(2);
  ASSERT_TRUE((*opt)->step(config_, 2, ts).ok());
  expect_identical("after step 2");
}

TEST_P(NvmeOptimizerErrors, WriteErrorMidStepMarksTheStateTorn) {
  add_default_models();
  auto opt = make();
  ASSERT_TRUE(opt.ok());
  new_grads();
  auto ts = tensors();
  faults_->set_plan({.op = io::IoOpKind::kWrite, .fail_nth = 25, .fail_errno = EIO});
  Status s = (*opt)->step(config_, 1, ts);
  faults_->set_plan({});
  ASSERT_FALSE(s.ok());
  std::printf("the error: %s\n", s.to_string().c_str());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("optimizer step 1: writing back "), std::string::npos) << s.message();
  EXPECT_TRUE((*opt)->progress().torn);
  Status again = (*opt)->step(config_, 1, ts);
  EXPECT_EQ(again.code(), StatusCode::kCorrupt) << again.to_string();
  // After restoring a checkpoint the caller says so and continues.
  (*opt)->set_completed_step(1);
  EXPECT_TRUE((*opt)->step(config_, 2, ts).ok());
}

// The completion callback reports a tensor whose compute copy is on the host
// once it is updated, without waiting for its master's and moments' write-back
// (the engine's next forward reads only the copy); one whose copy is in the
// swap store only once that is written. Every write failing: the host-copy
// tensor is reported (its copy final at the call), the swap-copy tensor never,
// and the step still fails with the write error, its state torn.
TEST_P(NvmeOptimizerErrors, HostComputeCopiesAreReportedBeforeTheWriteBack) {
  add("host_out", 3000, true, true, true, false);  // one chunk: master, grads, states on NVMe; copy in RAM
  add("swap_out", 3000, true, true, true, true);   // the same with its copy on NVMe
  auto opt = make();
  ASSERT_TRUE(opt.ok());
  new_grads();
  reference_step(1);
  auto ts = tensors();
  std::vector<std::size_t> calls;
  int copy_not_final = 0;
  faults_->set_plan({.op = io::IoOpKind::kWrite, .fail_nth = 1, .fail_errno = EIO, .fail_after = true});
  Status s = (*opt)->step(config_, 1, ts, [&](std::size_t done) {
    calls.push_back(done);
    if (done >= 1 && std::memcmp(models_[0].h_out.data(), models_[0].out.data(), models_[0].count * 2) != 0)
      ++copy_not_final;
  });
  faults_->set_plan({});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("optimizer step 1: writing back "), std::string::npos) << s.message();
  EXPECT_TRUE((*opt)->progress().torn);
  EXPECT_EQ(calls, std::vector<std::size_t>{1}) << "host_out must be reported, swap_out (never written) must not";
  EXPECT_EQ(copy_not_final, 0) << "host_out was reported before its compute copy was final";
}

// A failed upload leaves a device compute copy behind its master: the step
// fails naming it, and the state counts as torn (as after a failed write).
TEST_P(NvmeOptimizerErrors, FailedDeviceUploadMarksTheStateTorn) {
  add_default_models();
  LazyDeviceOutput dev(depth());
  dev.fail_at = 7;
  auto opt = make(4096, &dev);
  ASSERT_TRUE(opt.ok());
  std::vector<std::vector<std::uint16_t>> d16;
  for (const auto& m : models_) d16.emplace_back(m.count, 0);
  new_grads();
  auto ts = tensors();
  for (size_t i = 0; i < ts.size(); ++i) ts[i].params_out = Placement::on_device(d16[i].data());
  Status s = (*opt)->step(config_, 1, ts);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("optimizer step 1: uploading params_out elements"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("injected device copy failure"), std::string::npos) << s.message();
  EXPECT_TRUE((*opt)->progress().torn);
  EXPECT_EQ(dev.in_flight(), 0u);
  EXPECT_EQ((*opt)->step(config_, 1, ts).code(), StatusCode::kCorrupt);
}

// A read ahead that failed is the step's read error, and the step resumes.
TEST_P(NvmeOptimizerErrors, FailedReadAheadIsTheStepsReadError) {
  add("a", 100003, true, false, true, true);
  auto opt = make();
  ASSERT_TRUE(opt.ok());
  new_grads();
  reference_step(1);
  auto ts = tensors();
  faults_->set_plan({.op = io::IoOpKind::kRead, .fail_nth = 1, .fail_errno = EIO});
  (*opt)->prefetch(ts);
  Status s = (*opt)->step(config_, 1, ts);
  faults_->set_plan({});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("optimizer step 1: reading "), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("Input/output error"), std::string::npos) << s.message();
  s = (*opt)->step(config_, 1, ts);
  ASSERT_TRUE(s.ok()) << s.to_string();
  expect_identical("after the resumed step");
}

INSTANTIATE_TEST_SUITE_P(Depths, NvmeOptimizerErrors,
                         ::testing::Combine(::testing::Values(DType::kF32), ::testing::Values(2u, 4u)),
                         [](const auto& info) { return "ring" + std::to_string(std::get<1>(info.param)); });

class NvmeOptimizerSetup : public NvmeOptimizerTest {};

TEST_P(NvmeOptimizerSetup, PoolTooSmallForTheRingFailsAtCreate) {
  io::PinnedPoolOptions po;
  po.budget_bytes = 1 << 20;
  auto pool = io::PinnedPool::create(po);
  ASSERT_TRUE(pool.ok());
  NvmeOptimizerOptions o;
  o.chunk_elems = 1 << 20;  // 18 MiB per slot
  o.ring_buffers = depth();
  auto opt = NvmeOptimizer::create(store_.get(), **pool, config_, o);
  ASSERT_FALSE(opt.ok());
  EXPECT_EQ(opt.status().code(), StatusCode::kOutOfBudget);
  EXPECT_NE(opt.status().message().find("nvme optimizer: ring of"), std::string::npos) << opt.status().message();
  std::printf("the error: %s\n", opt.status().to_string().c_str());
  EXPECT_EQ((*pool)->used_bytes(), 0u);  // nothing held after the failure
}

TEST_P(NvmeOptimizerSetup, BadArgumentsAreRefused) {
  NvmeOptimizerOptions o;
  o.ring_buffers = 1;
  EXPECT_EQ(NvmeOptimizer::create(store_.get(), *pool_, config_, o).status().code(), StatusCode::kInvalidArgument);
  add("x", 1000, true, true, true, true);
  auto opt = make();
  ASSERT_TRUE(opt.ok());
  auto ts = tensors();
  ts[0].grads = Placement{};
  Status s = (*opt)->step(config_, 1, ts);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("tensor 'x': no grads"), std::string::npos) << s.message();
  EXPECT_EQ((*opt)->progress().step, 0);  // nothing was started
  NvmeOptimizerOptions small;
  small.chunk_elems = 4096;
  auto host_only = NvmeOptimizer::create(nullptr, *pool_, config_, small);
  ASSERT_TRUE(host_only.ok());
  ts = tensors();
  EXPECT_EQ((*host_only)->step(config_, 1, ts).code(), StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Ring, NvmeOptimizerSetup,
                         ::testing::Combine(::testing::Values(DType::kF32), ::testing::Values(3u)),
                         [](const auto&) { return std::string("ring3"); });

}  // namespace
}  // namespace strata
