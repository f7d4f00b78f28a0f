#include "io/fault_injection.h"

#include <cerrno>
#include <chrono>
#include <thread>
#include <vector>

namespace strata::io {

void FaultInjector::set_plan(const FaultPlan& plan) {
  std::lock_guard<std::mutex> lock(mu_);
  plan_ = plan;
  seen_ = 0;
}

FaultPlan FaultInjector::plan() const {
  std::lock_guard<std::mutex> lock(mu_);
  return plan_;
}

std::uint64_t FaultInjector::pieces_seen() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seen_;
}

std::uint64_t FaultInjector::faults_injected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return faults_;
}

std::uint64_t FaultInjector::shorts_injected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return shorts_;
}

FaultInjector::Action FaultInjector::decide(IoOpKind kind, int* err, std::uint32_t* latency_us) {
  std::lock_guard<std::mutex> lock(mu_);
  *latency_us = 0;
  if (plan_.op && *plan_.op != kind) return Action::kPass;
  const std::uint64_t n = ++seen_;
  *latency_us = plan_.latency_us;
  if (plan_.fail_nth && (n == plan_.fail_nth || (plan_.fail_after && n > plan_.fail_nth))) {
    *err = plan_.fail_errno ? plan_.fail_errno : EIO;
    ++faults_;
    return Action::kFail;
  }
  if (plan_.short_every && n % plan_.short_every == 0) {
    ++shorts_;
    return Action::kShorten;
  }
  return Action::kPass;
}

namespace {

class FaultInjectingBackend final : public IoBackend {
 public:
  FaultInjectingBackend(std::unique_ptr<IoBackend> inner, std::shared_ptr<FaultInjector> f)
      : inner_(std::move(inner)), faults_(std::move(f)) {}

  const char* name() const override { return inner_->name(); }
  Status start() override { return inner_->start(); }

  void submit(BackendOp* const* ops, std::size_t n) override {
    pass_.clear();
    for (std::size_t i = 0; i < n; ++i) {
      BackendOp* op = ops[i];
      int err = 0;
      std::uint32_t latency = 0;
      auto action = faults_->decide(op->kind, &err, &latency);
      if (latency) std::this_thread::sleep_for(std::chrono::microseconds(latency));
      if (action == FaultInjector::Action::kFail) {
        op->result = -err;
        failed_.push_back(op);
        continue;
      }
      if (action == FaultInjector::Action::kShorten) {
        // Keep O_DIRECT pieces aligned; a piece too small to halve stays whole.
        std::uint32_t half = op->length / 2;
        if (op->direct) half = half / 4096 * 4096;
        if (half > 0) op->length = half;
      }
      pass_.push_back(op);
    }
    if (!pass_.empty()) inner_->submit(pass_.data(), pass_.size());
  }

  std::size_t reap(BackendOp** out, std::size_t max, bool block) override {
    std::size_t n = 0;
    while (n < max && !failed_.empty()) {
      out[n++] = failed_.back();
      failed_.pop_back();
    }
    if (n == max) return n;
    // Never block while injected failures are waiting to be reported.
    return n + inner_->reap(out + n, max - n, block && n == 0);
  }

  void wake() override { inner_->wake(); }
  int register_file(int fd) override { return inner_->register_file(fd); }
  void unregister_file(int index) override { inner_->unregister_file(index); }
  int register_buffer(void* p, std::size_t b, int* err) override { return inner_->register_buffer(p, b, err); }
  void unregister_buffer(int index) override { inner_->unregister_buffer(index); }

 private:
  std::unique_ptr<IoBackend> inner_;
  std::shared_ptr<FaultInjector> faults_;
  std::vector<BackendOp*> pass_, failed_;
};

}  // namespace

std::unique_ptr<IoBackend> wrap_with_faults(std::unique_ptr<IoBackend> inner, std::shared_ptr<FaultInjector> faults) {
  return std::make_unique<FaultInjectingBackend>(std::move(inner), std::move(faults));
}

}  // namespace strata::io
