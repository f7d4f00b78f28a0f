// WorkQueue<T>: one worker thread fed by a FIFO queue, used by each of the
// engine's three threads (uploader, accumulator, optimizer).
//
// Owns: its mutex, condition variable, deque, the worker thread, and the
// "busy" flag (an item was popped and its handler has not returned yet).
// Thread: the worker calls the handler for each item in push order, one at a
// time. push() may be called from any thread (the engine pushes from the
// driving thread and from host functions on the download stream); wait_idle()
// and stop() from the owner's thread.
// Must not: hold its mutex while the handler runs (handlers take their part's
// own lock; a part may push while holding its lock, so the order is always
// "part lock, then queue lock").
//
// stop() lets the worker finish what is queued, then joins it: the same
// drain-then-exit rule the engine's hand-written loops had. An item pushed
// after stop() stays in the queue unhandled (host functions still in flight
// when the engine is destroyed).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "common/status.h"
#include "common/threads.h"

namespace strata::engine {

template <typename T>
class WorkQueue {
 public:
  using Handler = std::function<void(const T&)>;

  WorkQueue() = default;
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;
  ~WorkQueue() { stop(); }

  // Starts the worker thread. Call once. kOutOfMemory naming `name` and the
  // limit behind it when the system cannot start a thread (ulimit -u, a pids
  // cgroup, ulimit -v). The handler must not throw (run_guarded, threads.h):
  // an exception leaving the worker ends the process.
  Status start(const char* name, Handler handler) {
    handler_ = std::move(handler);
    return start_thread(thread_, std::string("engine: cannot start the ") + name + " thread", [this] { run(); });
  }

  void push(T item) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(item));
    }
    cv_.notify_all();
  }

  // Blocks until the queue is empty and the worker is not inside a handler:
  // every effect of every item pushed before the call is visible after it.
  void wait_idle() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
  }

  // Drains the queue, then joins the worker. Idempotent; fine if never started.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    for (;;) {
      T item;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      }
      handler_(item);
      {
        std::lock_guard<std::mutex> lock(mu_);
        busy_ = false;
      }
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;  // items pushed, worker idle, stop requested
  std::deque<T> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  Handler handler_;
  std::thread thread_;
};

}  // namespace strata::engine
