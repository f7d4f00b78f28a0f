// strata.hpp: a thin, header-only C++17 layer over the C ABI (strata.h).
//
// What it adds: unique ownership of handles (Engine, Stream, CpuOptimizer
// destroy themselves; move-only), std::string in and out, and an Error value
// that carries the status code and its message together. What it does not
// add: behaviour. Every method is one C call; the documentation of that
// call in strata.h (ownership, blocking, threads, statuses) applies as is.
//
// No exceptions: Strata's C++ code does not use them across modules and a
// trainer may build with -fno-exceptions, so every fallible method returns an
// Error (ok() on success), marked [[nodiscard]], and writes its outputs only
// on success. The message is captured at the failing call (from this
// thread's strata_last_error()), so it stays true after later calls.
//
// The classes live in namespace strata::api, not strata: the library's
// internal C++ classes (strata::Engine, ...) use that namespace, and a
// program that links both must not see two classes of the same name.
//
// Destruction order: a Stream should be destroyed before its Engine; one
// that outlives it is dead (strata_engine_destroy) and its destructor only
// frees the handle, so either order is safe.
//
// Only strata.h is included: this header compiles against the installed C
// API with no internal header.
#ifndef STRATA_STRATA_HPP_
#define STRATA_STRATA_HPP_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "strata/strata.h"

namespace strata::api {

// A status code and, when it is not STRATA_OK, the message of the failure.
class [[nodiscard]] Error {
 public:
  Error() = default;
  Error(strata_status_t code, std::string message) : code_(code), message_(std::move(message)) {}
  // The Error of a C call that returned `code`: the thread's last error text.
  static Error from(strata_status_t code) {
    if (code == STRATA_OK) return Error();
    return Error(code, strata_last_error());
  }

  bool ok() const { return code_ == STRATA_OK; }
  strata_status_t code() const { return code_; }
  const std::string& message() const { return message_; }
  // "STRATA_OK" or "STRATA_ERR_IO: <message>".
  std::string to_string() const {
    std::string s = strata_status_string(code_);
    if (!ok()) s += ": " + message_;
    return s;
  }

 private:
  strata_status_t code_ = STRATA_OK;
  std::string message_;
};

class Engine;

// A device stream of an engine (strata_stream_create / strata_stream_wrap).
class Stream {
 public:
  Stream() = default;
  explicit Stream(strata_stream_t s) : s_(s) {}  // takes ownership
  ~Stream() { (void)reset(); }
  Stream(Stream&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  Stream& operator=(Stream&& o) noexcept {
    if (this != &o) {
      (void)reset();
      s_ = std::exchange(o.s_, nullptr);
    }
    return *this;
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  strata_stream_t get() const { return s_; }
  explicit operator bool() const { return s_ != nullptr; }
  // Gives up ownership without destroying.
  strata_stream_t release() { return std::exchange(s_, nullptr); }
  // Destroys the stream now (blocking until its work is done) and returns
  // its pending asynchronous error; the destructor drops that error.
  Error reset() { return Error::from(strata_stream_destroy(std::exchange(s_, nullptr))); }
  Error synchronize() const { return Error::from(strata_stream_synchronize(s_)); }
  Error memcpy_async(void* dst, const void* src, size_t bytes, strata_copy_kind_t kind) const {
    return Error::from(strata_memcpy_async(dst, src, bytes, kind, s_));
  }

 private:
  strata_stream_t s_ = nullptr;
};

// An offload engine (strata_engine_*).
class Engine {
 public:
  Engine() = default;
  explicit Engine(strata_engine_t e) : e_(e) {}  // takes ownership
  ~Engine() { strata_engine_destroy(e_); }
  Engine(Engine&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  Engine& operator=(Engine&& o) noexcept {
    if (this != &o) {
      strata_engine_destroy(e_);
      e_ = std::exchange(o.e_, nullptr);
    }
    return *this;
  }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Options with defaults and struct_size set (strata_engine_options_init).
  static strata_engine_options_t default_options() {
    strata_engine_options_t o{};
    (void)strata_engine_options_init(&o);
    return o;
  }
  // A parameter description with struct_size set.
  static strata_param_desc_t param(const char* name, const char* group, std::initializer_list<uint64_t> shape,
                                   strata_dtype_t dtype) {
    strata_param_desc_t d{};
    d.struct_size = sizeof(d);
    d.name = name;
    d.group = group;
    for (uint64_t dim : shape) {
      if (d.ndim == STRATA_MAX_DIMS) {
        d.ndim = STRATA_MAX_DIMS + 1;  // refused by create(), naming the parameter
        break;
      }
      d.shape[d.ndim++] = dim;
    }
    d.dtype = dtype;
    return d;
  }
  static Error create(const strata_engine_options_t& options, const strata_param_desc_t* params, size_t count,
                      Engine* out) {
    strata_engine_t e = nullptr;
    Error err = Error::from(strata_engine_create(&options, params, count, &e));
    if (err.ok()) *out = Engine(e);
    return err;
  }

  strata_engine_t get() const { return e_; }
  explicit operator bool() const { return e_ != nullptr; }
  strata_engine_t release() { return std::exchange(e_, nullptr); }
  const char* last_error() const { return strata_engine_last_error(e_); }

  // ---- the model
  Error param_count(uint32_t* n) const { return Error::from(strata_engine_param_count(e_, n)); }
  Error group_count(uint32_t* n) const { return Error::from(strata_engine_group_count(e_, n)); }
  Error find_param(const char* name, uint32_t* id) const { return Error::from(strata_engine_find_param(e_, name, id)); }
  Error find_group(const char* name, uint32_t* id) const { return Error::from(strata_engine_find_group(e_, name, id)); }
  Error param_info(uint32_t p, strata_param_info_t* info) const {
    info->struct_size = sizeof(*info);
    return Error::from(strata_engine_param_info(e_, p, info));
  }
  Error group_info(uint32_t g, strata_group_info_t* info) const {
    info->struct_size = sizeof(*info);
    return Error::from(strata_engine_group_info(e_, g, info));
  }
  Error group_params(uint32_t g, uint32_t* params, size_t capacity, size_t* count) const {
    return Error::from(strata_engine_group_params(e_, g, params, capacity, count));
  }
  Error device(strata_device_kind_t* kind, std::string* name) const {
    const char* n = nullptr;
    Error err = Error::from(strata_engine_device(e_, kind, &n));
    if (err.ok()) *name = n;
    return err;
  }
  Error plan_report(std::string* text) const {
    char* t = nullptr;
    Error err = Error::from(strata_engine_plan_report(e_, &t));
    if (err.ok()) {
      *text = t;
      strata_free(t);
    }
    return err;
  }

  // ---- values
  Error load_param(uint32_t p, const void* src, strata_dtype_t dtype, size_t count) {
    return Error::from(strata_engine_load_param(e_, p, src, dtype, count));
  }
  Error read_param(uint32_t p, void* dst, strata_dtype_t dtype, size_t count) {
    return Error::from(strata_engine_read_param(e_, p, dst, dtype, count));
  }
  // Root's bytes on every rank (a collective): strata_engine_broadcast.
  Error broadcast(void* data, size_t bytes, uint32_t root) {
    return Error::from(strata_engine_broadcast(e_, data, bytes, root));
  }

  // ---- the training protocol
  Error begin_micro_batch(bool last) { return Error::from(strata_engine_begin_micro_batch(e_, last ? 1 : 0)); }
  Error acquire(uint32_t g, const Stream& s, void** ptrs, size_t capacity, size_t* count) {
    return Error::from(strata_engine_acquire(e_, g, s.get(), ptrs, capacity, count));
  }
  Error release(uint32_t g, const Stream& s) { return Error::from(strata_engine_release(e_, g, s.get())); }
  Error reduce_grad(uint32_t p, const void* grad, strata_dtype_t dtype, const Stream& s) {
    return Error::from(strata_engine_reduce_grad(e_, p, grad, dtype, s.get()));
  }
  // Abandons the step in progress (strata_engine_discard_step); s may be a
  // null stream when no group is acquired.
  Error discard_step(strata_stream_t s = nullptr) { return Error::from(strata_engine_discard_step(e_, s)); }
  // Waits for a pipelined step's updates; their error (strata_engine_synchronize).
  Error synchronize() { return Error::from(strata_engine_synchronize(e_)); }
  // lr < 0 keeps the config's learning rate. `result` may be null.
  Error step(double lr = -1, strata_step_result_t* result = nullptr) {
    if (result) result->struct_size = sizeof(*result);
    return Error::from(strata_engine_step(e_, lr, result));
  }
  Error loss_scale(double* scale) const { return Error::from(strata_engine_loss_scale(e_, scale)); }
  Error step_count(int64_t* steps) const { return Error::from(strata_engine_step_count(e_, steps)); }

  // ---- checkpoints
  Error save_checkpoint(const std::string& dir, const std::string& extra_json = {}) {
    return Error::from(strata_engine_save_checkpoint(e_, dir.c_str(), extra_json.c_str()));
  }
  // `extra_json` may be null.
  Error load_checkpoint(const std::string& dir, std::string* extra_json = nullptr) {
    char* extra = nullptr;
    Error err = Error::from(strata_engine_load_checkpoint(e_, dir.c_str(), extra_json ? &extra : nullptr));
    if (err.ok() && extra_json) *extra_json = extra;
    strata_free(extra);
    return err;
  }

  // ---- observability
  Error stats(strata_engine_stats_t* s) const {
    s->struct_size = sizeof(*s);
    return Error::from(strata_engine_stats(e_, s));
  }
  Error trace_begin(const char* name) { return Error::from(strata_engine_trace_begin(e_, name)); }
  Error trace_end() { return Error::from(strata_engine_trace_end(e_)); }

  // ---- streams and device memory
  Error create_stream(const char* name, Stream* out) {
    strata_stream_t s = nullptr;
    Error err = Error::from(strata_stream_create(e_, name, &s));
    if (err.ok()) *out = Stream(s);
    return err;
  }
  Error wrap_stream(void* native, Stream* out) {
    strata_stream_t s = nullptr;
    Error err = Error::from(strata_stream_wrap(e_, native, &s));
    if (err.ok()) *out = Stream(s);
    return err;
  }
  Error device_alloc(size_t bytes, void** ptr) { return Error::from(strata_device_alloc(e_, bytes, ptr)); }
  Error device_free(void* ptr, const Stream* after = nullptr) {
    return Error::from(strata_device_free(e_, ptr, after ? after->get() : nullptr));
  }

 private:
  strata_engine_t e_ = nullptr;
};

// The CPU optimizer executor (strata_cpu_optimizer_*).
class CpuOptimizer {
 public:
  CpuOptimizer() = default;
  explicit CpuOptimizer(strata_cpu_optimizer_t o) : o_(o) {}  // takes ownership
  ~CpuOptimizer() { strata_cpu_optimizer_destroy(o_); }
  CpuOptimizer(CpuOptimizer&& o) noexcept : o_(std::exchange(o.o_, nullptr)) {}
  CpuOptimizer& operator=(CpuOptimizer&& o) noexcept {
    if (this != &o) {
      strata_cpu_optimizer_destroy(o_);
      o_ = std::exchange(o.o_, nullptr);
    }
    return *this;
  }
  CpuOptimizer(const CpuOptimizer&) = delete;
  CpuOptimizer& operator=(const CpuOptimizer&) = delete;

  static Error create(strata_isa_t isa, int threads, CpuOptimizer* out) {
    strata_cpu_optimizer_t o = nullptr;
    Error err = Error::from(strata_cpu_optimizer_create(isa, threads, &o));
    if (err.ok()) *out = CpuOptimizer(o);
    return err;
  }
  strata_cpu_optimizer_t get() const { return o_; }
  // The C call records its message on the handle, not the thread.
  Error step(const strata_optimizer_config_t& config, int64_t step, const strata_optimizer_buffers_t& buffers,
             size_t count) {
    strata_status_t rc = strata_cpu_optimizer_step(o_, &config, step, &buffers, count);
    if (rc == STRATA_OK) return Error();
    return Error(rc, o_ ? strata_cpu_optimizer_last_error(o_) : strata_last_error());
  }

 private:
  strata_cpu_optimizer_t o_ = nullptr;
};

}  // namespace strata::api

#endif  // STRATA_STRATA_HPP_
