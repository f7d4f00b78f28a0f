// The engine and stream handles behind the C API's opaque types, and the
// glue every engine entry point runs through (engine_api.cpp, dlpack_api.cpp):
// guarded() is the one place a C++ exception is stopped before it crosses
// into C and a Status becomes a strata_status_t and the engine's last error.
#pragma once

#include <mutex>
#include <new>
#include <set>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "capi/c_api_util.h"
#include "comm/communicator.h"
#include "device/device_backend.h"
#include "runtime/engine.h"
#include "strata/strata.h"

// Owned by the caller, like a stream: dead (both pointers null) once its
// engine is destroyed.
struct strata_event {
  strata_engine* engine;
  strata::DeviceEvent* event;
};

// Owned by the caller. When its engine is destroyed first, the device stream
// goes with the engine and both pointers become null: the handle is then
// dead, and strata_stream_destroy only frees it (so RAII wrappers may be
// destroyed in any order).
struct strata_stream {
  strata_engine* engine;
  strata::DeviceStream* stream;
};

struct strata_engine {
  // With ranks (strata_engine_options_t.comm_kind): the device backend and
  // the communicator the engine borrows; declared first, destroyed last.
  std::unique_ptr<strata::DeviceBackend> device;
  std::unique_ptr<strata::comm::Communicator> comm;
  std::unique_ptr<strata::Engine> engine;
  std::string device_name;
  std::vector<std::string> group_names;  // stable storage for strata_group_info_t.name

  mutable std::mutex mu;  // guards everything below
  std::string last_error;
  std::unordered_set<strata_stream*> streams;
  std::unordered_set<strata_event*> events;
  std::set<std::string> trace_names;  // interned span names: their c_str() outlive the trace

  // DLPack gradients handed to strata_engine_reduce_grad_dlpack: each is
  // given back (its deleter called, on the driving thread) once its event,
  // recorded on the caller's stream after the engine's read, has passed.
  struct DlpackPending {
    DLManagedTensor* tensor;
    strata::DeviceEvent* read;
  };
  std::vector<DlpackPending> dlpack_pending;  // driving thread only
  std::vector<strata::DeviceEvent*> dlpack_events;  // recycled
};

namespace strata::capi {

inline Status null_arg(const char* fn, const char* arg) {
  return Status(StatusCode::kInvalidArgument, std::string(fn) + ": " + arg + " is NULL");
}

inline Result<DType> to_dtype(const strata_dtype_t& d, const char* what) {
  switch (enum_value(d)) {
    case STRATA_DTYPE_F32: return DType::kF32;
    case STRATA_DTYPE_BF16: return DType::kBF16;
    case STRATA_DTYPE_F16: return DType::kF16;
  }
  return Status(StatusCode::kInvalidArgument, std::string(what) + ": unknown dtype " + std::to_string(enum_value(d)));
}

// Records st on the engine (when there is one) and on this thread.
inline strata_status_t fail_on(strata_engine* e, const Status& st) {
  strata_status_t code = fail(st);
  if (e) {
    std::lock_guard<std::mutex> lock(e->mu);
    e->last_error = st.message();
  }
  return code;
}

template <typename Fn>
strata_status_t guarded(strata_engine* e, const char* fn, Fn&& body) noexcept {
  try {
    Status st = body();
    if (st.ok()) return STRATA_OK;
    // Named once: a message that already starts with the function's name
    // (null_arg's) is not prefixed again.
    const bool named = std::string_view(st.message()).starts_with(std::string(fn) + ":");
    return fail_on(e, named ? st : st.with_context(fn));
  } catch (const std::bad_alloc&) {
    try {
      return fail_on(e, Status(StatusCode::kOutOfMemory, std::string(fn) + ": out of memory"));
    } catch (...) {
      return STRATA_ERR_OUT_OF_MEMORY;
    }
  } catch (const std::exception& ex) {
    try {
      return fail_on(e, Status(StatusCode::kInternal, std::string(fn) + ": unexpected exception: " + ex.what()));
    } catch (...) {
      return STRATA_ERR_INTERNAL;
    }
  } catch (...) {
    try {
      return fail_on(e, Status(StatusCode::kInternal, std::string(fn) + ": unexpected exception"));
    } catch (...) {
      return STRATA_ERR_INTERNAL;
    }
  }
}

// For calls on an engine handle: a NULL handle is recorded on the thread.
template <typename Fn>
inline strata_status_t on_engine(strata_engine* e, const char* fn, Fn&& body) noexcept {
  if (!e || !e->engine) return fail(Status(StatusCode::kInvalidArgument, std::string(fn) + ": engine is NULL"));
  return guarded(e, fn, std::forward<Fn>(body));
}

template <typename Fn>
inline strata_status_t on_stream(strata_stream* s, const char* fn, Fn&& body) noexcept {
  if (!s) return fail(Status(StatusCode::kInvalidArgument, std::string(fn) + ": stream is NULL"));
  if (!s->engine)
    return fail(Status(StatusCode::kInvalidArgument, std::string(fn) + ": the stream's engine was destroyed"));
  return guarded(s->engine, fn, std::forward<Fn>(body));
}

// The engine's DeviceStream for a stream argument, refusing another engine's.
inline Result<DeviceStream*> stream_arg(strata_engine* e, strata_stream* s) {
  if (!s) return Status(StatusCode::kInvalidArgument, "stream is NULL");
  if (!s->engine) return Status(StatusCode::kInvalidArgument, "the stream's engine was destroyed");
  if (s->engine != e)
    return Status(StatusCode::kInvalidArgument,
                  "stream '" + s->stream->name() + "' belongs to another engine");
  return s->stream;
}

inline Status check_param(const Engine& e, uint32_t p) {
  if (p >= e.model().params.size())
    return Status(StatusCode::kInvalidArgument, "parameter id " + std::to_string(p) + " out of range (the model has " +
                                                    std::to_string(e.model().params.size()) + ")");
  return Status();
}

inline Status check_group(const Engine& e, uint32_t g) {
  if (g >= e.group_count())
    return Status(StatusCode::kInvalidArgument, "group id " + std::to_string(g) + " out of range (the model has " +
                                                    std::to_string(e.group_count()) + " groups)");
  return Status();
}


// dlpack_api.cpp: gives back the DLPack gradients the engine has read (all:
// waits for every one; at strata_engine_step, discard_step and destroy).
Status dlpack_collect(strata_engine* e, bool all);
void dlpack_drop_all(strata_engine* e);  // destroy: give back without waiting for a dead stream

}  // namespace strata::capi
