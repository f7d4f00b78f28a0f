// Worker threads that fail as Status, never as std::terminate.
//
// start_thread(): a std::thread whose constructor throws std::system_error
// (RLIMIT_NPROC, a container's pids limit, RLIMIT_AS leaving no room for a
// stack) becomes kOutOfMemory naming what could not start and the limit to
// raise. run_guarded(): the body of a worker thread's unit of work, whose
// std::bad_alloc (or other exception) becomes a Status for the thread's own
// error path: an exception leaving a thread ends the process.
#pragma once

#include <exception>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "common/status.h"

namespace strata {

// " (address space ... `ulimit -v` ...; threads ... `ulimit -u` ...)": the
// limits of this process that can keep a thread from starting, those that are
// set; a pids cgroup is named too (it is not visible as an rlimit).
std::string thread_limit_hint();

// kOutOfMemory "<what>: <e.what()><thread_limit_hint()>"; what says which
// thread could not start ("engine: cannot start the uploader thread").
Status thread_start_error(const std::string& what, const std::system_error& e);

// kOutOfMemory "<what>: out of memory" (and the address-space limit when
// one is set); without a message when even that cannot be allocated.
Status out_of_memory_status(const char* what) noexcept;

// Starts `thread` running fn; the error above when it cannot start.
template <typename Fn>
Status start_thread(std::thread& thread, const std::string& what, Fn&& fn) {
  try {
    thread = std::thread(std::forward<Fn>(fn));
  } catch (const std::system_error& e) {
    return thread_start_error(what, e);
  } catch (const std::bad_alloc&) {
    return out_of_memory_status(what.c_str());
  }
  return {};
}

// fn() (a Status), with an exception turned into one: std::bad_alloc into
// kOutOfMemory "<what>: out of memory" (with the address-space limit when one
// is set), anything else into kInternal "<what>: unexpected exception: ...".
// `what` is a static string: building the message must not need memory the
// failure did not have.
template <typename Fn>
Status run_guarded(const char* what, Fn&& fn) noexcept {
  try {
    return std::forward<Fn>(fn)();
  } catch (const std::bad_alloc&) {
    return out_of_memory_status(what);
  } catch (const std::exception& e) {
    try {
      return Status(StatusCode::kInternal, std::string(what) + ": unexpected exception: " + e.what());
    } catch (...) {
      return Status(StatusCode::kInternal, std::string());
    }
  } catch (...) {
    return Status(StatusCode::kInternal, std::string());
  }
}

}  // namespace strata
