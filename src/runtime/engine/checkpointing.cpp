// Engine checkpoints (docs/checkpoints.md, "Engine checkpoints"): one entry
// per parameter shard and kind, plus "engine.meta" (step, loss-scale state,
// model summary, optimizer settings) as JSON. NVMe-resident arrays are
// streamed file to file through SwapStore::file_ranges.
//
// The checkpointing part owns no state of its own: it runs on the driving
// thread while the engine is idle (wait_idle) and borrows the registry's
// arrays and swap store, the stepper's step/loss-scale/lr state, and the
// uploader's slots (dropped on load: the compute copies change).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "common/host_memory.h"
#include "common/log.h"
#include "runtime/checkpoint.h"
#include "runtime/engine/engine_impl.h"

namespace strata {

using engine::ArrayLoc;

namespace {

constexpr const char* kMetaEntry = "engine.meta";
constexpr int kMetaVersion = 1;

struct ArrayRef {
  std::string name;
  const ArrayLoc* loc;
  DType dtype;
  uint64_t count;
  ParamId param;
};

std::vector<ArrayRef> arrays_of(const engine::Registry& I) {
  std::vector<ArrayRef> out;
  const DType sd = I.cfg.strata.optimizer_state_dtype;
  for (ParamId id = 0; id < I.params.size(); ++id) {
    const auto& p = I.params[id];
    const uint64_t n = p.shard.size();
    out.push_back({p.name + ".compute", &p.compute, p.dtype, n, id});
    if (!p.trainable) continue;  // frozen: the compute copy is all there is
    out.push_back({p.name + ".master", &p.master, DType::kF32, n, id});
    out.push_back({p.name + ".exp_avg", &p.state[0], sd, n, id});
    out.push_back({p.name + ".exp_avg_sq", &p.state[1], sd, n, id});
  }
  return out;
}

Result<std::vector<FileRange>> file_ranges(io::SwapStore& store, const io::SwapTensor& t, uint64_t bytes) {
  STRATA_ASSIGN_OR_RETURN(auto r, store.file_ranges(t, 0, bytes));
  std::vector<FileRange> out;
  for (auto& x : r) out.push_back(FileRange{x.path, x.fd, x.offset, x.length});
  return out;
}

nlohmann::json model_json(const ModelSpec& m) {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& p : m.params) {
    nlohmann::json e = {{"name", p.name}, {"shape", p.shape}, {"dtype", dtype_name(p.compute_dtype)}, {"group", p.group}};
    if (!p.trainable) e["frozen"] = true;  // only when frozen: checkpoints from before frozen params still match
    a.push_back(std::move(e));
  }
  return a;
}

// The trainable parameters whose own step count differs from the engine's
// (skipped in some steps), by name; usually empty.
nlohmann::json param_steps_json(const engine::Registry& R, int64_t steps) {
  nlohmann::json o = nlohmann::json::object();
  for (const auto& p : R.params)
    if (p.trainable && p.updates != steps) o[p.name] = p.updates;
  return o;
}

// Resharding: the saved ranks' entries of array `a` tile the whole parameter
// in rank order (shard_range's layout: each rank's elements follow the
// previous rank's), whatever alignment the saving run used.
Status check_reshard_entries(const std::vector<std::unique_ptr<CheckpointReader>>& old_ranks, const ArrayRef& a,
                             uint64_t numel, const std::string& dir) {
  uint64_t total = 0;
  for (size_t q = 0; q < old_ranks.size(); ++q) {
    const CheckpointEntry* e = old_ranks[q]->find(a.name);
    if (e == nullptr || e->dtype != a.dtype)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("engine: checkpoint {}: rank {} has {} for {} (want {})", dir, q,
                                e ? dtype_name(e->dtype) : "no entry", a.name, dtype_name(a.dtype)));
    total += e->count;
  }
  if (total != numel)
    return Status(StatusCode::kCorrupt,
                  fmt::format("engine: checkpoint {}: the ranks' shards of {} hold {} elements together, the "
                              "parameter has {}",
                              dir, a.name, total, numel));
  return {};
}

// Resharding: this rank's new shard of array `a`, cut out of every saved
// shard that overlaps it (each read whole and checksum-verified), written to
// the array's home (4 KiB-aligned staging for O_DIRECT swap files).
Status restore_resharded(engine::Registry& R, const std::vector<std::unique_ptr<CheckpointReader>>& old_ranks,
                         const ArrayRef& a) {
  const engine::ParamState& p = R.params[a.param];
  const size_t esz = dtype_size(a.dtype);
  const uint64_t nb = p.shard.begin, ns = p.shard.size();
  if (ns == 0) return {};
  HostAllocation staging;
  STRATA_ASSIGN_OR_RETURN(staging, alloc_host(engine::round_up(ns * esz, 4096)));
  std::vector<uint8_t> old;
  uint64_t ob = 0;  // the saved rank's first element
  Status st;
  for (size_t q = 0; q < old_ranks.size() && st.ok(); ++q) {
    const CheckpointEntry* e = old_ranks[q]->find(a.name);
    const uint64_t os = e->count;
    const uint64_t lo = std::max(ob, nb), hi = std::min(ob + os, nb + ns);
    if (lo < hi) {
      old.resize(e->bytes);
      st = old_ranks[q]->read(a.name, old.data(), old.size());
      if (st.ok())
        std::memcpy(static_cast<char*>(staging.ptr) + (lo - nb) * esz, old.data() + (lo - ob) * esz, (hi - lo) * esz);
    }
    ob += os;
  }
  if (st.ok() && a.loc->tier == Tier::kDevice) st = R.wait_released(a.param);
  if (st.ok()) st = R.write_array(*a.loc, esz, 0, ns, staging.ptr);
  free_host(staging);
  return st;
}

// N ranks: every rank's `mine`, in rank order (a blocking all-gather).
Result<std::vector<double>> gather_flags(engine::Registry& R, double mine) {
  std::vector<double> all(R.world, 0.0);
  all[R.rank] = mine;
  double* slot = all.data() + R.rank;
  STRATA_RETURN_IF_ERROR(R.host_all_gather(slot, all.data(), sizeof(double)));
  return all;
}

// N ranks: the staging token rank 0 picked ("<pid>-<random>"), broadcast.
Result<std::string> agree_token(engine::Registry& R) {
  char buf[64] = {};
  if (R.rank == 0) {
    const std::string t = fmt::format("{}-{:08x}", ::getpid(), static_cast<uint32_t>(std::random_device{}()));
    std::memcpy(buf, t.data(), std::min(t.size(), sizeof(buf) - 1));
  }
  STRATA_RETURN_IF_ERROR(R.host_broadcast(buf, sizeof(buf)));
  buf[sizeof(buf) - 1] = 0;
  return std::string(buf);
}

}  // namespace

// N ranks: each rank writes and finishes its shard; they agree that every
// shard is finished before rank 0 commits, and rank 0 says whether it did:
// every rank returns the same outcome, and a checkpoint some rank could not
// write is never committed (rank 0 removes the staging directory).
Status Engine::save_checkpoint(const std::string& dir, std::string_view extra_json) {
  Impl& I = *impl_;
  engine::Registry& R = I.reg;
  // What an earlier save of this directory left when its process died
  // (<dir>.tmp-*, a <dir>.old-* beside no <dir>), unless that process is
  // alive on this host (a concurrent save of the same directory by another
  // job is its own business). Before any rank stages (rank 0 picks the token
  // after it).
  if (R.rank == 0) {
    if (Status st = cleanup_checkpoint_leftovers(dir, /*keep_live_owners=*/true);
        !st.ok() && st.code() != StatusCode::kNotFound)
      log_warn("engine: save_checkpoint {}: removing an earlier save's leftovers: {}", dir, st.message());
  }
  if (R.world == 1) return save_shard(dir, extra_json, {});
  STRATA_ASSIGN_OR_RETURN(std::string token, agree_token(R));
  std::unique_ptr<CheckpointWriter> w;
  Status mine = save_shard(dir, extra_json, token, &w);
  STRATA_ASSIGN_OR_RETURN(std::vector<double> done, gather_flags(R, mine.ok() ? 1.0 : 0.0));
  std::string missing;
  for (uint32_t r = 0; r < R.world; ++r)
    if (done[r] == 0.0) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
  Status commit;
  if (R.rank == 0) {
    if (missing.empty()) {
      commit = w->commit();
    } else {
      Status a = abort_checkpoint_staging(dir, token);
      if (!a.ok()) log_error("engine: removing the staging directory of the failed save {}: {}", dir, a.message());
    }
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<double> committed, gather_flags(R, commit.ok() && missing.empty() ? 1.0 : 0.0));
  if (!mine.ok()) return mine;
  if (!missing.empty())
    return Status(StatusCode::kIoError,
                  fmt::format("engine: save_checkpoint {}: rank(s) {} could not write their shard (their own errors "
                              "say why); nothing was committed",
                              dir, missing));
  if (!commit.ok()) return commit;
  if (committed[0] == 0.0)
    return Status(StatusCode::kIoError,
                  fmt::format("engine: save_checkpoint {}: rank 0 could not commit the checkpoint (its error says "
                              "why); the previous checkpoint under {} stays",
                              dir, dir));
  return {};
}

Status Engine::save_shard(const std::string& dir, std::string_view extra_json, const std::string& token,
                          std::unique_ptr<CheckpointWriter>* keep) {
  Impl& I = *impl_;
  engine::Registry& R = I.reg;
  const engine::Stepper& S = I.stepper;
  if (I.uploader.acquired_count() > 0 || I.micro_index >= 0)
    return Status(StatusCode::kInvalidArgument,
                  "engine: save_checkpoint only between steps (no group acquired, no micro-batch begun)");
  STRATA_RETURN_IF_ERROR(I.wait_idle());
  STRATA_RETURN_IF_ERROR(I.errors.take());
  if (I.broken)
    return Status(StatusCode::kInvalidArgument,
                  "engine: save_checkpoint after a failed step would save torn state; load a checkpoint first");
  TraceSpan span(R.tracer.get(), "save_checkpoint", trace_cat::kRuntime);
  CheckpointInfo info;
  info.step = static_cast<uint64_t>(S.steps());
  info.loss_scale = S.scaler().scale;
  info.world_size = R.plan.world_size;
  info.rank = R.plan.rank;
  info.extra_json = std::string(extra_json);
  CheckpointWriteOptions wo;
  wo.rank = R.plan.rank;
  wo.world_size = R.plan.world_size;
  wo.token = token;
  STRATA_ASSIGN_OR_RETURN(auto w, CheckpointWriter::create(dir, info, wo));
  std::vector<uint8_t> tmp;
  for (const auto& a : arrays_of(R)) {
    const size_t esz = dtype_size(a.dtype);
    const uint64_t bytes = a.count * esz;
    const DType ck = a.dtype;
    switch (a.loc->tier) {
      case Tier::kHost:
        STRATA_RETURN_IF_ERROR(w->add_buffer(a.name, ck, a.count, a.loc->ptr, bytes));
        break;
      case Tier::kNvme: {
        STRATA_ASSIGN_OR_RETURN(auto ranges, file_ranges(*R.store, a.loc->swap, bytes));
        BlockCrcs blocks{R.store->checksum_block(), {}};
        STRATA_RETURN_IF_ERROR(w->add_file_ranges(a.name, ck, a.count, ranges, &blocks));
        R.traffic.nvme_read += bytes;
        // Swap bytes that are not what Strata wrote never make a checkpoint:
        // the save fails and the staging directory goes (the writer's destructor).
        if (blocks.block != 0) {
          Status st = R.store->verify_checksums(a.loc->swap, blocks.crcs);
          if (!st.ok()) return st.with_context(fmt::format("engine: saving {} to {}", a.name, dir));
        }
        break;
      }
      default:  // device: through host memory (compute copies only)
        tmp.resize(bytes);
        STRATA_RETURN_IF_ERROR(R.read_array(*a.loc, esz, 0, a.count, tmp.data()));
        STRATA_RETURN_IF_ERROR(w->add_buffer(a.name, ck, a.count, tmp.data(), bytes));
        break;
    }
  }
  nlohmann::json meta = {
      {"version", kMetaVersion},
      {"step", S.steps()},
      {"loss_scaler",
       {{"dynamic", S.scaler().dynamic},
        {"scale", S.scaler().scale},
        {"iter", S.scaler().iter},
        {"last_overflow_iter", S.scaler().last_overflow_iter},
        {"hysteresis", S.scaler().hysteresis},
        {"growth_rule", "deepspeed-0.19"}}},
      {"prev_norm", S.prev_norm()},
      {"lr", S.current_lr()},
      {"optimizer",
       {{"type", S.optimizer_config().kind == cpu_optim::OptimizerKind::kAdamW ? "adamw" : "adam"},
        {"beta1", S.optimizer_config().beta1},
        {"beta2", S.optimizer_config().beta2},
        {"eps", S.optimizer_config().eps},
        {"weight_decay", S.optimizer_config().weight_decay},
        {"state_dtype", dtype_name(R.cfg.strata.optimizer_state_dtype)}}},
      {"model", model_json(R.options.model)},
      {"param_steps", param_steps_json(R, S.steps())},
  };
  const std::string text = meta.dump();
  STRATA_RETURN_IF_ERROR(w->add_buffer(kMetaEntry, DType::kU8, text.size(), text.data(), text.size()));
  if (keep == nullptr) return w->commit();
  STRATA_RETURN_IF_ERROR(w->finish_shard());
  *keep = std::move(w);
  return {};
}

// N ranks: every rank loads its shard, then they agree: if any rank failed,
// every rank fails (and refuses to step until a load succeeds everywhere).
Status Engine::load_checkpoint(const std::string& dir, std::string* extra_json) {
  Impl& I = *impl_;
  engine::Registry& R = I.reg;
  if (R.world == 1) return load_shard(dir, extra_json);
  Status mine = load_shard(dir, extra_json);
  STRATA_ASSIGN_OR_RETURN(std::vector<double> ok, gather_flags(R, mine.ok() ? 1.0 : 0.0));
  if (!mine.ok()) return mine;
  for (uint32_t r = 0; r < R.world; ++r)
    if (ok[r] == 0.0) {
      I.broken = true;
      I.broken_status = Status(StatusCode::kIoError, fmt::format("rank {} could not load {}", r, dir));
      return Status(StatusCode::kIoError,
                    fmt::format("engine: load_checkpoint {}: rank {} could not load its shard (its error says why); "
                                "load a checkpoint that every rank can read",
                                dir, r));
    }
  // Stages 1-2: each rank restored its shard of the compute copies; every
  // rank needs them whole.
  if (R.replicated) {
    std::vector<ParamId> all(R.params.size());
    for (ParamId id = 0; id < all.size(); ++id) all[id] = id;
    Status st = R.gather_replicas(all);
    if (!st.ok()) {
      I.broken = true;
      I.broken_status = st;
      return st.with_context(fmt::format("engine: load_checkpoint {}", dir));
    }
  }
  return {};
}

Status Engine::load_shard(const std::string& dir, std::string* extra_json) {
  Impl& I = *impl_;
  engine::Registry& R = I.reg;
  if (I.uploader.acquired_count() > 0)
    return Status(StatusCode::kInvalidArgument, "engine: load_checkpoint with groups still acquired");
  {
    Status w = I.wait_idle();  // a failed pipelined step is what loading a checkpoint repairs
    if (!w.ok() && I.stepper.pipeline_error().ok()) return w;
  }
  I.uploader.invalidate_slots();  // no prefetch may read the compute copies while they are restored
  I.stepper.drop_read_ahead();    // nor may the optimizer's read-ahead read the states
  (void)I.errors.take();          // the state is being replaced
  TraceSpan span(R.tracer.get(), "load_checkpoint", trace_cat::kRuntime);
  CheckpointOpenOptions oo;
  oo.rank = R.plan.rank;
  oo.verify_all = true;  // every checksum before anything is restored
  // The world size first: a checkpoint of another world size is resharded
  // (every rank's part of it read, each array's new shard cut out of the old
  // ones), one of the same size is read as it was written.
  uint32_t saved_world = 1;
  {
    CheckpointOpenOptions peek = oo;
    peek.rank = 0;
    peek.verify_all = false;
    STRATA_ASSIGN_OR_RETURN(auto r0, CheckpointReader::open(dir, peek));
    saved_world = r0->info().world_size;
  }
  const bool reshard = saved_world != R.world;
  std::vector<std::unique_ptr<CheckpointReader>> old_ranks;  // resharding: every saved rank's part
  if (reshard) {
    for (uint32_t q = 0; q < saved_world; ++q) {
      CheckpointOpenOptions o = oo;
      o.rank = q;
      STRATA_ASSIGN_OR_RETURN(auto rq, CheckpointReader::open(dir, o));
      old_ranks.push_back(std::move(rq));
    }
    log_info("engine: resharding checkpoint {} from {} rank(s) to {} (this is rank {})", dir, saved_world, R.world,
             R.rank);
  }
  oo.rank = reshard ? 0 : R.plan.rank;
  STRATA_ASSIGN_OR_RETURN(auto r, CheckpointReader::open(dir, oo));
  const CheckpointEntry* me = r->find(kMetaEntry);
  if (me == nullptr)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: checkpoint {} has no {} entry: not an engine checkpoint", dir, kMetaEntry));
  std::string text(me->bytes, '\0');
  STRATA_RETURN_IF_ERROR(r->read(kMetaEntry, text.data(), text.size()));
  nlohmann::json meta = nlohmann::json::parse(text, nullptr, false);
  if (meta.is_discarded() || !meta.is_object() || meta.value("version", 0) != kMetaVersion)
    return Status(StatusCode::kCorrupt, fmt::format("engine: checkpoint {}: {} is not valid engine metadata", dir,
                                                    kMetaEntry));
  // The model must match: names, shapes, dtypes, in order.
  const nlohmann::json want = model_json(R.options.model);
  const nlohmann::json& got = meta["model"];
  if (!got.is_array() || got.size() != want.size())
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: checkpoint {} holds {} parameters, the model has {}", dir,
                              got.is_array() ? got.size() : 0, want.size()));
  for (size_t i = 0; i < want.size(); ++i)
    if (got[i] != want[i])
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("engine: checkpoint {}: parameter {} is {} there but {} in the model", dir, i,
                                got[i].dump(), want[i].dump()));
  if (meta.contains("param_steps")) {
    const auto& ps = meta["param_steps"];
    const int64_t step = meta.value("step", int64_t{0});
    if (!ps.is_object())
      return Status(StatusCode::kCorrupt, fmt::format("engine: checkpoint {}: param_steps is not an object", dir));
    for (auto it = ps.begin(); it != ps.end(); ++it) {
      const bool known = std::any_of(R.params.begin(), R.params.end(),
                                     [&](const auto& p) { return p.trainable && p.name == it.key(); });
      if (!known || !it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > step)
        return Status(StatusCode::kCorrupt,
                      fmt::format("engine: checkpoint {}: param_steps[\"{}\"] = {} (a trainable parameter's count "
                                  "of steps, 0..{})",
                                  dir, it.key(), it->dump(), step));
    }
  }
  const auto arrays = arrays_of(R);
  for (const auto& a : arrays) {
    if (reshard) {
      STRATA_RETURN_IF_ERROR(check_reshard_entries(old_ranks, a, R.params[a.param].numel, dir));
      continue;
    }
    const CheckpointEntry* e = r->find(a.name);
    if (e == nullptr || e->count != a.count || e->dtype != a.dtype)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("engine: checkpoint {}: entry {} is {} (want {} elements of {})", dir, a.name,
                                e ? fmt::format("{} elements of {}", e->count, dtype_name(e->dtype)) : "missing",
                                a.count, dtype_name(a.dtype)));
  }
  // Restore. A failure from here on leaves mixed state: steps are refused until a load succeeds.
  I.broken = true;
  I.broken_status = Status(StatusCode::kIoError, "load_checkpoint did not finish");
  std::vector<uint8_t> tmp;
  for (const auto& a : arrays) {
    const size_t esz = dtype_size(a.dtype);
    const uint64_t bytes = a.count * esz;
    Status st;
    if (reshard) {
      st = restore_resharded(R, old_ranks, a);
      if (!st.ok()) {
        I.broken_status = st;
        return st.with_context(fmt::format("engine: restoring {} from {}", a.name, dir));
      }
      continue;
    }
    switch (a.loc->tier) {
      case Tier::kHost:
        st = r->read(a.name, a.loc->ptr, bytes);
        break;
      case Tier::kNvme: {
        auto ranges = file_ranges(*R.store, a.loc->swap, bytes);
        BlockCrcs blocks{R.store->checksum_block(), {}};
        st = ranges.ok() ? r->read_to_file_ranges(a.name, *ranges, &blocks) : ranges.status();
        if (st.ok() && blocks.block != 0) st = R.store->set_checksums(a.loc->swap, blocks.crcs);
        if (st.ok()) R.traffic.nvme_write += bytes;
        break;
      }
      default:
        tmp.resize(bytes);
        st = r->read(a.name, tmp.data(), bytes);
        if (st.ok()) {
          if (a.loc->tier == Tier::kDevice) {
            st = R.wait_released(a.param);
          }
          if (st.ok()) st = R.write_array(*a.loc, esz, 0, a.count, tmp.data());
        }
        break;
    }
    if (!st.ok()) {
      I.broken_status = st;
      return st.with_context(fmt::format("engine: restoring {} from {}", a.name, dir));
    }
  }
  const auto& ls = meta["loss_scaler"];
  engine::LossScaler scaler;
  scaler.dynamic = ls.value("dynamic", false);
  scaler.scale = ls.value("scale", 1.0);
  scaler.iter = ls.value("iter", int64_t{0});
  scaler.last_overflow_iter = ls.value("last_overflow_iter", int64_t{-1});
  scaler.hysteresis = ls.value("hysteresis", 1);
  // A checkpoint of the older growth rule (doubling one clean step sooner,
  // see loss_scaler.h): one step earlier for the overflow keeps its cadence,
  // so the scale does not double twice within a window after the resume.
  if (ls.value("growth_rule", std::string()) != "deepspeed-0.19") --scaler.last_overflow_iter;
  const int64_t step = meta.value("step", int64_t{0});
  I.stepper.restore(step, scaler, meta.value("prev_norm", -1.0), meta.value("lr", I.stepper.current_lr()));
  // Each parameter's own step count: those that differ from the engine's were
  // saved (a checkpoint from before per-parameter counts has none: all equal).
  const nlohmann::json no_steps = nlohmann::json::object();
  const nlohmann::json& ps = meta.contains("param_steps") ? meta["param_steps"] : no_steps;
  for (auto& p : R.params) {
    auto it = ps.find(p.name);
    p.updates = p.trainable ? (it != ps.end() ? it->get<int64_t>() : step) : 0;
  }
  I.uploader.invalidate_slots();
  I.reset_step();
  I.broken = false;
  I.broken_status = Status();
  if (extra_json != nullptr) *extra_json = r->info().extra_json;
  return {};
}

}  // namespace strata
