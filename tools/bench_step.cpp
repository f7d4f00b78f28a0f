// `strata bench step`: one optimizer step over NVMe-resident state, and each
// of its parts alone, in the same run.
//
// Setup (untimed): a swap store in a fresh directory under --dir holds, for
// --params parameters split into --tensor-sized tensors, the fp32 master, the
// AdamW moments (fp32 or bf16), the fp32 gradients and the bf16 compute copy.
// Master and gradients are filled with random numbers, the moments with zeros.
//
// Measured, --reps times, interleaved, medians reported:
//   read   the NVMe read of everything the step reads (master, m, v, grads),
//          in the step's chunks, --buffers chunks in flight, alone;
//   optim  cpu_optim::step over the same chunks from pinned buffers already in
//          RAM (a ring as large as the step's), alone;
//   write  the NVMe write of everything the step writes (master, m, v, bf16
//          copy), alone;
//   step   the full pipelined step (runtime/nvme_optimizer), wall time, with
//          the swap store's block checksums off and on (--checksums both,
//          the default: two copies of the state, each step run on both in
//          every rep); the parts run on the copy without checksums.
//   rw     the step's reads and writes issued at once, no update: the I/O
//          ceiling of the step on this device (on a disk whose reads and writes
//          share one bandwidth, it is about read + write, not max(read, write));
// efficiency = max(read, optim, write) / step (issue 4's figure);
// io_efficiency = max(rw, optim) / step: how close the step is to the ceiling
// the device allows.
// Every file is removed at the end, also on error.
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "commands.h"
#include "common/crc32c.h"
#include "common/units.h"
#include "cpu_optim/optimizer.h"
#include "io/io_engine.h"
#include "io/pinned_pool.h"
#include "io/swap_store.h"
#include "runtime/nvme_optimizer.h"
#include "runtime/trace.h"

namespace strata::tools {
namespace {

struct BenchStepOptions {
  std::string params = "1G";
  std::string states = "nvme";
  std::string dir;
  std::string states_dtype = "fp32";
  std::string chunk = "8M";
  unsigned buffers = 4;
  std::string tensor = "64M";
  unsigned qd = 64;
  std::string block = "1MiB";
  std::string backend = "auto";
  int reps = 3;
  int threads = 0;
  std::string trace;
  std::string checksums = "both";  // off | on | both
  std::string checksum_block = "64KiB";
  bool json = false;
};

struct Tensors {
  io::SwapTensor master, grads, m, v, out;
  std::size_t count = 0;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The step's chunks and a ring of slots like the optimizer's, for the parts
// measured alone.
class Parts {
 public:
  Parts(io::SwapStore& store, const std::vector<Tensors>& ts, std::size_t chunk, unsigned depth, DType sdt)
      : store_(store), ts_(ts), chunk_(chunk), depth_(depth), sdt_(sdt) {
    for (std::uint32_t i = 0; i < ts.size(); ++i)
      for (std::uint64_t off = 0; off < ts[i].count; off += chunk)
        chunks_.push_back({i, off, std::min<std::uint64_t>(chunk, ts[i].count - off)});
  }

  Status allocate(io::PinnedPool& pool) {
    const std::size_t ss = dtype_size(sdt_);
    for (unsigned s = 0; s < depth_; ++s) {
      Slot slot;
      for (auto [buf, es] : {std::pair{&slot.master, 4ul}, {&slot.m, ss}, {&slot.v, ss}, {&slot.grads, 4ul},
                             {&slot.out, 2ul}}) {
        STRATA_ASSIGN_OR_RETURN(*buf, pool.allocate(chunk_ * es));
        std::memset(buf->data(), 0, chunk_ * es);
      }
      slots_.push_back(std::move(slot));
      // A second set to write from while the first is read into (both()).
      Slot w;
      for (auto [buf, es] : {std::pair{&w.master, 4ul}, {&w.m, ss}, {&w.v, ss}, {&w.out, 2ul}}) {
        STRATA_ASSIGN_OR_RETURN(*buf, pool.allocate(chunk_ * es));
        std::memset(buf->data(), 0, chunk_ * es);
      }
      wslots_.push_back(std::move(w));
    }
    return {};
  }

  // Reads (or writes) every chunk, `depth` chunks in flight.
  Result<double> stream(io::IoOpKind op) { return run_io(op == io::IoOpKind::kRead, op == io::IoOpKind::kWrite); }
  // Reads and writes every chunk at once, `depth` chunks of each in flight:
  // the step's I/O without the update, i.e. its ceiling on this device.
  Result<double> both() { return run_io(true, true); }

 private:
  Result<double> run_io(bool read, bool write) {
    const std::size_t ss = dtype_size(sdt_);
    std::vector<std::vector<io::IoHandle>> inflight(depth_);
    Status first;
    auto t0 = std::chrono::steady_clock::now();
    for (std::size_t ci = 0; ci < chunks_.size(); ++ci) {
      auto& hs = inflight[ci % depth_];
      for (auto& h : hs) {
        Status st = h.wait();
        if (first.ok() && !st.ok()) first = st;
      }
      hs.clear();
      if (!first.ok()) break;
      const Chunk& c = chunks_[ci];
      const Tensors& t = ts_[c.tensor];
      if (read) {
        Slot& s = slots_[ci % depth_];
        auto go = [&](const io::SwapTensor& st, io::PinnedBuffer& b, std::size_t es) {
          hs.push_back(store_.read(st, c.offset * es, c.count * es, b.data()));
        };
        go(t.master, s.master, 4), go(t.m, s.m, ss), go(t.v, s.v, ss), go(t.grads, s.grads, 4);
      }
      if (write) {
        // Alone, write from the ring the reads filled; with reads, from the second set.
        Slot& s = read ? wslots_[ci % depth_] : slots_[ci % depth_];
        auto go = [&](const io::SwapTensor& st, io::PinnedBuffer& b, std::size_t es) {
          hs.push_back(store_.write(st, c.offset * es, c.count * es, b.data()));
        };
        go(t.master, s.master, 4), go(t.m, s.m, ss), go(t.v, s.v, ss), go(t.out, s.out, 2);
      }
    }
    for (auto& hs : inflight)
      for (auto& h : hs) {
        Status st = h.wait();
        if (first.ok() && !st.ok()) first = st;
      }
    const double secs = seconds_since(t0);
    if (!first.ok()) return first;
    return secs;
  }


 public:
  // cpu_optim::step over every chunk, from the ring's buffers.
  Result<double> optimize(const cpu_optim::OptimizerConfig& cfg, std::int64_t step, const cpu_optim::ExecOptions& ex) {
    auto t0 = std::chrono::steady_clock::now();
    for (std::size_t ci = 0; ci < chunks_.size(); ++ci) {
      Slot& s = slots_[ci % depth_];
      cpu_optim::StepBuffers b;
      b.params = s.master.as<float>();
      b.grads = s.grads.data();
      b.state[0] = s.m.data();
      b.state[1] = s.v.data();
      b.state_dtype = sdt_;
      b.params_out = s.out.data();
      b.out_dtype = DType::kBF16;
      STRATA_RETURN_IF_ERROR(cpu_optim::step(cfg, step, b, chunks_[ci].count, ex));
    }
    return seconds_since(t0);
  }

 private:
  struct Chunk {
    std::uint32_t tensor;
    std::uint64_t offset, count;
  };
  struct Slot {
    io::PinnedBuffer master, m, v, grads, out;
  };
  io::SwapStore& store_;
  const std::vector<Tensors>& ts_;
  std::size_t chunk_;
  unsigned depth_;
  DType sdt_;
  std::vector<Chunk> chunks_;
  std::vector<Slot> slots_, wslots_;
};

// Writes `bytes` of tensor t from a pattern buffer (any length), all in flight.
void fill(io::SwapStore& store, const io::SwapTensor& t, std::uint64_t bytes, const io::PinnedBuffer& pattern,
          std::vector<io::IoHandle>* hs) {
  for (std::uint64_t off = 0; off < bytes; off += pattern.size())
    hs->push_back(store.write(t, off, std::min<std::uint64_t>(pattern.size(), bytes - off), pattern.data()));
}

struct Figures {
  std::vector<double> read, optim, write, rw;
  std::vector<double> step[2];  // without, with block checksums
  std::size_t chunk_elems = 0;  // as rounded by the optimizer
};

// One copy of the step's state: a store (checksums on or off), its tensors
// and an optimizer over them.
struct StateCopy {
  bool checksums = false;
  std::unique_ptr<io::SwapStore> store;
  std::vector<Tensors> ts;
  std::vector<std::string> names;
  std::vector<OptimizerTensor> ots;
  std::unique_ptr<NvmeOptimizer> opt;
};

Status run(const BenchStepOptions& o, std::uint64_t params, std::uint64_t chunk, std::uint64_t tensor_elems,
           std::uint64_t block, DType sdt, std::uint64_t checksum_block, const std::string& run_dir, Figures* f) {
  io::IoEngineOptions eo;
  eo.backend = o.backend;
  eo.queue_depth = o.qd;
  eo.block_bytes = block;
  STRATA_ASSIGN_OR_RETURN(auto engine, io::make_io_engine(eo));
  std::unique_ptr<io::PinnedPool> pool;  // outlives the copies' optimizers (their rings)
  std::vector<StateCopy> copies;
  for (bool on : {false, true}) {
    if ((on && o.checksums == "off") || (!on && o.checksums == "on")) continue;
    StateCopy c;
    c.checksums = on;
    io::SwapStoreOptions so;
    so.dirs = {run_dir + (on ? "/checked" : "/plain")};
    so.checksum_block = on ? checksum_block : 0;
    STRATA_ASSIGN_OR_RETURN(c.store, io::SwapStore::create(*engine, so));
    copies.push_back(std::move(c));
  }
  Status st = [&]() -> Status {
    const std::size_t ss = dtype_size(sdt);
    const std::size_t rounded = (chunk + 2047) / 2048 * 2048;  // as the optimizer rounds it
    const std::size_t slot = rounded * (4 + 2 * ss + 4 + 2) + 5 * 4096;
    const std::size_t pattern_bytes = 64ull << 20;
    io::PinnedPoolOptions po;
    // The optimizer's ring, the parts' two rings, the fill patterns, and one
    // slab of slack for what the slabs' rounding leaves unused.
    po.slab_bytes = std::max<std::size_t>(slot, 64ull << 20);
    po.budget_bytes = (2 + copies.size()) * o.buffers * slot + 2 * pattern_bytes + po.slab_bytes + (16ull << 20);
    po.registrars = {engine->buffer_registrar()};
    STRATA_ASSIGN_OR_RETURN(pool, io::PinnedPool::create(po));

    std::unique_ptr<Tracer> tracer;
    if (!o.trace.empty()) {
      STRATA_ASSIGN_OR_RETURN(tracer, Tracer::open(o.trace));
    }
    cpu_optim::OptimizerConfig cfg;
    cfg.weight_decay = 0.01;
    NvmeOptimizerOptions no;
    no.chunk_elems = chunk;
    no.ring_buffers = o.buffers;
    no.state_dtype = sdt;
    no.exec.threads = o.threads;
    no.tracer = tracer.get();
    // Untimed setup: the state on disk, once per copy.
    STRATA_ASSIGN_OR_RETURN(auto random, pool->allocate(pattern_bytes));
    STRATA_ASSIGN_OR_RETURN(auto zeros, pool->allocate(pattern_bytes));
    std::memset(zeros.data(), 0, pattern_bytes);
    {
      std::mt19937 rng(1);
      std::normal_distribution<float> d(0.f, 0.02f);
      auto* r = random.as<float>();
      for (std::size_t i = 0; i < pattern_bytes / 4; ++i) r[i] = d(rng);
    }
    for (StateCopy& c : copies) {
    STRATA_ASSIGN_OR_RETURN(c.opt, NvmeOptimizer::create(c.store.get(), *pool, cfg, no));
    io::SwapStore* store = c.store.get();
    std::vector<Tensors>& ts = c.ts;
    std::vector<OptimizerTensor>& ots = c.ots;
    std::vector<std::string>& names = c.names;
    for (std::uint64_t done = 0; done < params; done += tensor_elems) {
      Tensors t;
      t.count = std::min(tensor_elems, params - done);
      const std::string n = "t" + std::to_string(ts.size());
      STRATA_ASSIGN_OR_RETURN(t.master, store->add_tensor(n + ".master", t.count * 4));
      STRATA_ASSIGN_OR_RETURN(t.m, store->add_tensor(n + ".exp_avg", t.count * ss));
      STRATA_ASSIGN_OR_RETURN(t.v, store->add_tensor(n + ".exp_avg_sq", t.count * ss));
      STRATA_ASSIGN_OR_RETURN(t.grads, store->add_tensor(n + ".grad", t.count * 4));
      STRATA_ASSIGN_OR_RETURN(t.out, store->add_tensor(n + ".bf16", t.count * 2));
      ts.push_back(t);
      names.push_back(n);
    }
    for (std::size_t i = 0; i < ts.size(); ++i) {
      OptimizerTensor ot;
      ot.name = names[i];
      ot.count = ts[i].count;
      ot.master = Placement::in_swap(ts[i].master);
      ot.grads = Placement::in_swap(ts[i].grads);
      ot.state[0] = Placement::in_swap(ts[i].m);
      ot.state[1] = Placement::in_swap(ts[i].v);
      ot.params_out = Placement::in_swap(ts[i].out);
      ots.push_back(ot);
    }
    {
      std::vector<io::IoHandle> hs;
      for (const auto& t : ts) {
        fill(*store, t.master, t.count * 4, random, &hs);
        fill(*store, t.grads, t.count * 4, random, &hs);
        fill(*store, t.m, t.count * ss, zeros, &hs);
        fill(*store, t.v, t.count * ss, zeros, &hs);
        fill(*store, t.out, t.count * 2, zeros, &hs);
        // Bound the handles kept; the engine queues the rest.
        if (hs.size() > 512) {
          for (auto& h : hs) STRATA_RETURN_IF_ERROR(h.wait());
          hs.clear();
        }
      }
      for (auto& h : hs) STRATA_RETURN_IF_ERROR(h.wait());
    }
    }
    const StateCopy& first = copies.front();
    f->chunk_elems = first.opt->chunk_elems();
    Parts parts(*first.store, first.ts, first.opt->chunk_elems(), o.buffers, sdt);
    STRATA_RETURN_IF_ERROR(parts.allocate(*pool));
    ::sync();
    if (!o.json)
      std::printf("%s params in %zu tensors, %s states on NVMe, chunk %s elements, %u buffers (%s pinned), qd %u, "
                  "block %s, %s backend, block checksums %s (%s blocks, CRC32C %s)\n",
                  o.params.c_str(), first.ts.size(), dtype_name(sdt), o.chunk.c_str(), o.buffers,
                  format_bytes(first.opt->ring_bytes()).c_str(), o.qd, format_bytes(block).c_str(),
                  engine->backend_name(), o.checksums.c_str(), format_bytes(checksum_block).c_str(),
                  crc32c_impl_name());
    cpu_optim::ExecOptions ex;
    ex.threads = o.threads;
    for (int rep = 0; rep < o.reps; ++rep) {
      STRATA_ASSIGN_OR_RETURN(double rs, parts.stream(io::IoOpKind::kRead));
      STRATA_ASSIGN_OR_RETURN(double os, parts.optimize(cfg, rep + 1, ex));
      STRATA_ASSIGN_OR_RETURN(double ws, parts.stream(io::IoOpKind::kWrite));
      STRATA_ASSIGN_OR_RETURN(double rws, parts.both());
      double step_s[2] = {0, 0};
      // Alternate which copy goes first, so neither always meets a cooler disk.
      for (std::size_t k = 0; k < copies.size(); ++k) {
        StateCopy& c = copies[(k + rep) % copies.size()];
        auto t0 = std::chrono::steady_clock::now();
        STRATA_RETURN_IF_ERROR(c.opt->step(cfg, rep + 1, c.ots));
        step_s[c.checksums] = seconds_since(t0);
        f->step[c.checksums].push_back(step_s[c.checksums]);
      }
      f->read.push_back(rs), f->optim.push_back(os), f->write.push_back(ws), f->rw.push_back(rws);
      const double main_step = step_s[copies.front().checksums];
      if (!o.json) {
        std::printf("  rep %d: read %.3f s  optim %.3f s  write %.3f s  read+write at once %.3f s  step %.3f s  "
                    "efficiency %.3f",
                    rep + 1, rs, os, ws, rws, main_step, std::max({rs, os, ws}) / main_step);
        if (copies.size() == 2) std::printf("  step with checksums %.3f s (x%.3f)", step_s[1], step_s[1] / step_s[0]);
        std::printf("\n");
      }
      std::fflush(stdout);
    }
    if (tracer) STRATA_RETURN_IF_ERROR(tracer->close());
    return {};
  }();
  for (StateCopy& c : copies) {
    c.opt.reset();
    Status cs = c.store->close();
    if (st.ok() && !cs.ok()) st = cs;
  }
  for (const char* sub : {"/plain", "/checked"}) {
    ::unlink((run_dir + sub + "/.strata-scratch").c_str());
    ::rmdir((run_dir + sub).c_str());
  }
  return st;
}

void run_bench_step(const BenchStepOptions& o) {
  auto fail = [](int code, const std::string& msg) {
    std::fprintf(stderr, "strata bench step: %s\n", msg.c_str());
    set_exit_code(code);
  };
  if (o.dir.empty()) return fail(1, "--dir is required");
  struct stat sb {};
  if (::stat(o.dir.c_str(), &sb) != 0 || !S_ISDIR(sb.st_mode))
    return fail(1, "--dir " + o.dir + " is not an existing directory");
  if (o.states != "nvme")
    return fail(1, "--states " + o.states + ": only nvme is measured here (states in RAM: strata bench adam)");
  auto params = parse_bytes(o.params);
  if (!params.ok() || *params == 0) return fail(1, "--params " + o.params + ": expected a count such as 1G or 250M");
  auto chunk = parse_bytes(o.chunk);
  if (!chunk.ok() || *chunk == 0 || *chunk > (1ull << 30))
    return fail(1, "--chunk " + o.chunk + ": expected elements per chunk, 1..1G (such as 8M)");
  auto tensor = parse_bytes(o.tensor);
  if (!tensor.ok() || *tensor == 0) return fail(1, "--tensor " + o.tensor + ": expected elements per tensor");
  auto block = parse_bytes(o.block);
  if (!block.ok() || *block == 0 || *block % 4096 != 0 || *block > (64ull << 20))
    return fail(1, "--block " + o.block + ": a multiple of 4 KiB, at most 64 MiB");
  auto sdt = parse_dtype(o.states_dtype);
  if (!sdt.ok() || *sdt == DType::kF16) return fail(1, "--states-dtype " + o.states_dtype + ": expected fp32 or bf16");
  if (o.buffers < 2 || o.buffers > 64) return fail(1, fmt::format("--buffers {}: expected 2..64", o.buffers));
  if (o.qd < 1 || o.qd > 4096) return fail(1, fmt::format("--qd {}: expected 1..4096", o.qd));
  if (o.reps < 1 || o.reps > 100) return fail(1, fmt::format("--reps {}: expected 1..100", o.reps));
  if (o.backend != "auto" && o.backend != "uring" && o.backend != "aio" && o.backend != "posix")
    return fail(1, "--backend " + o.backend + ": expected auto, uring, aio or posix");
  if (o.checksums != "off" && o.checksums != "on" && o.checksums != "both")
    return fail(1, "--checksums " + o.checksums + ": expected off, on or both");
  auto cblock = parse_bytes(o.checksum_block);
  if (!cblock.ok() || *cblock < 4096 || (*cblock & (*cblock - 1)) != 0)
    return fail(1, "--checksum-block " + o.checksum_block + ": a power of two of at least 4 KiB");
  const std::uint64_t copies = o.checksums == "both" ? 2 : 1;
  const std::size_t ss = dtype_size(*sdt);
  const std::uint64_t disk = *params * (4 + 2 * ss + 4 + 2);
  struct statvfs vfs {};
  if (::statvfs(o.dir.c_str(), &vfs) == 0 &&
      static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize < copies * disk + (512ull << 20))
    return fail(1, fmt::format("{} has {} free; {} params with {} states need {} on disk", o.dir,
                               format_bytes(static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize), o.params,
                               o.states_dtype, format_bytes(copies * disk)));

  // A directory of our own under --dir (the swap store refuses a non-empty
  // directory it did not create), removed at the end whatever happens.
  const std::string run_dir = fmt::format("{}/strata-bench-step-{}", o.dir, ::getpid());
  Figures f;
  Status st = run(o, *params, *chunk, *tensor, *block, *sdt, *cblock, run_dir, &f);
  ::unlink((run_dir + "/.strata-scratch").c_str());
  ::rmdir(run_dir.c_str());
  if (!st.ok()) return fail(st.code() == StatusCode::kInternal ? 2 : 1, st.to_string());

  const bool off = o.checksums != "on";
  const double r = median(f.read), op = median(f.optim), w = median(f.write), rw = median(f.rw),
               d = median(f.step[off ? 0 : 1]);
  const bool both = o.checksums == "both";
  const double d_on = both ? median(f.step[1]) : 0;
  // Paired: each rep runs both steps back to back, so the per-rep ratio
  // cancels the disk's drift between reps; its median is the figure.
  std::vector<double> ratios;
  if (both)
    for (size_t i = 0; i < f.step[0].size() && i < f.step[1].size(); ++i) ratios.push_back(f.step[1][i] / f.step[0][i]);
  const double paired = both ? median(ratios) : 0;
  const double eff = std::max({r, op, w}) / d, io_eff = std::max(rw, op) / d;
  const std::uint64_t rbytes = *params * (4 + 2 * ss + 4), wbytes = *params * (4 + 2 * ss + 2);
  if (o.json) {
    nlohmann::json j;
    j["params"] = *params;
    j["states_dtype"] = dtype_name(*sdt);
    j["chunk_elems"] = f.chunk_elems;
    j["buffers"] = o.buffers;
    j["queue_depth"] = o.qd;
    j["block_bytes"] = *block;
    j["bytes_read"] = rbytes;
    j["bytes_written"] = wbytes;
    j["wall_s"] = d;
    j["read_s"] = r;
    j["optim_s"] = op;
    j["write_s"] = w;
    j["efficiency"] = eff;
    j["rw_s"] = rw;
    j["io_efficiency"] = io_eff;
    j["checksums"] = o.checksums;
    j["checksum_block"] = *cblock;
    j["samples"] = {{"wall_s", f.step[off ? 0 : 1]},
                    {"read_s", f.read},
                    {"optim_s", f.optim},
                    {"write_s", f.write},
                    {"rw_s", f.rw}};
    if (both) {
      j["wall_checksums_s"] = d_on;
      j["checksums_ratio"] = paired;  // median of the per-rep ratios
      j["samples"]["checksums_ratio"] = ratios;
      j["samples"]["wall_checksums_s"] = f.step[1];
    }
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("medians of %d: read %.3f s (%s, %s)  optim %.3f s  write %.3f s (%s, %s)\n", o.reps, r,
              format_bytes(rbytes).c_str(), format_rate(rbytes / r).c_str(), op, w, format_bytes(wbytes).c_str(),
              format_rate(wbytes / w).c_str());
  std::printf("read and write at once (no update) %.3f s\n", rw);
  std::printf("step (pipelined) %.3f s: efficiency max(read, optim, write) / step = %.3f (target >= 0.85); "
              "max(read and write at once, optim) / step = %.3f\n",
              d, eff, io_eff);
  if (both)
    std::printf("step with block checksums %.3f s (median): x%.3f the step without (median of the per-rep "
                "ratios; ratio of medians x%.3f)\n",
                d_on, paired, d_on / d);
}

}  // namespace

void register_bench_step(CLI::App& bench) {
  auto o = std::make_shared<BenchStepOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "step", "One AdamW step over NVMe-resident master/m/v/grads, next to its read, update and write alone");
  cmd->add_option("--params", o->params, "Parameters (1G, 250M, ...)")->capture_default_str();
  cmd->add_option("--states", o->states, "Where the optimizer state lives: nvme")->capture_default_str();
  cmd->add_option("--dir", o->dir, "Directory on the SSD (a subdirectory is created and removed)");
  cmd->add_option("--states-dtype", o->states_dtype, "fp32|bf16 (AdamW moments)")->capture_default_str();
  cmd->add_option("--chunk", o->chunk, "Elements per chunk (offload_optimizer buffer_size)")->capture_default_str();
  cmd->add_option("--buffers", o->buffers, "Chunks in the ring (offload_optimizer.buffer_count)")
      ->capture_default_str();
  cmd->add_option("--tensor", o->tensor, "Elements per tensor")->capture_default_str();
  cmd->add_option("--qd", o->qd, "I/O pieces in flight")->capture_default_str();
  cmd->add_option("--block", o->block, "Largest I/O piece")->capture_default_str();
  cmd->add_option("--backend", o->backend, "auto|uring|aio|posix")->capture_default_str();
  cmd->add_option("--reps", o->reps, "Repetitions (medians reported)")->capture_default_str();
  cmd->add_option("--threads", o->threads, "Optimizer threads (0: the CPUs available)");
  cmd->add_option("--trace", o->trace, "Write a Perfetto trace of the steps to this file");
  cmd->add_option("--checksums", o->checksums,
                  "off|on|both: the swap store's block CRC32C (both: the step measured with and without)")
      ->capture_default_str();
  cmd->add_option("--checksum-block", o->checksum_block, "Bytes per checksummed block")->capture_default_str();
  cmd->add_flag("--json", o->json, "One JSON object");
  cmd->callback([o] { run_bench_step(*o); });
}

}  // namespace strata::tools
