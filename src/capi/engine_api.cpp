// C API of the offload engine (include/strata/strata.h) over runtime/engine.h.
//
// Every entry point runs its body through guarded(): the one place where a
// C++ exception (std::bad_alloc from a std::string, a bug) is stopped before
// it crosses into C, and where a Status becomes a strata_status_t and the
// engine's last-error text.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <unordered_set>
#include <vector>

#include <fmt/format.h>

#include "capi/c_api_util.h"
#include "capi/engine_handle.h"
#include "common/log.h"
#include "device/device_backend.h"
#include "runtime/config.h"
#include "runtime/engine.h"
#include "strata/strata.h"

namespace strata::capi {
namespace {

strata_tier_t to_c_tier(Tier t) {
  switch (t) {
    case Tier::kAuto: return STRATA_TIER_AUTO;
    case Tier::kDevice: return STRATA_TIER_DEVICE;
    case Tier::kHost: return STRATA_TIER_HOST;
    case Tier::kNvme: return STRATA_TIER_NVME;
  }
  return STRATA_TIER_AUTO;
}

Result<ModelSpec> to_model(const strata_param_desc_t* params, size_t count) {
  ModelSpec model;
  if (count == 0) return Status(StatusCode::kInvalidArgument, "the model has no parameters (param_count is 0)");
  if (!params) return Status(StatusCode::kInvalidArgument, "params is NULL");
  STRATA_RETURN_IF_ERROR(check_struct(params, "params[0]"));
  const size_t stride = params[0].struct_size;
  // The stride between elements: a garbage value would read far past the
  // array (no descriptor will grow to 4 KiB).
  if (stride > 4096)
    return Status(StatusCode::kInvalidArgument,
                  "params[0].struct_size is " + std::to_string(stride) + ", more than 4096: set it to " +
                      "sizeof(strata_param_desc_t) (" + std::to_string(sizeof(strata_param_desc_t)) + ")");
  const auto* base = reinterpret_cast<const unsigned char*>(params);
  model.params.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const auto* d = reinterpret_cast<const strata_param_desc_t*>(base + i * stride);
    const std::string where = "params[" + std::to_string(i) + "]";
    if (d->struct_size != stride)
      return Status(StatusCode::kInvalidArgument, where + ".struct_size is " + std::to_string(d->struct_size) +
                                                      ", params[0].struct_size is " + std::to_string(stride) +
                                                      " (every element must have the same)");
    if (!d->name) return Status(StatusCode::kInvalidArgument, where + ".name is NULL");
    if (!d->group) return Status(StatusCode::kInvalidArgument, where + ".group is NULL (parameter '" + d->name + "')");
    if (d->ndim > STRATA_MAX_DIMS)
      return Status(StatusCode::kInvalidArgument, where + " ('" + d->name + "'): ndim " + std::to_string(d->ndim) +
                                                      " exceeds STRATA_MAX_DIMS (" + std::to_string(STRATA_MAX_DIMS) +
                                                      ")");
    ParamSpec p;
    p.name = d->name;
    p.group = d->group;
    p.shape.assign(d->shape, d->shape + d->ndim);
    auto dt = to_dtype(d->dtype, (where + ".dtype ('" + p.name + "')").c_str());
    if (!dt.ok()) return dt.status();
    p.compute_dtype = dt.value();
    p.trainable = d->frozen == 0;
    p.weight_decay = d->no_weight_decay == 0;
    p.lr_group = d->lr_group;
    model.params.push_back(std::move(p));
  }
  // Shapes, duplicates and empty names: the model's own validation, which
  // names the parameter.
  STRATA_RETURN_IF_ERROR(validate_model_spec(model));
  return model;
}

Result<Config> to_config(const strata_engine_options_t* o) {
  if (o->config_json && o->config_path)
    return Status(StatusCode::kInvalidArgument,
                  "options: set config_json or config_path, not both (config_path is '" + std::string(o->config_path) +
                      "')");
  ConfigNotes notes;
  Result<Config> c = Config{};
  if (o->config_json) c = parse_config(o->config_json, "<config_json>", &notes);
  if (o->config_path) c = load_config_file(o->config_path, &notes);
  // The engine takes each step's lr from the caller (strata_engine_step).
  if (c.ok() && !notes.scheduler_json.empty())
    log_once(LogLevel::kWarn, "capi.scheduler",
             fmt::format("{}: the \"scheduler\" section is not used: the caller gives each step's learning rate "
                         "(strata_engine_step's lr; strata.torch follows the section itself)",
                         o->config_json ? "<config_json>" : o->config_path));
  return c;
}

Status check_count(const Engine& e, uint32_t p, size_t count) {
  const ParamSpec& spec = e.model().params[p];
  if (count != spec.numel())
    return Status(StatusCode::kInvalidArgument, "parameter '" + spec.name + "' has " + std::to_string(spec.numel()) +
                                                    " elements, count is " + std::to_string(count));
  return Status();
}

void fill_step_result(const StepResult& r, strata_step_result_t* out) {
  out->step = r.step;
  out->skipped = r.skipped ? 1 : 0;
  out->skipped_groups = r.skipped_groups;
  out->grad_norm = r.grad_norm;
  out->clip_coef = r.clip_coef;
  out->loss_scale = r.loss_scale;
  out->lr = r.lr;
  out->seconds = r.seconds;
}

char* copy_out(const std::string& s) {
  char* p = static_cast<char*>(std::malloc(s.size() + 1));
  if (!p) throw std::bad_alloc();
  std::memcpy(p, s.data(), s.size() + 1);
  return p;
}

Result<strata_stream*> register_stream(strata_engine* e, Result<DeviceStream*> made) {
  if (!made.ok()) return made.status();
  auto* s = new (std::nothrow) strata_stream{e, made.value()};
  if (!s) {
    (void)e->engine->device().destroy_stream(made.value());
    return Status(StatusCode::kOutOfMemory, "out of memory");
  }
  try {
    std::lock_guard<std::mutex> lock(e->mu);
    e->streams.insert(s);
  } catch (...) {
    (void)e->engine->device().destroy_stream(s->stream);
    delete s;
    throw;
  }
  return s;
}

// For calls on an event handle: NULL and dead handles are recorded on the thread.
template <typename Fn>
strata_status_t on_event(strata_event* ev, const char* fn, Fn&& body) noexcept {
  if (!ev) return fail(Status(StatusCode::kInvalidArgument, std::string(fn) + ": event is NULL"));
  if (!ev->engine)
    return fail(Status(StatusCode::kInvalidArgument, std::string(fn) + ": the event's engine was destroyed"));
  return guarded(ev->engine, fn, std::forward<Fn>(body));
}

}  // namespace
}  // namespace strata::capi

using namespace strata;
using namespace strata::capi;

extern "C" {

void strata_free(void* ptr) { std::free(ptr); }

strata_status_t strata_engine_options_init(strata_engine_options_t* options) {
  if (!options) return invalid("strata_engine_options_init: options is NULL");
  *options = strata_engine_options_t{};
  options->struct_size = sizeof(*options);
  options->device_kind = STRATA_DEVICE_AUTO;
  options->comm_kind = STRATA_COMM_NONE;
  options->mpi_comm = -1;
  return STRATA_OK;
}

namespace {
// STRATA_COMM_MPI: the host backend and a communicator over the caller's MPI
// communicator; STRATA_COMM_TCP: the host backend and a TCP communicator over
// the torchrun-style launcher's ranks; STRATA_COMM_NCCL: the CUDA backend on
// device_ordinal and an NCCL communicator over the launcher's ranks. Owned by
// the handle and lent to the engine.
Status join_ranks(const strata_engine_options_t& o, strata_engine& e, EngineOptions& eo) {
  const int kind = enum_value(o.comm_kind);
  if (o.nccl_comm != nullptr && kind != STRATA_COMM_NCCL)
    return Status(StatusCode::kInvalidArgument,
                  "options.nccl_comm is set but options.comm_kind is not STRATA_COMM_NCCL (it is " +
                      std::to_string(kind) + ")");
  const bool given = o.comm_world_size != 0;
  if (given && kind != STRATA_COMM_TCP && kind != STRATA_COMM_NCCL)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("options.comm_world_size is {} but options.comm_kind is {} (given ranks are for "
                              "STRATA_COMM_TCP and STRATA_COMM_NCCL)",
                              o.comm_world_size, kind));
  if (given && o.nccl_comm != nullptr)
    return Status(StatusCode::kInvalidArgument,
                  "options.comm_world_size is set with options.nccl_comm (the ranks are the NCCL communicator's)");
  if (given && (o.comm_world_size < 0 || o.comm_rank < 0 || o.comm_rank >= o.comm_world_size))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("options.comm_rank {} of options.comm_world_size {}: expected 0 <= rank < world size",
                              o.comm_rank, o.comm_world_size));
  if (given && o.comm_world_size > 1 &&
      (o.comm_store_addr == nullptr || *o.comm_store_addr == '\0' || o.comm_store_port < 1 ||
       o.comm_store_port > 65535))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("options.comm_store_addr '{}' and options.comm_store_port {}: {} ranks need the "
                              "address and port (1..65535) of the TCPStore they meet through",
                              o.comm_store_addr != nullptr ? o.comm_store_addr : "(null)", o.comm_store_port,
                              o.comm_world_size));
  if (kind == STRATA_COMM_NONE) return Status();
  if (kind != STRATA_COMM_MPI && kind != STRATA_COMM_NCCL && kind != STRATA_COMM_TCP)
    return Status(StatusCode::kInvalidArgument, "options.comm_kind: unknown kind " + std::to_string(kind));
  const bool nccl = kind == STRATA_COMM_NCCL, tcp = kind == STRATA_COMM_TCP;
  const char* what = nccl  ? "options.comm_kind STRATA_COMM_NCCL"
                     : tcp ? "options.comm_kind STRATA_COMM_TCP"
                           : "options.comm_kind STRATA_COMM_MPI";
  if (!nccl && enum_value(o.device_kind) == STRATA_DEVICE_CUDA)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{} with STRATA_DEVICE_CUDA: {} ranks run on the host backend; GPU ranks use "
                              "STRATA_COMM_NCCL",
                              what, tcp ? "TCP" : "MPI"));
  if (tcp && o.mpi_comm != -1)
    return Status(StatusCode::kInvalidArgument,
                  "options.mpi_comm is set with options.comm_kind STRATA_COMM_TCP (the ranks come from the "
                  "launcher's environment; an MPI communicator needs STRATA_COMM_MPI)");
  if (nccl && enum_value(o.device_kind) == STRATA_DEVICE_HOST)
    return Status(StatusCode::kInvalidArgument,
                  "options.comm_kind STRATA_COMM_NCCL with STRATA_DEVICE_HOST: NCCL ranks run on GPUs; host ranks "
                  "use STRATA_COMM_MPI or STRATA_COMM_TCP");
  // Finite and bounded: the timeout becomes integer clock ticks (infinity
  // would overflow them); 1e7 s is 115 days.
  if (!(o.comm_timeout_s >= 0 && o.comm_timeout_s <= 1e7))
    return Status(StatusCode::kInvalidArgument, "options.comm_timeout_s is " + std::to_string(o.comm_timeout_s) +
                                                    ": seconds from 0 to 1e7 (0: 300)");
  DeviceBackendOptions d;  // as Engine::create would make it
  d.kind = nccl ? DeviceBackendKind::kCuda : DeviceBackendKind::kHost;
  d.device = o.device_ordinal;
  d.budget_bytes = eo.config.strata.device_memory;
  auto dev = create_device_backend(d);
  if (!dev.ok()) return dev.status().with_context(what);
  e.device = std::move(dev).value();
  comm::CommOptions co;
  co.kind = nccl ? comm::CommBackendKind::kNccl : tcp ? comm::CommBackendKind::kTcp : comm::CommBackendKind::kMpi;
  co.timeout_s = o.comm_timeout_s > 0 ? o.comm_timeout_s : 300.0;
  co.mpi_fortran_comm = o.mpi_comm;
  co.nccl_parent = o.nccl_comm;
  if (given) {
    comm::LaunchInfo li;
    li.launcher = comm::Launcher::kTorchrun;
    li.rank = o.comm_rank;
    li.world_size = o.comm_world_size;
    li.master_addr = o.comm_store_addr != nullptr ? o.comm_store_addr : "";
    li.master_port = static_cast<uint16_t>(o.comm_store_port);
    co.ranks = li;
  }
  if (const volatile int* stop = o.cancel)  // a signal handler's flag or another thread's: a plain int in C
    co.cancel = [stop] { return __atomic_load_n(stop, __ATOMIC_RELAXED) != 0; };
  auto c = comm::create_communicator(e.device.get(), co);
  if (!c.ok()) return c.status().with_context(what);
  e.comm = std::move(c).value();
  eo.device = e.device.get();
  eo.comm = e.comm.get();
  return Status();
}
}  // namespace

strata_status_t strata_engine_create(const strata_engine_options_t* options, const strata_param_desc_t* params,
                                     size_t param_count, strata_engine_t* out) {
  return guarded(nullptr, "strata_engine_create", [&]() -> Status {
    // API 6 callers pass the struct without nccl_comm: it reads as NULL.
    STRATA_RETURN_IF_ERROR(check_struct_since(options, "options", offsetof(strata_engine_options_t, nccl_comm)));
    if (!out) return null_arg("strata_engine_create", "engine");
    strata_engine_options_t whole{};
    std::memcpy(&whole, options, std::min(options->struct_size, sizeof(whole)));
    whole.struct_size = sizeof(whole);
    options = &whole;
    const int device_kind = enum_value(options->device_kind);
    if (device_kind < STRATA_DEVICE_AUTO || device_kind > STRATA_DEVICE_HOST)
      return Status(StatusCode::kInvalidArgument,
                    "options.device_kind: unknown device kind " + std::to_string(device_kind));
    if (options->device_ordinal < 0)
      return Status(StatusCode::kInvalidArgument,
                    "options.device_ordinal is " + std::to_string(options->device_ordinal));
    STRATA_ASSIGN_OR_RETURN(Config config, to_config(options));
    STRATA_ASSIGN_OR_RETURN(ModelSpec model, to_model(params, param_count));

    auto e = std::make_unique<strata_engine>();
    EngineOptions eo;
    eo.config = std::move(config);
    eo.model = std::move(model);
    eo.device_kind = device_kind == STRATA_DEVICE_CUDA   ? DeviceBackendKind::kCuda
                     : device_kind == STRATA_DEVICE_HOST ? DeviceBackendKind::kHost
                                                         : DeviceBackendKind::kAuto;
    eo.device_ordinal = options->device_ordinal;
    STRATA_RETURN_IF_ERROR(join_ranks(*options, *e, eo));
    STRATA_ASSIGN_OR_RETURN(e->engine, Engine::create(eo));
    e->device_name = e->engine->device().name();
    for (uint32_t g = 0; g < e->engine->group_count(); ++g) e->group_names.push_back(e->engine->group_name(g));
    *out = e.release();
    return Status();
  });
}

void strata_engine_destroy(strata_engine_t engine) {
  if (!engine) return;
  try {
    std::unordered_set<strata_stream*> streams;
    {
      std::lock_guard<std::mutex> lock(engine->mu);
      streams.swap(engine->streams);
    }
    if (engine->engine) dlpack_drop_all(engine);
    std::unordered_set<strata_event*> events;
    {
      std::lock_guard<std::mutex> lock(engine->mu);
      events.swap(engine->events);
    }
    for (strata_event* ev : events) {
      if (engine->engine) engine->engine->device().destroy_event(ev->event);
      ev->engine = nullptr;  // dead; strata_event_destroy frees it
      ev->event = nullptr;
    }
    for (strata_stream* s : streams) {
      if (engine->engine) (void)engine->engine->device().destroy_stream(s->stream);
      s->engine = nullptr;  // dead; the caller's strata_stream_destroy frees it
      s->stream = nullptr;
    }
    engine->engine.reset();
  } catch (...) {
    // Destruction has no way to report; the engine's own destructor logs.
  }
  delete engine;
}

const char* strata_engine_last_error(strata_engine_t engine) {
  if (!engine) return "";
  std::lock_guard<std::mutex> lock(engine->mu);
  return engine->last_error.c_str();
}

strata_status_t strata_engine_param_count(strata_engine_t engine, uint32_t* count) {
  return on_engine(engine, "strata_engine_param_count", [&]() -> Status {
    if (!count) return null_arg("strata_engine_param_count", "count");
    *count = static_cast<uint32_t>(engine->engine->model().params.size());
    return Status();
  });
}

strata_status_t strata_engine_group_count(strata_engine_t engine, uint32_t* count) {
  return on_engine(engine, "strata_engine_group_count", [&]() -> Status {
    if (!count) return null_arg("strata_engine_group_count", "count");
    *count = engine->engine->group_count();
    return Status();
  });
}

strata_status_t strata_engine_find_param(strata_engine_t engine, const char* name, uint32_t* param) {
  return on_engine(engine, "strata_engine_find_param", [&]() -> Status {
    if (!name) return null_arg("strata_engine_find_param", "name");
    if (!param) return null_arg("strata_engine_find_param", "param");
    STRATA_ASSIGN_OR_RETURN(*param, engine->engine->find_param(name));
    return Status();
  });
}

strata_status_t strata_engine_find_group(strata_engine_t engine, const char* name, uint32_t* group) {
  return on_engine(engine, "strata_engine_find_group", [&]() -> Status {
    if (!name) return null_arg("strata_engine_find_group", "name");
    if (!group) return null_arg("strata_engine_find_group", "group");
    STRATA_ASSIGN_OR_RETURN(*group, engine->engine->find_group(name));
    return Status();
  });
}

strata_status_t strata_engine_param_info(strata_engine_t engine, uint32_t param, strata_param_info_t* info) {
  return on_engine(engine, "strata_engine_param_info", [&]() -> Status {
    STRATA_RETURN_IF_ERROR(check_struct(info, "info"));
    const Engine& e = *engine->engine;
    STRATA_RETURN_IF_ERROR(check_param(e, param));
    const ParamSpec& p = e.model().params[param];
    STRATA_ASSIGN_OR_RETURN(GroupId g, e.find_group(p.group));
    info->name = p.name.c_str();
    info->group = engine->group_names[g].c_str();
    info->group_id = g;
    info->ndim = static_cast<uint32_t>(p.shape.size());
    for (uint32_t i = 0; i < STRATA_MAX_DIMS; ++i) info->shape[i] = i < p.shape.size() ? p.shape[i] : 0;
    info->numel = p.numel();
    info->dtype = static_cast<strata_dtype_t>(p.compute_dtype);
    info->frozen = p.trainable ? 0 : 1;
    info->no_weight_decay = p.weight_decay ? 0 : 1;
    info->lr_group = p.lr_group;
    return Status();
  });
}

strata_status_t strata_engine_group_info(strata_engine_t engine, uint32_t group, strata_group_info_t* info) {
  return on_engine(engine, "strata_engine_group_info", [&]() -> Status {
    STRATA_RETURN_IF_ERROR(check_struct(info, "info"));
    const Engine& e = *engine->engine;
    STRATA_RETURN_IF_ERROR(check_group(e, group));
    info->name = engine->group_names[group].c_str();
    info->param_count = static_cast<uint32_t>(e.group_params(group).size());
    info->numel = 0;
    info->gathered_compute_bytes = 0;
    for (int k = 0; k < 4; ++k) info->tier[k] = STRATA_TIER_AUTO;
    for (const GroupPlan& gp : e.plan().groups) {
      if (gp.name != engine->group_names[group]) continue;
      info->numel = gp.numel;
      info->gathered_compute_bytes = gp.gathered_compute_bytes;
      for (int k = 0; k < 4; ++k) info->tier[k] = to_c_tier(gp.tier[k]);
    }
    return Status();
  });
}

strata_status_t strata_engine_group_params(strata_engine_t engine, uint32_t group, uint32_t* params,
                                           size_t capacity, size_t* count) {
  return on_engine(engine, "strata_engine_group_params", [&]() -> Status {
    if (!count) return null_arg("strata_engine_group_params", "count");
    const Engine& e = *engine->engine;
    STRATA_RETURN_IF_ERROR(check_group(e, group));
    auto ids = e.group_params(group);
    if (capacity < ids.size())
      return Status(StatusCode::kInvalidArgument, "group '" + engine->group_names[group] + "' has " +
                                                      std::to_string(ids.size()) + " parameters, capacity is " +
                                                      std::to_string(capacity));
    if (!params && !ids.empty()) return null_arg("strata_engine_group_params", "params");
    for (size_t i = 0; i < ids.size(); ++i) params[i] = ids[i];
    *count = ids.size();
    return Status();
  });
}

strata_status_t strata_engine_device(strata_engine_t engine, strata_device_kind_t* kind, const char** name) {
  return on_engine(engine, "strata_engine_device", [&]() -> Status {
    if (!kind) return null_arg("strata_engine_device", "kind");
    if (!name) return null_arg("strata_engine_device", "name");
    *kind = engine->engine->device().kind() == DeviceKind::kCuda ? STRATA_DEVICE_CUDA : STRATA_DEVICE_HOST;
    *name = engine->device_name.c_str();
    return Status();
  });
}

strata_status_t strata_engine_ranks(strata_engine_t engine, uint32_t* rank, uint32_t* world_size) {
  return on_engine(engine, "strata_engine_ranks", [&]() -> Status {
    if (!rank) return null_arg("strata_engine_ranks", "rank");
    if (!world_size) return null_arg("strata_engine_ranks", "world_size");
    *rank = engine->engine->plan().rank;
    *world_size = engine->engine->plan().world_size;
    return Status();
  });
}

strata_status_t strata_engine_plan_report(strata_engine_t engine, char** text) {
  return on_engine(engine, "strata_engine_plan_report", [&]() -> Status {
    if (!text) return null_arg("strata_engine_plan_report", "text");
    *text = copy_out(engine->engine->plan().report());
    return Status();
  });
}

strata_status_t strata_engine_load_param(strata_engine_t engine, uint32_t param, const void* src,
                                         strata_dtype_t dtype, size_t count) {
  return on_engine(engine, "strata_engine_load_param", [&]() -> Status {
    if (!src) return null_arg("strata_engine_load_param", "src");
    STRATA_RETURN_IF_ERROR(check_param(*engine->engine, param));
    STRATA_ASSIGN_OR_RETURN(DType dt, to_dtype(dtype, "dtype"));
    STRATA_RETURN_IF_ERROR(check_count(*engine->engine, param, count));
    return engine->engine->load_param(param, src, dt);
  });
}

strata_status_t strata_engine_read_param(strata_engine_t engine, uint32_t param, void* dst, strata_dtype_t dtype,
                                         size_t count) {
  return on_engine(engine, "strata_engine_read_param", [&]() -> Status {
    if (!dst) return null_arg("strata_engine_read_param", "dst");
    STRATA_RETURN_IF_ERROR(check_param(*engine->engine, param));
    STRATA_ASSIGN_OR_RETURN(DType dt, to_dtype(dtype, "dtype"));
    STRATA_RETURN_IF_ERROR(check_count(*engine->engine, param, count));
    return engine->engine->gather_param(param, dst, dt);  // one rank: read_param
  });
}

strata_status_t strata_engine_broadcast(strata_engine_t engine, void* data, size_t bytes, uint32_t root) {
  return on_engine(engine, "strata_engine_broadcast", [&]() -> Status {
    if (!data && bytes > 0) return null_arg("strata_engine_broadcast", "data");
    return engine->engine->broadcast(data, bytes, root);
  });
}

strata_status_t strata_engine_read_state(strata_engine_t engine, uint32_t param, int state, float* dst,
                                         size_t count) {
  return on_engine(engine, "strata_engine_read_state", [&]() -> Status {
    if (!dst) return null_arg("strata_engine_read_state", "dst");
    STRATA_RETURN_IF_ERROR(check_param(*engine->engine, param));
    STRATA_RETURN_IF_ERROR(check_count(*engine->engine, param, count));
    if (engine->engine->plan().world_size > 1)
      return Status(StatusCode::kUnavailable,
                    "strata_engine_read_state with N ranks: each rank holds only its shard of the states, and "
                    "gathering them is not built yet; save a checkpoint, which holds every rank's");
    return engine->engine->read_state(param, state, dst);
  });
}

strata_status_t strata_engine_load_state(strata_engine_t engine, uint32_t param, int state, const float* src,
                                         size_t count) {
  return on_engine(engine, "strata_engine_load_state", [&]() -> Status {
    if (!src) return null_arg("strata_engine_load_state", "src");
    STRATA_RETURN_IF_ERROR(check_param(*engine->engine, param));
    STRATA_RETURN_IF_ERROR(check_count(*engine->engine, param, count));
    return engine->engine->load_state(param, state, src);
  });
}

strata_status_t strata_engine_param_steps(strata_engine_t engine, uint32_t param, int64_t* steps) {
  return on_engine(engine, "strata_engine_param_steps", [&]() -> Status {
    if (!steps) return null_arg("strata_engine_param_steps", "steps");
    STRATA_RETURN_IF_ERROR(check_param(*engine->engine, param));
    STRATA_ASSIGN_OR_RETURN(*steps, engine->engine->param_steps(param));
    return Status();
  });
}

strata_status_t strata_engine_set_param_steps(strata_engine_t engine, uint32_t param, int64_t steps) {
  return on_engine(engine, "strata_engine_set_param_steps", [&]() -> Status {
    STRATA_RETURN_IF_ERROR(check_param(*engine->engine, param));
    return engine->engine->set_param_steps(param, steps);
  });
}

strata_status_t strata_engine_begin_micro_batch(strata_engine_t engine, int last) {
  return on_engine(engine, "strata_engine_begin_micro_batch", [&]() -> Status {
    (void)dlpack_collect(engine, false);
    return engine->engine->begin_micro_batch(last != 0);
  });
}

strata_status_t strata_engine_acquire(strata_engine_t engine, uint32_t group, strata_stream_t stream, void** ptrs,
                                      size_t capacity, size_t* count) {
  return on_engine(engine, "strata_engine_acquire", [&]() -> Status {
    if (!count) return null_arg("strata_engine_acquire", "count");
    Engine& e = *engine->engine;
    STRATA_RETURN_IF_ERROR(check_group(e, group));
    STRATA_ASSIGN_OR_RETURN(DeviceStream * s, stream_arg(engine, stream));
    // Checked before acquiring, so a short array leaves nothing acquired.
    const size_t n = e.group_params(group).size();
    if (capacity < n)
      return Status(StatusCode::kInvalidArgument, "group '" + engine->group_names[group] + "' has " +
                                                      std::to_string(n) + " parameters, capacity is " +
                                                      std::to_string(capacity));
    if (!ptrs && n > 0) return null_arg("strata_engine_acquire", "ptrs");
    STRATA_ASSIGN_OR_RETURN(GroupView view, e.acquire(group, s));
    for (size_t i = 0; i < view.ptr.size(); ++i) ptrs[i] = view.ptr[i];
    *count = view.ptr.size();
    return Status();
  });
}

strata_status_t strata_engine_release(strata_engine_t engine, uint32_t group, strata_stream_t stream) {
  return on_engine(engine, "strata_engine_release", [&]() -> Status {
    STRATA_RETURN_IF_ERROR(check_group(*engine->engine, group));
    STRATA_ASSIGN_OR_RETURN(DeviceStream * s, stream_arg(engine, stream));
    return engine->engine->release(group, s);
  });
}

strata_status_t strata_engine_reduce_grad(strata_engine_t engine, uint32_t param, const void* grad,
                                          strata_dtype_t dtype, strata_stream_t stream) {
  return on_engine(engine, "strata_engine_reduce_grad", [&]() -> Status {
    if (!grad) return null_arg("strata_engine_reduce_grad", "grad");
    STRATA_RETURN_IF_ERROR(check_param(*engine->engine, param));
    STRATA_ASSIGN_OR_RETURN(DType dt, to_dtype(dtype, "dtype"));
    STRATA_ASSIGN_OR_RETURN(DeviceStream * s, stream_arg(engine, stream));
    return engine->engine->reduce_grad(param, grad, dt, s);
  });
}

strata_status_t strata_engine_discard_step(strata_engine_t engine, strata_stream_t stream) {
  return on_engine(engine, "strata_engine_discard_step", [&]() -> Status {
    DeviceStream* s = nullptr;
    if (stream) {
      STRATA_ASSIGN_OR_RETURN(s, stream_arg(engine, stream));
    }
    Status st = engine->engine->discard_step(s);
    Status given = dlpack_collect(engine, true);  // discard waited for the reads
    return st.ok() ? given : st;
  });
}

strata_status_t strata_engine_step(strata_engine_t engine, double lr, strata_step_result_t* result) {
  return on_engine(engine, "strata_engine_step", [&]() -> Status {
    if (result) {
      STRATA_RETURN_IF_ERROR(check_struct(result, "result"));
    }
    STRATA_ASSIGN_OR_RETURN(StepResult r, engine->engine->step(lr));
    STRATA_RETURN_IF_ERROR(dlpack_collect(engine, true));  // the step read every gradient
    if (result) fill_step_result(r, result);
    return Status();
  });
}

strata_status_t strata_engine_synchronize(strata_engine_t engine) {
  return on_engine(engine, "strata_engine_synchronize", [&]() -> Status { return engine->engine->synchronize(); });
}

strata_status_t strata_engine_set_lr(strata_engine_t engine, double lr) {
  return on_engine(engine, "strata_engine_set_lr", [&]() -> Status {
    if (!std::isfinite(lr) || lr < 0)
      return Status(StatusCode::kInvalidArgument, "lr " + std::to_string(lr) + " must be finite and >= 0");
    engine->engine->set_lr(lr);
    return Status();
  });
}

strata_status_t strata_engine_set_group_betas(strata_engine_t engine, uint32_t lr_group, double beta1,
                                              double beta2) {
  return on_engine(engine, "strata_engine_set_group_betas",
                   [&]() -> Status { return engine->engine->set_group_betas(lr_group, beta1, beta2); });
}

strata_status_t strata_engine_set_group_lr(strata_engine_t engine, uint32_t lr_group, double lr) {
  return on_engine(engine, "strata_engine_set_group_lr",
                   [&]() -> Status { return engine->engine->set_group_lr(lr_group, lr); });
}

strata_status_t strata_engine_loss_scale(strata_engine_t engine, double* scale) {
  return on_engine(engine, "strata_engine_loss_scale", [&]() -> Status {
    if (!scale) return null_arg("strata_engine_loss_scale", "scale");
    *scale = engine->engine->loss_scale();
    return Status();
  });
}

strata_status_t strata_engine_step_count(strata_engine_t engine, int64_t* steps) {
  return on_engine(engine, "strata_engine_step_count", [&]() -> Status {
    if (!steps) return null_arg("strata_engine_step_count", "steps");
    *steps = engine->engine->step_count();
    return Status();
  });
}

strata_status_t strata_engine_save_checkpoint(strata_engine_t engine, const char* dir, const char* extra_json) {
  return on_engine(engine, "strata_engine_save_checkpoint", [&]() -> Status {
    if (!dir) return null_arg("strata_engine_save_checkpoint", "dir");
    return engine->engine->save_checkpoint(dir, extra_json ? std::string_view(extra_json) : std::string_view());
  });
}

strata_status_t strata_engine_load_checkpoint(strata_engine_t engine, const char* dir, char** extra_json) {
  return on_engine(engine, "strata_engine_load_checkpoint", [&]() -> Status {
    if (!dir) return null_arg("strata_engine_load_checkpoint", "dir");
    std::string extra;
    STRATA_RETURN_IF_ERROR(engine->engine->load_checkpoint(dir, &extra));
    if (extra_json) *extra_json = copy_out(extra);
    return Status();
  });
}

strata_status_t strata_engine_stats(strata_engine_t engine, strata_engine_stats_t* stats) {
  return on_engine(engine, "strata_engine_stats", [&]() -> Status {
    // API 6 callers pass the struct without gathers_ahead: left unwritten.
    STRATA_RETURN_IF_ERROR(check_struct_since(stats, "stats", offsetof(strata_engine_stats_t, gathers_ahead)));
    const EngineStats s = engine->engine->stats();
    for (int t = 0; t < 4; ++t) stats->tier_bytes[t] = s.tier_bytes[t];
    stats->device_buffer_bytes = s.device_buffer_bytes;
    stats->pinned_bytes = s.pinned_bytes;
    stats->nvme_read_bytes = s.nvme_read_bytes;
    stats->nvme_write_bytes = s.nvme_write_bytes;
    stats->h2d_bytes = s.h2d_bytes;
    stats->d2h_bytes = s.d2h_bytes;
    stats->acquires = s.acquires;
    stats->prefetch_hits = s.prefetch_hits;
    stats->prefetch_misses = s.prefetch_misses;
    stats->order_changes = s.order_changes;
    stats->hot_path_allocs = s.hot_path_allocs;
    stats->steps = s.steps;
    stats->skipped_steps = s.skipped_steps;
    stats->comm_bytes = s.comm_bytes;
    if (fits(stats, offsetof(strata_engine_stats_t, gathers_ahead), sizeof(stats->gathers_ahead)))
      stats->gathers_ahead = s.gathers_ahead;
    if (fits(stats, offsetof(strata_engine_stats_t, gathers_reused), sizeof(stats->gathers_reused)))
      stats->gathers_reused = s.gathers_reused;
    return Status();
  });
}

strata_status_t strata_engine_trace_begin(strata_engine_t engine, const char* name) {
  return on_engine(engine, "strata_engine_trace_begin", [&]() -> Status {
    if (!name) return null_arg("strata_engine_trace_begin", "name");
    if (!engine->engine->tracer()) return Status();
    // The engine may keep the pointer until the span ends (or the trace is
    // written), so it gets an interned copy that lives as long as the engine.
    const char* stable = nullptr;
    {
      std::lock_guard<std::mutex> lock(engine->mu);
      stable = engine->trace_names.insert(name).first->c_str();
    }
    engine->engine->trace_begin(stable);
    return Status();
  });
}

strata_status_t strata_engine_trace_end(strata_engine_t engine) {
  return on_engine(engine, "strata_engine_trace_end", [&]() -> Status {
    engine->engine->trace_end();
    return Status();
  });
}

strata_status_t strata_stream_create(strata_engine_t engine, const char* name, strata_stream_t* stream) {
  return on_engine(engine, "strata_stream_create", [&]() -> Status {
    if (!stream) return null_arg("strata_stream_create", "stream");
    STRATA_ASSIGN_OR_RETURN(
        *stream, register_stream(engine, engine->engine->device().create_stream(name ? name : "stream")));
    return Status();
  });
}

strata_status_t strata_stream_wrap(strata_engine_t engine, void* native, strata_stream_t* stream) {
  return on_engine(engine, "strata_stream_wrap", [&]() -> Status {
    if (!stream) return null_arg("strata_stream_wrap", "stream");
    char label[48];
    std::snprintf(label, sizeof(label), "caller stream %p", native);
    STRATA_ASSIGN_OR_RETURN(*stream,
                            register_stream(engine, engine->engine->device().wrap_native_stream(native, label)));
    return Status();
  });
}

strata_status_t strata_stream_destroy(strata_stream_t stream) {
  if (!stream) return STRATA_OK;
  strata_engine* e = stream->engine;
  if (!e) {  // its engine is gone, and the device stream with it
    delete stream;
    return STRATA_OK;
  }
  strata_status_t rc = guarded(e, "strata_stream_destroy", [&]() -> Status {
    {
      std::lock_guard<std::mutex> lock(e->mu);
      e->streams.erase(stream);
    }
    return e->engine->device().destroy_stream(stream->stream);
  });
  delete stream;
  return rc;
}

strata_status_t strata_stream_synchronize(strata_stream_t stream) {
  return on_stream(stream, "strata_stream_synchronize",
                   [&]() -> Status { return stream->engine->engine->device().synchronize(stream->stream); });
}

strata_status_t strata_event_create(strata_engine_t engine, strata_event_t* event) {
  return on_engine(engine, "strata_event_create", [&]() -> Status {
    if (!event) return null_arg("strata_event_create", "event");
    STRATA_ASSIGN_OR_RETURN(DeviceEvent * ev, engine->engine->device().create_event());
    auto* h = new (std::nothrow) strata_event{engine, ev};
    if (!h) {
      engine->engine->device().destroy_event(ev);
      return Status(StatusCode::kOutOfMemory, "out of memory");
    }
    try {
      std::lock_guard<std::mutex> lock(engine->mu);
      engine->events.insert(h);
    } catch (...) {
      engine->engine->device().destroy_event(ev);
      delete h;
      throw;
    }
    *event = h;
    return Status();
  });
}

strata_status_t strata_event_destroy(strata_event_t event) {
  if (!event) return STRATA_OK;
  strata_engine* e = event->engine;
  if (e) {
    {
      std::lock_guard<std::mutex> lock(e->mu);
      e->events.erase(event);
    }
    e->engine->device().destroy_event(event->event);
  }
  delete event;
  return STRATA_OK;
}

strata_status_t strata_event_record(strata_event_t event, strata_stream_t stream) {
  return on_event(event, "strata_event_record", [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(DeviceStream * s, stream_arg(event->engine, stream));
    return event->engine->engine->device().record(event->event, s);
  });
}

strata_status_t strata_stream_wait_event(strata_stream_t stream, strata_event_t event) {
  return on_event(event, "strata_stream_wait_event", [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(DeviceStream * s, stream_arg(event->engine, stream));
    return event->engine->engine->device().wait(s, event->event);
  });
}

strata_status_t strata_event_query(strata_event_t event, int* done) {
  return on_event(event, "strata_event_query", [&]() -> Status {
    if (!done) return null_arg("strata_event_query", "done");
    STRATA_ASSIGN_OR_RETURN(bool d, event->engine->engine->device().query(event->event));
    *done = d ? 1 : 0;
    return Status();
  });
}

strata_status_t strata_event_synchronize(strata_event_t event) {
  return on_event(event, "strata_event_synchronize",
                  [&]() -> Status { return event->engine->engine->device().synchronize(event->event); });
}

strata_status_t strata_device_alloc(strata_engine_t engine, size_t bytes, void** ptr) {
  return on_engine(engine, "strata_device_alloc", [&]() -> Status {
    if (!ptr) return null_arg("strata_device_alloc", "ptr");
    STRATA_ASSIGN_OR_RETURN(*ptr, engine->engine->device().alloc(bytes));
    return Status();
  });
}

strata_status_t strata_device_free(strata_engine_t engine, void* ptr, strata_stream_t after) {
  return on_engine(engine, "strata_device_free", [&]() -> Status {
    if (!ptr) return Status();
    DeviceStream* s = nullptr;
    if (after) {
      STRATA_ASSIGN_OR_RETURN(s, stream_arg(engine, after));
    }
    return engine->engine->device().free(ptr, s);
  });
}

strata_status_t strata_memcpy_async(void* dst, const void* src, size_t bytes, strata_copy_kind_t kind,
                                    strata_stream_t stream) {
  return on_stream(stream, "strata_memcpy_async", [&]() -> Status {
    if (!dst) return null_arg("strata_memcpy_async", "dst");
    if (!src) return null_arg("strata_memcpy_async", "src");
    CopyKind k;
    switch (enum_value(kind)) {
      case STRATA_COPY_HOST_TO_DEVICE: k = CopyKind::kHostToDevice; break;
      case STRATA_COPY_DEVICE_TO_HOST: k = CopyKind::kDeviceToHost; break;
      case STRATA_COPY_DEVICE_TO_DEVICE: k = CopyKind::kDeviceToDevice; break;
      default: return Status(StatusCode::kInvalidArgument, "unknown copy kind " + std::to_string(enum_value(kind)));
    }
    return stream->engine->engine->device().copy_async(dst, src, bytes, k, stream->stream);
  });
}

}  // extern "C"
