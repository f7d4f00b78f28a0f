// AsyncError: the first error of work the engine did on its own threads (an
// accumulation's I/O, an overlapped group update), kept until the driving
// thread's next call returns it.
//
// Owns: one Status and the mutex guarding it. Thread: set() from the worker
// threads, take() from the driving thread. Must not: keep more than the
// first error (later ones are usually consequences of it).
#pragma once

#include <mutex>

#include "common/status.h"

namespace strata::engine {

class AsyncError {
 public:
  void set(const Status& st) {
    if (st.ok()) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.ok()) error_ = st;
  }
  // Returns the kept error (ok when none) and forgets it.
  Status take() {
    std::lock_guard<std::mutex> lock(mu_);
    Status st = std::move(error_);
    error_ = Status();
    return st;
  }

 private:
  std::mutex mu_;
  Status error_;
};

}  // namespace strata::engine
