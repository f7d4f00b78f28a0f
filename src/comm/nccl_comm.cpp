#include "comm/nccl_comm.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "strata/strata_config.h"

#if STRATA_HAVE_NCCL

#include "common/threads.h"
#include "cuda/nccl/nccl_module_abi.h"
#include "device/cuda_backend.h"
#include "device/cuda_loader.h"
#include "device/cuda_status.h"
#endif

namespace strata::comm {

bool nccl_backend_built() { return STRATA_HAVE_NCCL != 0; }

#if !STRATA_HAVE_NCCL

Result<std::unique_ptr<Communicator>> create_nccl_communicator(DeviceBackend*, const NcclCommOptions&) {
  return Status(StatusCode::kUnavailable,
                "the NCCL communicator is not in this build (configured without CUDA or NCCL, or STRATA_NCCL=OFF; "
                "install the CUDA toolkit and NCCL and reconfigure)");
}

#else

namespace {

using Clock = std::chrono::steady_clock;
constexpr const char* kModuleName = "libstrata_nccl.so";

struct Err {
  char text[1024] = {0};
};

// A module code as a Status (cuda/nccl/nccl_module_abi.h's codes).
Status nccl_status(int rc, const char* text, const std::string& what) {
  const std::string t = text && text[0] ? text : "error " + std::to_string(rc);
  if (rc == STRATA_NCCL_ERR_TIMEOUT) return Status(StatusCode::kUnavailable, what + " failed: " + t);
  if (rc == STRATA_NCCL_ERR_CANCELLED) return Status(StatusCode::kCancelled, what + ": " + t);
  if (rc >= STRATA_NCCL_ERR_BASE && rc < STRATA_NCCL_ERR_TIMEOUT) {
    const int r = rc - STRATA_NCCL_ERR_BASE;  // ncclResult_t
    // 2 ncclSystemError, 6 ncclRemoteError: a peer or the network; 4
    // ncclInvalidArgument, 5 ncclInvalidUsage: the call.
    const StatusCode code = r == 2 || r == 6   ? StatusCode::kUnavailable
                            : r == 4 || r == 5 ? StatusCode::kInvalidArgument
                                               : StatusCode::kInternal;
    return Status(code, what + " failed: " + t);
  }
  return cuda_module_status(rc, text, what);
}

Result<const strata_nccl_api_v2_t*> load_once() {
  auto m = load_cuda_sibling_module(kModuleName, STRATA_NCCL_API_SYMBOL, "STRATA_NCCL_MODULE");
  if (!m.ok()) return Status(m.status().code(), "NCCL module not loadable: " + m.status().message());
  const strata_nccl_api_v2_t* api = reinterpret_cast<strata_nccl_api_v2_fn>(m->symbol)();
  if (!api || api->abi_version != STRATA_NCCL_ABI_VERSION || api->struct_size < sizeof(strata_nccl_api_v2_t))
    return Status(StatusCode::kUnavailable, m->path + " speaks another NCCL module ABI version; rebuild Strata");
  return api;
}

Result<const strata_nccl_api_v2_t*> load_module() {
  static std::once_flag once;
  static Result<const strata_nccl_api_v2_t*> result = Status(StatusCode::kInternal, "not loaded");
  std::call_once(once, [] { result = load_once(); });
  return result;
}

// NcclCommOptions::cancel as the module's stop request (ctx: the callable).
int stop_requested(void* ctx) { return (*static_cast<const std::function<bool()>*>(ctx))() ? 1 : 0; }

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(DeviceBackend* dev, const strata_nccl_api_v2_t* api, int device, const NcclCommOptions& o)
      : dev_(dev), api_(api), device_(device), rank_(o.rank), world_(o.world_size), timeout_s_(o.timeout_s) {}

  ~NcclCommunicator() override {
    {
      // The last collectives finish (or the watchdog ends them) before the
      // watchdog goes: a stream synchronize below must not wait forever.
      std::unique_lock<std::mutex> lock(mu_);
      while (!pending_.empty() && broken_.ok() && watchdog_.joinable())
        cv_.wait_for(lock, std::chrono::milliseconds(10));
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    if (stream_) (void)dev_->synchronize(stream_);
    if (comm_) {
      Err err;
      const int rc = api_->comm_finalize_destroy(device_, comm_, timeout_s_, err.text, sizeof(err.text));
      (void)rc;  // aborted inside on failure; nothing more to do in a destructor
    }
    for (DeviceEvent* e : free_events_) dev_->destroy_event(e);
    for (auto& p : pending_) {
      dev_->destroy_event(p.started);
      dev_->destroy_event(p.done);
    }
    for (DeviceEvent* e : {ev_in_, ev_out_})
      if (e) dev_->destroy_event(e);
    if (scratch_) (void)dev_->free(scratch_);
    if (stream_) (void)dev_->destroy_stream(stream_);
  }

  // A child of the caller's communicator; then init(nullptr, ...). `stop`:
  // the caller's stop request (null: none), polled while the ranks join.
  Status split(void* parent, const strata_nccl_stop_t* stop) {
    Err err;
    const int rc =
        api_->comm_split(device_, parent, timeout_s_, stop, &comm_, &world_, &rank_, err.text, sizeof(err.text));
    if (rc != 0) return nccl_status(rc, err.text, "nccl communicator: splitting the caller's communicator");
    return {};
  }

  // id: rank 0's unique id to join with, or null when split() made comm_.
  Status init(const uint8_t* id, std::size_t scratch_bytes, const strata_nccl_stop_t* stop) {
    STRATA_ASSIGN_OR_RETURN(stream_, dev_->create_stream("nccl"));
    STRATA_ASSIGN_OR_RETURN(CudaNativeStream ns, cuda_native_stream(stream_));
    native_ = ns.stream;
    STRATA_ASSIGN_OR_RETURN(ev_in_, dev_->create_event());
    STRATA_ASSIGN_OR_RETURN(ev_out_, dev_->create_event());
    // Scratch: world x chunk floats for the sums, plus one float for barriers.
    const std::size_t bytes = std::max<std::size_t>(scratch_bytes ? scratch_bytes : kNcclDefaultScratch,
                                                     (static_cast<std::size_t>(world_) + 1) * 256 * sizeof(float));
    STRATA_ASSIGN_OR_RETURN(void* s, dev_->alloc(bytes));
    scratch_ = static_cast<float*>(s);
    chunk_ = (bytes / sizeof(float) - 1) / static_cast<std::size_t>(world_);
    barrier_flag_ = scratch_ + chunk_ * world_;
    if (id != nullptr) {
      Err err;
      const int rc =
          api_->comm_init(device_, id, world_, rank_, timeout_s_, stop, &comm_, err.text, sizeof(err.text));
      if (rc != 0)
        return nccl_status(rc, err.text, fmt::format("nccl communicator: joining rank {} of {}", rank_, world_));
    }
    return start_thread(watchdog_, "nccl communicator: cannot start its watchdog thread", [this] { watchdog_main(); });
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  const char* backend_name() const override { return "nccl"; }
  DeviceBackend* device() const override { return dev_; }

  Status all_gather(const void* send, void* recv, std::size_t bytes, DeviceStream* stream) override {
    if (bytes > 0 && (send == nullptr || recv == nullptr))
      return Status(StatusCode::kInvalidArgument, "all_gather: null buffer");
    const char* own = static_cast<const char*>(recv) + static_cast<std::size_t>(rank_) * bytes;
    const char* s = static_cast<const char*>(send);
    const char* r = static_cast<const char*>(recv);
    if (s != own && s < r + bytes * world_ && r < s + bytes)
      return Status(StatusCode::kInvalidArgument, "all_gather: send overlaps recv other than at this rank's slot");
    return run("all_gather", stream, [&]() -> Status {
      Err err;
      const int rc = api_->all_gather(device_, comm_, send, recv, bytes, native_, timeout_s_, err.text,
                                        sizeof(err.text));
      return rc == 0 ? Status() : nccl_status(rc, err.text, "ncclAllGather");
    });
  }

  Status reduce_scatter(const float* send, float* recv, std::size_t count, DeviceStream* stream) override {
    if (count > 0 && (send == nullptr || recv == nullptr))
      return Status(StatusCode::kInvalidArgument, "reduce_scatter: null buffer");
    if (count > 0 && recv < send + count * world_ && send < recv + count)
      return Status(StatusCode::kInvalidArgument, "reduce_scatter: recv overlaps send");
    return run("reduce_scatter", stream, [&]() -> Status {
      for (std::size_t c0 = 0; c0 < count; c0 += chunk_) {
        const std::size_t n = std::min(chunk_, count - c0);
        xfers_.clear();
        for (int j = 0; j < world_; ++j)
          xfers_.push_back(xfer(j, send + static_cast<std::size_t>(j) * count + c0, n, scratch_ + j * n, n));
        STRATA_RETURN_IF_ERROR(exchange());
        STRATA_RETURN_IF_ERROR(sum_into(recv + c0, n, n));
      }
      return Status();
    });
  }

  Status all_reduce(const float* send, float* recv, std::size_t count, DeviceStream* stream) override {
    if (count > 0 && (send == nullptr || recv == nullptr))
      return Status(StatusCode::kInvalidArgument, "all_reduce: null buffer");
    if (count > 0 && send != recv && recv < send + count && send < recv + count)
      return Status(StatusCode::kInvalidArgument, "all_reduce: send and recv overlap (in place is send == recv)");
    // communicator.h's split: chunk r = [r*count/N, (r+1)*count/N), summed by rank r.
    auto begin = [&](int r) { return static_cast<std::size_t>(r) * count / static_cast<std::size_t>(world_); };
    auto len = [&](int r) { return begin(r + 1) - begin(r); };
    std::size_t longest = 0;
    for (int r = 0; r < world_; ++r) longest = std::max(longest, len(r));
    return run("all_reduce", stream, [&]() -> Status {
      // Sub-ranges [o, o + chunk_) of every rank's chunk, in step.
      for (std::size_t o = 0; o < longest; o += chunk_) {
        auto part = [&](int r) { return len(r) > o ? std::min(chunk_, len(r) - o) : std::size_t{0}; };
        const std::size_t mine = part(rank_);
        xfers_.clear();
        for (int j = 0; j < world_; ++j)
          xfers_.push_back(xfer(j, send + begin(j) + o, part(j), scratch_ + j * chunk_, mine));
        STRATA_RETURN_IF_ERROR(exchange());
        if (mine > 0) STRATA_RETURN_IF_ERROR(sum_into(recv + begin(rank_) + o, mine, chunk_));
        xfers_.clear();
        for (int j = 0; j < world_; ++j)
          if (j != rank_) xfers_.push_back(xfer(j, recv + begin(rank_) + o, mine, recv + begin(j) + o, part(j)));
        STRATA_RETURN_IF_ERROR(exchange());
      }
      return Status();
    });
  }

  Status broadcast(void* data, std::size_t bytes, int root, DeviceStream* stream) override {
    if (root < 0 || root >= world_)
      return Status(StatusCode::kInvalidArgument, fmt::format("broadcast: root {} of a world of {}", root, world_));
    if (data == nullptr && bytes > 0) return Status(StatusCode::kInvalidArgument, "broadcast: null buffer");
    return run("broadcast", stream, [&]() -> Status {
      Err err;
      const int rc = api_->broadcast(device_, comm_, data, bytes, root, native_, timeout_s_, err.text,
                                       sizeof(err.text));
      return rc == 0 ? Status() : nccl_status(rc, err.text, "ncclBroadcast");
    });
  }

  Status barrier(DeviceStream* stream) override {
    return run("barrier", stream, [&]() -> Status {
      Err err;
      const int rc = api_->all_reduce_unordered(device_, comm_, barrier_flag_, barrier_flag_, 1, native_, timeout_s_,
                                                err.text, sizeof(err.text));
      return rc == 0 ? Status() : nccl_status(rc, err.text, "ncclAllReduce (barrier)");
    });
  }

 private:
  struct Pending {
    DeviceEvent* started = nullptr;  // comm stream: the caller's work before it is done
    DeviceEvent* done = nullptr;     // comm stream: the collective is done
    uint64_t seq = 0;
    const char* what = "";
    Clock::time_point running_since{};  // when the watchdog first saw `started` (epoch: not yet)
  };
  // The first failure, shared with the host functions on callers' streams
  // (which may run after this communicator is gone).
  struct ErrState {
    std::mutex mu;
    Status first;
    uint64_t failed_seq = 0;
  };

  static strata_nccl_xfer_t xfer(int peer, const float* send, std::size_t send_n, float* recv, std::size_t recv_n) {
    strata_nccl_xfer_t x{};
    x.peer = peer;
    x.send = send;
    x.send_bytes = send_n * sizeof(float);
    x.recv = recv;
    x.recv_bytes = recv_n * sizeof(float);
    return x;
  }

  // mu_ held: one group of sends and receives (xfers_) on the comm stream.
  Status exchange() {
    Err err;
    const int rc = api_->exchange(device_, comm_, xfers_.data(), static_cast<int>(xfers_.size()), native_,
                                  timeout_s_, err.text, sizeof(err.text));
    return rc == 0 ? Status() : nccl_status(rc, err.text, "ncclSend/ncclRecv");
  }

  // mu_ held: out[0, n) = part_0 + part_1 + ... (rank order) of the parts
  // at scratch_ + r * stride, on the comm stream.
  Status sum_into(float* out, std::size_t n, std::size_t stride) {
    STRATA_RETURN_IF_ERROR(dev_->copy_async(out, scratch_, n * sizeof(float), CopyKind::kDeviceToDevice, stream_));
    for (int r = 1; r < world_; ++r)
      STRATA_RETURN_IF_ERROR(dev_->accumulate_async(out, scratch_ + r * stride, DType::kF32, n, 1.0f, stream_));
    return Status();
  }

  // mu_ held: an event from the free list (or a new one).
  Result<DeviceEvent*> take_event() {
    if (!free_events_.empty()) {
      DeviceEvent* e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
    return dev_->create_event();
  }

  // The collective's frame: refuse once broken; order the comm stream after
  // the caller's, enqueue, hand the watchdog its events, order the caller's
  // stream after the comm stream (on failure too: whatever was enqueued
  // must be done before the caller reuses its buffers), and report a failure
  // on the caller's stream.
  template <typename Body>
  Status run(const char* what, DeviceStream* stream, Body&& body) {
    if (stream == nullptr) return Status(StatusCode::kInvalidArgument, fmt::format("{}: null stream", what));
    if (stream->owner() != dev_)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("{}: stream '{}' belongs to another device backend than the communicator's", what,
                                stream->name()));
    std::unique_lock<std::mutex> lock(mu_);
    if (!broken_.ok()) return broken_status();
    const uint64_t seq = ++seq_;
    Status st = dev_->record(ev_in_, stream);
    if (st.ok()) st = dev_->wait(stream_, ev_in_);
    if (!st.ok()) return st.with_context(where(what, seq));  // nothing enqueued: the communicator is fine
    Pending pend{nullptr, nullptr, seq, what, {}};
    auto started = take_event();
    st = started.status();
    if (st.ok()) {
      pend.started = *started;
      st = dev_->record(pend.started, stream_);
    }
    if (st.ok()) st = body();
    if (st.ok()) {
      auto done = take_event();
      st = done.status();
      if (st.ok()) {
        pend.done = *done;
        st = dev_->record(pend.done, stream_);
      }
    }
    Status out = dev_->record(ev_out_, stream_);
    if (out.ok()) out = dev_->wait(stream, ev_out_);
    if (st.ok()) st = out;
    if (!st.ok()) {
      // Part of the collective may be enqueued: the ranks no longer agree on
      // what runs next. Nothing after it can be trusted.
      for (DeviceEvent* e : {pend.started, pend.done})
        if (e) free_events_.push_back(e);
      const Status failed = st.with_context(where(what, seq));
      void* doomed = break_locked(failed, seq);
      lock.unlock();
      abort(doomed);
      return failed;
    }
    pending_.push_back(pend);
    lock.unlock();
    cv_.notify_all();
    std::shared_ptr<ErrState> es = err_;
    st = dev_->host_func_async(stream, [es, seq]() -> Status {
      std::lock_guard<std::mutex> l(es->mu);
      return !es->first.ok() && seq >= es->failed_seq ? es->first : Status();
    });
    return st.ok() ? st : st.with_context(where(what, seq));
  }

  std::string where(const char* what, uint64_t seq) const {
    return fmt::format("{} #{} on rank {} of {} (nccl)", what, seq, rank_, world_);
  }

  Status broken_status() const {
    std::lock_guard<std::mutex> l(err_->mu);
    return Status(err_->first.code(), "communicator broken by an earlier failure: " + err_->first.message());
  }

  // mu_ held. The first failure wins: collective `seq` and every later one
  // fail. Returns the NCCL communicator to abort (after unlocking mu_:
  // ncclCommAbort can take long) or null.
  void* break_locked(const Status& why, uint64_t seq) {
    {
      std::lock_guard<std::mutex> l(err_->mu);
      if (!err_->first.ok()) return nullptr;
      err_->first = why;
      err_->failed_seq = seq;
    }
    broken_ = why;
    void* c = comm_;
    comm_ = nullptr;
    return c;
  }

  // ncclCommAbort: the NCCL kernels of uncompleted collectives return.
  void abort(void* c) {
    if (c == nullptr) return;
    Err err;
    (void)api_->comm_abort(device_, c, err.text, sizeof(err.text));
  }

  void watchdog_main() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(pending_.empty() ? 200 : 10));
      if (stop_ || !broken_.ok()) continue;
      const Clock::time_point now = Clock::now();
      // Completed collectives leave in order (one stream).
      while (!pending_.empty()) {
        auto q = dev_->query(pending_.front().done);
        if (!q.ok() || !*q) break;
        for (DeviceEvent* e : {pending_.front().started, pending_.front().done}) free_events_.push_back(e);
        pending_.pop_front();
      }
      // The clock of the oldest runs from when it could start: the caller's
      // work before it and the collectives before it done.
      if (!pending_.empty() && pending_.front().running_since == Clock::time_point{}) {
        auto q = dev_->query(pending_.front().started);
        if (q.ok() && *q) pending_.front().running_since = now;
      }
      int state = 0;
      Err err;
      const int rc = api_->comm_async_error(comm_, &state, err.text, sizeof(err.text));
      const uint64_t first = pending_.empty() ? seq_ + 1 : pending_.front().seq;
      const char* what = pending_.empty() ? "next collective" : pending_.front().what;
      void* doomed = nullptr;
      if (rc != 0 || (state != 0 && state != 7)) {
        const Status s = rc != 0 ? nccl_status(rc, err.text, "ncclCommGetAsyncError")
                                 : nccl_status(STRATA_NCCL_ERR_BASE + state, err.text, "NCCL");
        doomed = break_locked(Status(s.code(), where(what, first) + ": " + s.message()), first);
      } else if (!pending_.empty() && pending_.front().running_since != Clock::time_point{} &&
                 std::chrono::duration<double>(now - pending_.front().running_since).count() > timeout_s_) {
        doomed = break_locked(Status(StatusCode::kUnavailable,
                                     fmt::format("{}: timed out after {:.0f} s (a peer died, hangs, or called other "
                                                 "collectives; NCCL does not say which)",
                                                 where(what, first), timeout_s_)),
                              first);
      }
      if (doomed) {
        lock.unlock();
        abort(doomed);
        lock.lock();
      }
    }
  }

  DeviceBackend* dev_;
  const strata_nccl_api_v2_t* api_;
  const int device_;
  int rank_, world_;  // constant once init() returned (split() sets them)
  const double timeout_s_;

  DeviceStream* stream_ = nullptr;  // the comm stream
  void* native_ = nullptr;          // its cudaStream_t
  float* scratch_ = nullptr;        // world_ x chunk_ floats, then the barrier's float
  float* barrier_flag_ = nullptr;
  std::size_t chunk_ = 0;

  // mu_: the NCCL communicator and everything enqueued through it (calls,
  // the watchdog, abort), and the state below.
  std::mutex mu_;
  std::condition_variable cv_;
  void* comm_ = nullptr;  // ncclComm_t; null once aborted
  DeviceEvent* ev_in_ = nullptr;
  DeviceEvent* ev_out_ = nullptr;
  std::vector<strata_nccl_xfer_t> xfers_;
  std::deque<Pending> pending_;
  std::vector<DeviceEvent*> free_events_;
  uint64_t seq_ = 0;
  Status broken_;
  bool stop_ = false;
  std::thread watchdog_;

  // Read by the host functions on CUDA's callback thread, which must not wait
  // for mu_ (a call holding mu_ may be waiting in CUDA) and may outlive this
  // object.
  std::shared_ptr<ErrState> err_ = std::make_shared<ErrState>();
};

}  // namespace

Result<std::unique_ptr<Communicator>> create_nccl_communicator(DeviceBackend* device, const NcclCommOptions& o) {
  if (device == nullptr) return Status(StatusCode::kInvalidArgument, "nccl communicator: null device backend");
  if (device->kind() != DeviceKind::kCuda)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("nccl communicator: needs the CUDA device backend (got {}); host ranks use mpi",
                              device->name()));
  if (o.parent == nullptr && (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("nccl communicator: rank {} of a world of {}", o.rank, o.world_size));
  if (!(o.timeout_s > 0))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("nccl communicator: timeout_s must be > 0 (got {})", o.timeout_s));
  if (o.parent == nullptr && o.world_size > 1 && !o.share_id)
    return Status(StatusCode::kInvalidArgument,
                  "nccl communicator: N ranks need a way to share rank 0's NCCL id (share_id)");
  // NCCL_COMM_BLOCKING=1 overrides the non-blocking config: every call could
  // then wait on a dead peer forever, past any timeout.
  if (const char* b = std::getenv("NCCL_COMM_BLOCKING"); b && std::string(b) != "0")
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("nccl communicator: NCCL_COMM_BLOCKING={} makes NCCL calls block, which would let a "
                              "dead peer hang this rank past every timeout; unset it",
                              b));
  auto loaded = load_module();
  if (!loaded.ok()) {
    // Rank 0 of N ranks that meet through share_id: the others wait for its
    // NCCL id, so they hear why there is none (as from a failing maker)
    // instead of waiting out their timeout.
    if (o.parent == nullptr && o.world_size > 1 && o.rank == 0) {
      const Status why = loaded.status();
      (void)o.share_id([&why]() -> Result<std::vector<uint8_t>> { return why; });
    }
    return loaded.status();
  }
  const strata_nccl_api_v2_t* api = *loaded;
  const strata_nccl_stop_t stop_request{stop_requested, const_cast<std::function<bool()>*>(&o.cancel)};
  const strata_nccl_stop_t* stop = o.cancel ? &stop_request : nullptr;
  if (o.parent != nullptr) {
    auto c = std::make_unique<NcclCommunicator>(device, api, device->ordinal(), o);
    STRATA_RETURN_IF_ERROR(c->split(o.parent, stop));
    STRATA_RETURN_IF_ERROR(c->init(nullptr, o.scratch_bytes, stop));
    return std::unique_ptr<Communicator>(std::move(c));
  }
  std::vector<uint8_t> id(STRATA_NCCL_UNIQUE_ID_BYTES);
  // Rank 0's id, made when the side channel is ready (ShareBlob).
  const BlobMaker make_id = [api]() -> Result<std::vector<uint8_t>> {
    std::vector<uint8_t> made(STRATA_NCCL_UNIQUE_ID_BYTES);
    Err err;
    const int rc = api->unique_id(made.data(), err.text, sizeof(err.text));
    if (rc != 0) return nccl_status(rc, err.text, "nccl communicator: ncclGetUniqueId");
    return made;
  };
  if (o.world_size == 1) {
    STRATA_ASSIGN_OR_RETURN(id, make_id());
  } else {
    auto shared = o.share_id(make_id);
    if (!shared.ok()) return shared.status().with_context("nccl communicator: sharing rank 0's NCCL id");
    if (shared->size() != id.size())
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("nccl communicator: rank 0's NCCL id has {} bytes, expected {}", shared->size(),
                                id.size()));
    id = std::move(*shared);
  }
  auto c = std::make_unique<NcclCommunicator>(device, api, device->ordinal(), o);
  STRATA_RETURN_IF_ERROR(c->init(id.data(), o.scratch_bytes, stop));
  return std::unique_ptr<Communicator>(std::move(c));
}

#endif  // STRATA_HAVE_NCCL

}  // namespace strata::comm
