#include "runtime/nvme_optimizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "common/threads.h"
#include "common/units.h"

namespace strata {

namespace {
constexpr std::size_t kAlign = 4096;
constexpr std::size_t kChunkQuantum = 2048;  // elements: 2-byte arrays stay 4 KiB aligned
constexpr const char* kArrayNames[] = {"master", "state0", "state1", "state2", "grads", "params_out"};
std::size_t round_up(std::size_t v, std::size_t a) { return (v + a - 1) / a * a; }
}  // namespace


Result<std::unique_ptr<NvmeOptimizer>> NvmeOptimizer::create(io::SwapStore* store, io::PinnedPool& pool,
                                                             const cpu_optim::OptimizerConfig& config,
                                                             const NvmeOptimizerOptions& o) {
  if (o.ring_buffers < 2 || o.ring_buffers > 64)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("nvme optimizer: ring_buffers {} (offload_optimizer.buffer_count): expected 2..64",
                              o.ring_buffers));
  if (o.chunk_elems == 0 || o.chunk_elems > (std::size_t{1} << 32))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("nvme optimizer: chunk_elems {}: expected 1..2^32", o.chunk_elems));
  if (o.state_dtype != DType::kF32 && o.state_dtype != DType::kBF16)
    return Status(StatusCode::kInvalidArgument, "nvme optimizer: state_dtype must be fp32 or bf16");
  if (o.out_dtype != DType::kBF16 && o.out_dtype != DType::kF16)
    return Status(StatusCode::kInvalidArgument, "nvme optimizer: out_dtype must be bf16 or fp16");
  const int nstates = cpu_optim::state_count(config);
  std::unique_ptr<NvmeOptimizer> opt(new NvmeOptimizer(store, o, nstates));
  opt->chunk_ = round_up(o.chunk_elems, kChunkQuantum);
  std::size_t off[kArrays];
  std::size_t total = 0;
  for (int a = 0; a < kArrays; ++a) {
    off[a] = total;
    if (a >= kState0 && a < kState0 + 3 && a - kState0 >= nstates) continue;
    total += round_up(opt->chunk_ * opt->element_size(a), kAlign);
  }
  opt->slot_bytes_ = total;
  for (unsigned s = 0; s < o.ring_buffers; ++s) {
    auto buf = pool.allocate(total);
    if (!buf.ok())
      return buf.status().with_context(fmt::format(
          "nvme optimizer: ring of {} x {} ({} elements per chunk, {} states)", o.ring_buffers,
          format_bytes(total), opt->chunk_, nstates));
    auto slot = std::make_unique<Slot>();
    slot->mem = std::move(buf).value();
    for (int a = 0; a < kArrays; ++a) slot->part[a] = static_cast<char*>(slot->mem.data()) + off[a];
    if (o.tracer != nullptr) slot->track = o.tracer->add_track(fmt::format("optimizer ring slot {}", s));
    opt->slots_.push_back(std::move(slot));
  }
  return opt;
}

NvmeOptimizer::~NvmeOptimizer() { drop_prefetch(); }  // run() never returns with requests in flight

void NvmeOptimizer::prefetch(std::span<const OptimizerTensor> tensors) {
  drop_prefetch();
  if (progress_.torn || !progress_.complete || store_ == nullptr || !validate(tensors).ok()) return;
  tensors_ = tensors;
  build_chunks(tensors, 0);
  const std::size_t n = std::min(slots_.size(), chunks_.size());
  prefetched_.assign(slots_.size(), 0);
  prefetch_req_.resize(slots_.size());
  for (std::size_t i = 0; i < n; ++i) {
    const OptimizerTensor& t = tensors[chunks_[i].tensor];
    if (t.grads.tier == Placement::Tier::kSwap) break;  // not final before the step
    bool any = false;
    for (int a = 0; a < kArrays; ++a) any = any || reads(a, t);
    if (!any) break;  // host-resident: nothing to read ahead
    Pending p;
    {
      std::lock_guard<std::mutex> lock(mu_);
      prepare_io_locked(i, i, false, &p);
      prefetch_req_[i] = p;
      prefetched_[i] = 1;
    }
    submit(p);
  }
  tensors_ = {};
  chunks_.clear();
}

void NvmeOptimizer::settle_prefetch() {
  if (prefetched_.empty()) return;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return inflight_ == 0; });
}

void NvmeOptimizer::drop_prefetch() {
  if (prefetched_.empty()) return;
  settle_prefetch();
  std::lock_guard<std::mutex> lock(mu_);
  for (std::size_t si = 0; si < prefetched_.size(); ++si)
    if (prefetched_[si]) slots_[si]->phase = Phase::kIdle;
  prefetched_.clear();
}

void NvmeOptimizer::set_completed_step(std::int64_t step) {
  progress_ = StepProgress{};
  progress_.step = step;
}

std::size_t NvmeOptimizer::element_size(int a, const OptimizerTensor& t) const {
  return a == kOut && t.out_is_master ? 4 : element_size(a);
}

std::size_t NvmeOptimizer::element_size(int a) const {
  if (a == kOut) return dtype_size(options_.out_dtype);
  if (a >= kState0 && a < kState0 + 3) return dtype_size(options_.state_dtype);
  return 4;
}

namespace {
const Placement& placement(const OptimizerTensor& t, int a) {
  switch (a) {
    case 0: return t.master;
    case 4: return t.grads;
    case 5: return t.params_out;
    default: return t.state[a - 1];
  }
}
}  // namespace

bool NvmeOptimizer::reads(int a, const OptimizerTensor& t) const {
  if (a == kOut) return false;
  if (a >= kState0 && a < kState0 + 3 && a - kState0 >= nstates_) return false;
  return placement(t, a).tier == Placement::Tier::kSwap;
}

bool NvmeOptimizer::writes(int a, const OptimizerTensor& t) const {
  if (a == kGrads) return false;
  if (a >= kState0 && a < kState0 + 3 && a - kState0 >= nstates_) return false;
  return placement(t, a).tier == Placement::Tier::kSwap;
}

Status NvmeOptimizer::validate(std::span<const OptimizerTensor> tensors) const {
  for (const auto& t : tensors) {
    auto bad = [&](const std::string& why) {
      return Status(StatusCode::kInvalidArgument, fmt::format("nvme optimizer: tensor '{}': {}", t.name, why));
    };
    for (int a = 0; a <= kOut; ++a) {
      if (a >= kState0 && a < kState0 + 3 && a - kState0 >= nstates_) continue;
      const Placement& p = placement(t, a);
      if (!p.present()) {
        if (a == kOut) continue;
        return bad(fmt::format("no {} array", kArrayNames[a]));
      }
      if ((p.tier == Placement::Tier::kHost || p.tier == Placement::Tier::kDevice) && p.host == nullptr && t.count > 0)
        return bad(fmt::format("{} is {}-resident with a null pointer", kArrayNames[a],
                               p.tier == Placement::Tier::kHost ? "host" : "device"));
      if (p.tier == Placement::Tier::kDevice && a != kOut)
        return bad(fmt::format("{} is on the device; only params_out may be", kArrayNames[a]));
      if (p.tier == Placement::Tier::kDevice && options_.device_out == nullptr)
        return bad("params_out is on the device but the optimizer has no device_out");
      if (p.tier == Placement::Tier::kSwap) {
        if (store_ == nullptr) return bad(fmt::format("{} is in a swap store but the optimizer has none", kArrayNames[a]));
        if (p.swap.bytes < t.count * element_size(a, t))
          return bad(fmt::format("{} swap tensor holds {} bytes, {} needed", kArrayNames[a], p.swap.bytes,
                                 t.count * element_size(a, t)));
      }
    }
    for (int s = nstates_; s < 3; ++s)
        if (t.state[s].present()) return bad(fmt::format("state{} given but the optimizer uses {}", s, nstates_));
    if (t.config != nullptr && cpu_optim::state_count(*t.config) != nstates_)
      return bad(fmt::format("its config needs {} states but the ring was built for {}",
                             cpu_optim::state_count(*t.config), nstates_));
  }
  return {};
}

void NvmeOptimizer::build_chunks(std::span<const OptimizerTensor> tensors, std::uint64_t skip) {
  chunks_.clear();
  for (std::uint32_t i = 0; i < tensors.size(); ++i) {
    std::uint64_t off = 0;
    const std::uint64_t n = tensors[i].count;
    if (skip >= n) {
      skip -= n;
      continue;
    }
    off = skip;
    skip = 0;
    while (off < n) {
      const std::uint64_t c = std::min<std::uint64_t>(chunk_, n - off);
      chunks_.push_back({i, off, c});
      off += c;
    }
  }
}

Status NvmeOptimizer::chunk_error(const char* what, std::size_t ci, int array, const Status& st) const {
  const Chunk& c = chunks_[ci];
  return st.with_context(fmt::format("optimizer step {}: {} {}elements {}..{} of tensor '{}'", step_, what,
                                     array >= 0 ? std::string(kArrayNames[array]) + " " : std::string(), c.offset,
                                     c.offset + c.count, tensors_[c.tensor].name));
}

std::uint64_t NvmeOptimizer::fill_requests(std::size_t si, std::size_t ci, bool write, Pending* p) const {
  const Slot& s = *slots_[si];
  const Chunk& c = chunks_[ci];
  const OptimizerTensor& t = tensors_[c.tensor];
  p->slot = si;
  p->write = write;
  p->n = 0;
  std::uint64_t bytes = 0;
  for (int a = 0; a < kArrays; ++a) {
    if (!(write ? writes(a, t) : reads(a, t))) continue;
    const std::size_t es = element_size(a, t);
    void* buf = s.part[a];
    if (a == kOut && t.out_is_master)  // the updated master chunk itself
      buf = t.master.tier == Placement::Tier::kSwap ? s.part[kMaster]
                                                     : static_cast<void*>(static_cast<char*>(t.master.host) + c.offset * 4);
    p->req[p->n++] = {placement(t, a).swap, c.offset * es, c.count * es, buf, a};
    bytes += c.count * es;
  }
  return bytes;
}

void NvmeOptimizer::prepare_io_locked(std::size_t si, std::size_t ci, bool write, Pending* p) {
  Slot& s = *slots_[si];
  s.bytes = fill_requests(si, ci, write, p);
  s.chunk = ci;
  s.phase = write ? Phase::kWriting : Phase::kReading;
  s.error = Status();
  s.error_array = -1;
  s.pending = p->n + 1;  // +1: a guard released after the last submission
  s.t0 = Tracer::now_ns();
  inflight_ += static_cast<std::size_t>(p->n) + 1;
}

void NvmeOptimizer::submit(Pending& p) {
  std::atomic<std::uint64_t>* counter = p.write ? options_.write_bytes : options_.read_bytes;
  for (int i = 0; i < p.n; ++i) {
    const auto& r = p.req[i];
    if (counter) counter->fetch_add(r.length, std::memory_order_relaxed);
    // Memory refused while submitting (a transfer that throws submitted
    // nothing and never calls its callback): the piece fails here, so the
    // slot's count still reaches zero and nothing waits for it.
    try {
      auto cb = [this, slot = p.slot, a = r.array](const Status& st) { piece_done(slot, a, st); };
      if (p.write)
        store_->write(r.t, r.offset, r.length, r.buf, cb);
      else
        store_->read(r.t, r.offset, r.length, r.buf, cb);
    } catch (const std::bad_alloc&) {
      piece_done(p.slot, r.array, out_of_memory_status("NVMe optimizer: submitting a state chunk"));
    }
  }
  piece_done(p.slot, -1, Status());  // the guard
}

void NvmeOptimizer::issue_read(std::size_t si, std::size_t ci) {
  Pending p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    prepare_io_locked(si, ci, false, &p);
  }
  submit(p);
}

// Runs on the I/O thread (or the submitting thread for the guard). The last
// piece of a write issues the read of the chunk that reuses the slot.
void NvmeOptimizer::piece_done(std::size_t si, int array, const Status& st) {
  Slot& s = *slots_[si];
  Pending next;
  bool issue = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!st.ok() && s.error.ok()) {
      s.error = st;
      s.error_array = array;
    }
    if (--s.pending == 0) {
      const bool write = s.phase == Phase::kWriting;
      if (options_.tracer != nullptr) {
        options_.tracer->complete(write ? "nvme_write" : "nvme_read", trace_cat::kIo, s.t0, Tracer::now_ns(),
                                  {{"bytes", s.bytes}, {"chunk", static_cast<std::uint64_t>(s.chunk)}}, s.track);
      }
      if (!write) {
        s.phase = Phase::kReadDone;
      } else if (!s.error.ok()) {
        if (write_error_.ok()) write_error_ = chunk_error("writing back", s.chunk, s.error_array, s.error);
        stop_ = true;
        s.phase = Phase::kIdle;
      } else {
        s.phase = Phase::kIdle;
        if (done_ && write_counts_[s.chunk]) chunk_part_done_locked(s.chunk);
        const std::size_t ci = s.chunk + slots_.size();
        if (!stop_ && ci < chunks_.size()) {
          prepare_io_locked(si, ci, false, &next);
          issue = true;
        }
      }
    }
    --inflight_;
    cv_.notify_all();
  }
  if (issue) submit(next);
}

// A chunk is finished when its update, its write-back (if any array is in
// the swap store) and its upload (a device params_out) are; done_ hears of
// every new prefix of whole tensors.
void NvmeOptimizer::chunk_part_done_locked(std::size_t ci) {
  if (!done_ || --chunk_left_[ci] != 0) return;
  const std::size_t n = chunks_.size();
  while (finished_ < n && chunk_left_[finished_] == 0) ++finished_;
  const std::size_t t = finished_ < n ? chunks_[finished_].tensor : tensors_.size();
  if (t > reported_) {
    reported_ = t;
    done_(t);
  }
}

Status NvmeOptimizer::run(const cpu_optim::OptimizerConfig& config, std::int64_t step, std::size_t* chunks_done) {
  *chunks_done = 0;
  const std::size_t n = chunks_.size();
  const std::size_t depth = slots_.size();
  // A read-ahead slot is kept when it holds exactly what chunk `slot` of this
  // call reads; any other is waited for (its read still lands there) and
  // read again.
  std::vector<std::uint8_t>& keep = keep_;  // capacity kept between calls: no allocation per step
  keep.assign(depth, 0);
  {
    std::unique_lock<std::mutex> lock(mu_);
    stop_ = false;
    write_error_ = Status();
    for (std::size_t si = 0; si < depth; ++si) {
      Slot& s = *slots_[si];
      if (si < prefetched_.size() && prefetched_[si]) {
        if (si < n) {
          Pending want;
          fill_requests(si, si, false, &want);
          const Pending& got = prefetch_req_[si];
          keep[si] = want.n == got.n;
          for (int k = 0; keep[si] && k < want.n; ++k) {
            const auto &x = want.req[k], &y = got.req[k];
            keep[si] = x.t.id == y.t.id && x.t.base == y.t.base && x.offset == y.offset && x.length == y.length &&
                       x.buf == y.buf && x.array == y.array;
          }
        }
        if (!keep[si]) cv_.wait(lock, [&] { return s.pending == 0; });
        prefetched_[si] = 0;
      }
      if (!keep[si]) s.phase = Phase::kIdle;
    }
    finished_ = reported_ = 0;
    if (done_) {
      chunk_left_.assign(n, 1);
      write_counts_.assign(n, 0);
      for (std::size_t i = 0; i < n; ++i) {
        const OptimizerTensor& t = tensors_[chunks_[i].tensor];
        // The write-back counts only where a reader of the tensor's result
        // reads the store: a compute copy in it (or none here, so one made
        // from the written master). A compute copy on the host or device is
        // final once updated (and uploaded); the master and moments written
        // back are the next pass's and a checkpoint's, which wait for the
        // whole call.
        const bool result_in_store = writes(kOut, t) || !t.params_out.present();
        bool any_write = false;
        for (int a = 0; a < kArrays; ++a) any_write = any_write || writes(a, t);
        if (any_write && result_in_store) {
          ++chunk_left_[i];
          write_counts_[i] = 1;
        }
        if (t.params_out.tier == Placement::Tier::kDevice) ++chunk_left_[i];
      }
    }
  }
  for (std::size_t i = 0; i < std::min(depth, n); ++i) {
    if (keep[i])
      prefetch_hits_.fetch_add(1, std::memory_order_relaxed);
    else
      issue_read(i, i);
  }

  Status failure;
  Tracer* tr = options_.tracer;
  // Device outputs: which slots have copies in flight (this thread only).
  std::vector<std::uint8_t>& copying = out_copying_;
  copying.assign(depth, 0);
  out_chunk_.assign(depth, 0);
  auto wait_out = [&](std::size_t si) -> Status {
    if (!copying[si]) return {};
    copying[si] = 0;
    Status w = options_.device_out->wait(static_cast<unsigned>(si));
    if (w.ok() && done_) {
      std::lock_guard<std::mutex> lock(mu_);
      chunk_part_done_locked(out_chunk_[si]);
    }
    return w;
  };
  // Uploads already complete are reported without waiting (done_ only).
  auto poll_out = [&] {
    for (std::size_t k = 0; k < depth; ++k) {
      if (!copying[k] || !options_.device_out->done(static_cast<unsigned>(k))) continue;
      copying[k] = 0;
      std::lock_guard<std::mutex> lock(mu_);
      chunk_part_done_locked(out_chunk_[k]);
    }
  };
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t si = i % depth;
    Slot& s = *slots_[si];
    if (done_ && options_.device_out != nullptr) poll_out();
    // The slot's output is written below: its previous upload must be done.
    if (Status w = wait_out(si); !w.ok()) {
      out_failed(chunk_error("uploading", i >= depth ? i - depth : i, kOut, w));
      break;
    }
    {
      TraceSpan wait(tr, "wait_read", trace_cat::kRuntime);
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !write_error_.ok() || (s.chunk == i && s.phase == Phase::kReadDone); });
      if (!write_error_.ok()) break;
      if (!s.error.ok()) {
        failure = chunk_error("reading", i, s.error_array, s.error);
        break;
      }
    }
    const Chunk& c = chunks_[i];
    const OptimizerTensor& t = tensors_[c.tensor];
    auto ptr = [&](int a) -> void* {
      const Placement& p = placement(t, a);
      if (p.tier == Placement::Tier::kHost) return static_cast<char*>(p.host) + c.offset * element_size(a, t);
      if (p.tier == Placement::Tier::kSwap || p.tier == Placement::Tier::kDevice) return s.part[a];
      return nullptr;
    };
    Status st;
    {
      TraceSpan span(tr, "optimizer_chunk", trace_cat::kOptim,
                     {{"elements", c.count}, {"chunk", static_cast<std::uint64_t>(i)}});
      cpu_optim::StepBuffers b;
      b.params = static_cast<float*>(ptr(kMaster));
      b.grads = ptr(kGrads);
      b.grad_dtype = DType::kF32;
      for (int k = 0; k < nstates_; ++k) b.state[k] = ptr(kState0 + k);
      b.state_dtype = options_.state_dtype;
      b.state_rounding = options_.state_rounding;
      // Stream 0 for every tensor, as a caller of cpu_optim::step or the
      // C ABI gets by default: the same bits as those on whole tensors.
      b.index_base = t.first_index + c.offset;
      b.params_out = t.out_is_master ? nullptr : ptr(kOut);
      b.out_dtype = options_.out_dtype;
      st = cpu_optim::step(t.config != nullptr ? *t.config : config, t.step > 0 ? t.step : step, b, c.count,
                           options_.exec);
      // An fp32 compute copy on the host: the updated master's bits (one
      // in a swap store is written from the master's chunk below).
      if (st.ok() && t.out_is_master && t.params_out.tier == Placement::Tier::kHost)
        std::memcpy(ptr(kOut), b.params, c.count * 4);
    }
    if (!st.ok()) {
      failure = chunk_error("updating", i, -1, st);
      break;
    }
    if (t.out_copy != nullptr) {
      const std::size_t es = element_size(kOut, t);
      std::memcpy(static_cast<char*>(t.out_copy) + c.offset * es, t.out_is_master ? ptr(kMaster) : ptr(kOut),
                  c.count * es);
    }
    if (copied_ && (i + 1 == n || chunks_[i + 1].tensor != c.tensor)) copied_(c.tensor + 1);
    if (t.params_out.tier == Placement::Tier::kDevice) {
      // The fp32 copy of a master is uploaded from the master's chunk, which
      // the slot's next read overwrites: that one upload is waited for here.
      const std::size_t es = element_size(kOut, t);
      const void* src = t.out_is_master ? ptr(kMaster) : ptr(kOut);
      void* dst = static_cast<char*>(t.params_out.host) + c.offset * es;
      Status w = options_.device_out->copy(static_cast<unsigned>(si), dst, src, c.count * es);
      copying[si] = 1;
      out_chunk_[si] = i;
      if (w.ok() && t.out_is_master && t.master.tier == Placement::Tier::kSwap) w = wait_out(si);
      if (!w.ok()) {
        out_failed(chunk_error("uploading", i, kOut, w));
        break;
      }
    }
    ++*chunks_done;
    bool any_write = false;
    for (int a = 0; a < kArrays; ++a) any_write = any_write || writes(a, t);
    if (any_write) {
      Pending p;
      {
        std::lock_guard<std::mutex> lock(mu_);
        chunk_part_done_locked(i);  // the update
        prepare_io_locked(si, i, true, &p);
      }
      submit(p);  // its completion issues the read of chunk i + depth
    } else {
      {
        std::lock_guard<std::mutex> lock(mu_);
        chunk_part_done_locked(i);
        s.phase = Phase::kIdle;
      }
      if (i + depth < n) issue_read(si, i + depth);
    }
  }
  // Drain: nothing new is read; every request already issued completes
  // before the ring (and the caller's tensors) can be touched again.
  for (std::size_t si = 0; si < depth; ++si)
    if (Status w = wait_out(si); !w.ok()) out_failed(w.with_context(fmt::format("optimizer step {}: uploading the compute copy", step_)));
  std::unique_lock<std::mutex> lock(mu_);
  stop_ = true;
  cv_.wait(lock, [&] { return inflight_ == 0; });
  if (!write_error_.ok()) return write_error_;
  if (failure.ok() && done_ && reported_ < tensors_.size()) {  // e.g. no chunk at all
    reported_ = tensors_.size();
    done_(reported_);
  }
  return failure;
}

// A failed upload leaves a device compute copy that no longer matches its
// master: handled as a failed write-back (the state counts as torn).
void NvmeOptimizer::out_failed(const Status& st) {
  std::lock_guard<std::mutex> lock(mu_);
  if (write_error_.ok()) write_error_ = st;
  stop_ = true;
  cv_.notify_all();
}

Status NvmeOptimizer::step(const cpu_optim::OptimizerConfig& config, std::int64_t step,
                           std::span<const OptimizerTensor> tensors, const TensorsDone& done,
                           const TensorsDone& copied) {
  return step_impl(config, step, tensors, false, done, copied);
}

Status NvmeOptimizer::step_part(const cpu_optim::OptimizerConfig& config, std::int64_t step,
                                std::span<const OptimizerTensor> tensors) {
  return step_impl(config, step, tensors, true, {}, {});
}

Status NvmeOptimizer::step_impl(const cpu_optim::OptimizerConfig& config, std::int64_t step,
                                std::span<const OptimizerTensor> tensors, bool part, const TensorsDone& done,
                                const TensorsDone& copied) {
  if (progress_.torn)
    return Status(StatusCode::kCorrupt,
                  fmt::format("nvme optimizer: a write-back failed during step {}, so the state on disk is torn; "
                              "restore it (a checkpoint) and call set_completed_step()",
                              progress_.step));
  if (cpu_optim::state_count(config) != nstates_)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("nvme optimizer: the config needs {} states but the ring was built for {}",
                              cpu_optim::state_count(config), nstates_));
  std::uint64_t total = 0;
  for (const auto& t : tensors) total += t.count;
  std::uint64_t skip = 0;
  if (!progress_.complete) {
    if (step != progress_.step)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("nvme optimizer: step {} is incomplete ({} of {} elements updated); call step({}) "
                                "again with the same tensors to finish it before step {}",
                                progress_.step, progress_.done_elems, progress_.total_elems, progress_.step, step));
    if (total != progress_.total_elems)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("nvme optimizer: resuming step {} with {} elements, but it was started with {}",
                                step, total, progress_.total_elems));
    skip = progress_.done_elems;
  } else if (step < 1 ||
             (progress_.step != 0 && step != progress_.step + 1 && !(part && step == progress_.step))) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("nvme optimizer: step {} after completed step {}: expected step {}", step,
                              progress_.step, progress_.step + 1));
  }
  STRATA_RETURN_IF_ERROR(validate(tensors));
  tensors_ = tensors;
  step_ = step;
  build_chunks(tensors, skip);
  TraceSpan span(options_.tracer, "optimizer_step", trace_cat::kOptim,
                 {{"step", step}, {"elements", total - skip}, {"chunks", static_cast<std::uint64_t>(chunks_.size())}});
  std::size_t chunks_done = 0;
  done_ = done;
  if (skip == 0) copied_ = copied;  // a resumed step does not update (or copy) its first chunks
  Status st = run(config, step, &chunks_done);
  if (st.ok() && copied_) copied_(tensors.size());  // tensors without a chunk (no elements)
  done_ = nullptr;
  copied_ = nullptr;
  progress_.step = step;
  progress_.total_elems = total;
  if (st.ok()) {
    progress_.complete = true;
    progress_.done_elems = total;
    return st;
  }
  progress_.complete = false;
  bool torn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    torn = !write_error_.ok();
  }
  progress_.torn = torn;
  // Without a write error every computed chunk was written back.
  std::uint64_t d = skip;
  for (std::size_t i = 0; i < chunks_done; ++i) d += chunks_[i].count;
  progress_.done_elems = d;
  return st;
}

}  // namespace strata
