// The trainer's ranks (trainer.h, "Ranks"): which rank this process is, the
// communicator, what rank 0 decides for all (run id, the checkpoint to
// resume, the settings every rank must share), and the small agreements of
// each step (the loss, a stop request). Every function here is a collective
// once there are N ranks: each rank calls it at the same point of its run.
#include <algorithm>

#include "comm/bootstrap.h"
#include "comm/nccl_comm.h"
#include "train/trainer_impl.h"

namespace strata::train {

namespace {

// "key.sub = X here, Y on rank 0" for the first key whose value differs.
std::string first_difference(const json& here, const json& there, const std::string& prefix = "") {
  if (here.is_object() && there.is_object()) {
    // Plain values before nested ones: a different --seq shows as seq, not
    // as the data_shape it implies (keys come in name order).
    for (const bool nested : {false, true})
      for (auto it = here.begin(); it != here.end(); ++it) {
        if (it->is_object() != nested) continue;
        const std::string key = prefix.empty() ? it.key() : prefix + "." + it.key();
        if (!there.contains(it.key())) return fmt::format("{} is set here, not on rank 0", key);
        if (*it != there[it.key()]) return first_difference(*it, there[it.key()], key);
      }
    for (auto it = there.begin(); it != there.end(); ++it)
      if (!here.contains(it.key()))
        return fmt::format("{} is set on rank 0, not here", prefix.empty() ? it.key() : prefix + "." + it.key());
  }
  // The settings hold the global batch (--batch x ranks), which a user reads
  // as their --batch times the world size: say so.
  return fmt::format("{} = {} here, {} on rank 0{}", prefix, clip_for_message(here.dump(), 300),
                     clip_for_message(there.dump(), 300),
                     prefix == "batch" ? " (the global batch: --batch x the number of ranks)" : "");
}

}  // namespace

std::string Trainer::Impl::rank_settings_json() const {
  json t = json::parse(settings_json());
  // Not kept across a resume (they may change then), but the ranks run in
  // step: a rank that evaluates, saves or stops at other steps, or writes
  // elsewhere, would wait for the others until the timeout.
  t["ranks"] = {{"steps", opt.steps},
                {"eval_every", opt.eval_every},
                {"eval_batches", opt.eval_batches},
                {"save_every", opt.save_every},
                {"keep", opt.keep},
                {"resume", !opt.resume_dir.empty()},
                {"export_model", opt.export_model},
                {"export_dtype", opt.export_dtype ? dtype_name(*opt.export_dtype) : "model"},
                {"max_skipped_steps", opt.max_skipped_steps},
                {"compute_dtype", dtype_name(compute_dtype)},
                {"device", train_device_name(opt.device)},
                {"lora_merge", opt.lora.merge}};
  return t.dump();
}

Status Trainer::Impl::agree_on_weights(bool loaded, uint32_t crc) {
  if (world == 1) return {};
  std::vector<double> all;
  const double mine[2] = {loaded ? 1.0 : 0.0, static_cast<double>(crc)};
  STRATA_RETURN_IF_ERROR(all_gather(mine, 2, &all));
  if (!loaded) return {};  // this rank's own error says why
  std::vector<uint32_t> failed, differ;
  for (uint32_t r = 0; r < world; ++r) {
    if (all[2 * r] == 0.0)
      failed.push_back(r);
    else if (all[2 * r + 1] != all[1] && all[0] != 0.0)
      differ.push_back(r);
  }
  if (!failed.empty())
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("rank{} {} could not load the model's weights (its error says why)",
                              failed.size() > 1 ? "s" : "", fmt::join(failed, ", ")));
  if (differ.empty()) return {};
  return Status(StatusCode::kInvalidArgument,
                fmt::format("the weights loaded by rank{} {} differ from rank 0's (checksums of what each read; rank {} "
                            "read --model {}{}): every rank must start from the same model; point every rank at the "
                            "same files",
                            differ.size() > 1 ? "s" : "", fmt::join(differ, ", "), rank, opt.model_dir,
                            opt.lora.adapter_dir.empty() ? "" : " and --lora-adapter " + opt.lora.adapter_dir));
}

Status Trainer::Impl::detect_ranks() {
  auto li = comm::detect_launch();
  if (!li.ok()) return li.status().with_context("the launcher's environment");
  if (li->world_size == 1) return {};
  // GPU ranks (--device cuda) meet over NCCL, rank 0's NCCL id travelling
  // by the TCP rendezvous (torchrun style) or MPI (mpirun); host ranks meet
  // over MPI (mpirun) or TCP sockets (torchrun style).
  const bool gpu = opt.device == TrainDevice::kCuda;
  if (gpu && !comm::nccl_backend_built())
    return Status(StatusCode::kUnavailable,
                  fmt::format("--device cuda with {} ranks: GPU ranks meet over NCCL, which this build does not have "
                              "(CMake found no CUDA or NCCL: install them and rebuild)",
                              li->world_size));
  if (li->launcher == comm::Launcher::kMpirun && !comm::mpi_backend_built())
    return Status(StatusCode::kUnavailable,
                  fmt::format("launched by mpirun with {} ranks, but this build has no MPI backend (CMake did not "
                              "find MPI: install libopenmpi-dev and rebuild)",
                              li->world_size));
  rank = static_cast<uint32_t>(li->rank);
  world = static_cast<uint32_t>(li->world_size);
  local_rank = li->local_rank;
  launcher = li->launcher;
  if (rank != 0) opt.progress = ProgressMode::kQuiet;
  return {};
}

// Rank 0 broadcasts {run id, checkpoint to resume, settings}: its length
// first, then the text. The others take the first two and must have the same
// settings (a different batch or model on one rank would train nonsense).
comm::CommOptions Trainer::Impl::comm_options() const {
  comm::CommOptions co;
  // (Before the device is chosen, by what --device asks for.)
  const bool cuda = backend ? backend->kind() == DeviceKind::kCuda : opt.device == TrainDevice::kCuda;
  co.kind = cuda                                  ? comm::CommBackendKind::kNccl
            : launcher == comm::Launcher::kMpirun ? comm::CommBackendKind::kMpi
                                                  : comm::CommBackendKind::kTcp;
  co.timeout_s = opt.comm_timeout_s;
  // Rank 0 holds MASTER_PORT for the run (no torch process group here to
  // need it): a second job given the same port fails at once.
  co.hold_store = true;
  // A stop signal while the ranks meet ends the wait at once.
  if (const std::atomic<bool>* stop = opt.stop) co.cancel = [stop] { return stop->load(std::memory_order_relaxed); };
  return co;
}

// A rank that fails before the ranks meet (its model, data or out dir
// refused, its budget too small, ...): without a word the others would wait
// --comm-timeout for it (unless a launcher such as torchrun or mpirun ends
// them). It refuses the rendezvous they wait in, naming its error.
Status Trainer::Impl::fail_before_meeting(Status error) {
  if (world <= 1) return error;
  comm::CommOptions co = comm_options();
  if (co.kind == comm::CommBackendKind::kMpi) return error;  // mpirun ends the job
  // Said now: telling the others may wait for rank 0 (still loading its
  // model, say), or for the ranks rank 0 tells. At most a minute.
  co.timeout_s = std::min(co.timeout_s, 60.0);
  log_error("rank {}: {}; telling the other ranks before exiting (at most {:g} s; Ctrl-C ends it)", rank,
            error.message(), co.timeout_s);
  const Status told = comm::refuse_to_meet(backend ? backend->kind() : co.kind == comm::CommBackendKind::kNccl
                                                                           ? DeviceKind::kCuda
                                                                           : DeviceKind::kHost,
                                           co, error.message());
  if (!told.ok()) log_warn("rank {}: could not tell the other ranks: {}", rank, told.message());
  return error;
}

Status Trainer::Impl::join_ranks() {
  if (world == 1) return {};
  const comm::CommOptions co = comm_options();
  auto c = comm::create_communicator(backend.get(), co);
  if (!c.ok()) return c.status().with_context(fmt::format("joining the {} ranks", world));
  comm = std::move(c).value();
  // Every step agrees on the loss and the stop flag through it: kept, not
  // allocated per call.
  constexpr size_t kStaging = 64u << 10;
  STRATA_ASSIGN_OR_RETURN(comm_staging.ptr, backend->alloc(kStaging));
  comm_staging.bytes = kStaging;
  if (static_cast<uint32_t>(comm->rank()) != rank || static_cast<uint32_t>(comm->world_size()) != world)
    return Status(StatusCode::kInternal,
                  fmt::format("the {} communicator says rank {} of {}, the launcher's environment rank {} of {}",
                              comm->backend_name(), comm->rank(), comm->world_size(), rank, world));
  const std::string settings = rank_settings_json();
  std::string text;
  if (rank == 0)
    text = json{{"run_id", run_dir->run_id()},
                {"resume_from", resume_from},
                {"settings", settings},
                {"out_holder", run_dir->holder()}}
               .dump();
  uint64_t len = text.size();
  auto bcast = [&](void* p, size_t n) -> Status {
    return comm::broadcast_host(*comm, stream, p, n, 0, comm_staging);
  };
  STRATA_RETURN_IF_ERROR(bcast(&len, sizeof(len)));
  text.resize(len);
  STRATA_RETURN_IF_ERROR(bcast(text.data(), len));
  const json j = json::parse(text, nullptr, false);
  if (j.is_discarded()) return Status(StatusCode::kInternal, "rank 0's run description did not arrive intact");
  bool same = j["settings"].get<std::string>() == settings;
  STRATA_ASSIGN_OR_RETURN(std::vector<uint32_t> differ, ranks_where(!same));
  if (!same)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("rank {}: its settings differ from rank 0's (every rank must run the same model, data, "
                              "batch, flags and config): {}",
                              rank, first_difference(json::parse(settings), json::parse(j["settings"].get<std::string>()))));
  if (!differ.empty())
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("rank(s) {} run with settings other than rank 0's (the error of each shows the first "
                              "difference)",
                              fmt::join(differ, ", ")));
  // Every rank writes its shard of each checkpoint into OUT: it must be rank
  // 0's directory (the same one, on a filesystem they share), whatever path
  // leads there on this host. Rank 0's lock file says who holds it.
  const std::string holder = j["out_holder"].get<std::string>();
  const std::string seen = rank == 0 ? holder : RunDir::read_holder(opt.out_dir);
  const bool same_out = seen == holder;
  STRATA_ASSIGN_OR_RETURN(std::vector<uint32_t> other_out, ranks_where(!same_out));
  if (!same_out)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("rank {}: --out {} is not rank 0's out dir: its lock file {} {}, rank 0's says \"{}\"; "
                              "every rank must write into the same directory, on a filesystem they share",
                              rank, opt.out_dir, RunDir::lock_path(opt.out_dir),
                              seen.empty() ? "is missing" : "says \"" + seen + "\"", holder));
  if (!other_out.empty())
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("rank(s) {} do not see rank 0's out dir (the error of each says what it sees)",
                              fmt::join(other_out, ", ")));
  if (rank != 0) {
    run_id = j["run_id"].get<std::string>();
    resume_from = j["resume_from"].get<std::string>();
  }
  log_info("rank {} of {} joined ({}, {}; collectives time out after {} s)", rank, world, comm->backend_name(),
           backend->name(), opt.comm_timeout_s);
  return {};
}

Status Trainer::Impl::all_gather(const double* mine, size_t n, std::vector<double>* all) {
  all->assign(n * world, 0.0);
  std::copy(mine, mine + n, all->begin() + static_cast<std::ptrdiff_t>(n * rank));
  if (world == 1) return {};
  return comm::all_gather_host(*comm, stream, all->data() + n * rank, all->data(), n * sizeof(double),
                               comm_staging);
}

Result<std::vector<uint32_t>> Trainer::Impl::ranks_where(bool mine) {
  const double v = mine ? 1.0 : 0.0;
  std::vector<double> all;
  STRATA_RETURN_IF_ERROR(all_gather(&v, 1, &all));
  std::vector<uint32_t> out;
  for (size_t r = 0; r < all.size(); ++r)
    if (all[r] != 0.0) out.push_back(static_cast<uint32_t>(r));
  return out;
}

Result<bool> Trainer::Impl::any_rank(bool mine) {
  STRATA_ASSIGN_OR_RETURN(std::vector<uint32_t> where, ranks_where(mine));
  return !where.empty();
}

Result<bool> Trainer::Impl::stop_requested() {
  const bool mine = (opt.stop != nullptr && opt.stop->load()) || !metrics_error.ok();
  if (world == 1) return mine;
  return any_rank(mine);
}

}  // namespace strata::train
