// A fault-injecting backend wrapper, so every error path of the engine (and of
// the layers above it) is tested without failing hardware (LevelDB's
// FaultInjectionEnv, applied to an I/O backend).
//
//   auto faults = std::make_shared<FaultInjector>();
//   faults->set_plan({.op = IoOpKind::kWrite, .fail_nth = 3, .fail_errno = EIO});
//   auto engine = make_io_engine({.backend = "posix", .faults = faults});
//
// Faults apply to pieces (what the engine hands the backend), counted from 1
// over the pieces that match `op` since the plan was set. A failed piece never
// reaches the real backend; a shortened piece does, with half its length, so
// the real short-transfer path runs. Thread-safe: the plan may be changed while
// I/O runs.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>

#include "io/io_backend.h"

namespace strata::io {

struct FaultPlan {
  std::optional<IoOpKind> op;     // only pieces of this kind count (nullopt = all)
  std::uint64_t fail_nth = 0;     // the Nth matching piece completes with -fail_errno (0 = none)
  int fail_errno = 0;             // errno for fail_nth (0 means EIO)
  bool fail_after = false;        // with fail_nth: every piece from the Nth on fails, not just the Nth
  std::uint64_t short_every = 0;  // every Nth matching piece moves only half its bytes (0 = none)
  std::uint32_t latency_us = 0;   // delay added before each matching piece is submitted
};

class FaultInjector {
 public:
  void set_plan(const FaultPlan& plan);
  FaultPlan plan() const;
  std::uint64_t pieces_seen() const;
  std::uint64_t faults_injected() const;
  std::uint64_t shorts_injected() const;

  enum class Action { kPass, kFail, kShorten };
  // Decides what happens to one piece; `err` receives the errno for kFail.
  Action decide(IoOpKind kind, int* err, std::uint32_t* latency_us);

 private:
  mutable std::mutex mu_;
  FaultPlan plan_;
  std::uint64_t seen_ = 0;
  std::uint64_t faults_ = 0;
  std::uint64_t shorts_ = 0;
};

// Wraps `inner` so that `faults` decides the fate of every piece.
std::unique_ptr<IoBackend> wrap_with_faults(std::unique_ptr<IoBackend> inner, std::shared_ptr<FaultInjector> faults);

}  // namespace strata::io
