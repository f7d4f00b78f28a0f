#include "runtime/config.h"

#include <fmt/format.h>
#include <strings.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "common/enum_names.h"
#include "common/json.h"
#include "common/log.h"
#include "common/units.h"

namespace strata {

using json = nlohmann::json;

// The names, in the order error messages list them.
template <>
inline constexpr auto kEnumNames<Tier> = std::to_array<EnumName<Tier>>(
    {{Tier::kAuto, "auto"}, {Tier::kDevice, "device"}, {Tier::kHost, "host"}, {Tier::kNvme, "nvme"}});
template <>
inline constexpr auto kEnumNames<OffloadDevice> = std::to_array<EnumName<OffloadDevice>>(
    {{OffloadDevice::kNone, "none"},
     {OffloadDevice::kCpu, "cpu"},
     {OffloadDevice::kNvme, "nvme"},
     {OffloadDevice::kAuto, "auto"}});
template <>
inline constexpr auto kEnumNames<IoBackendChoice> = std::to_array<EnumName<IoBackendChoice>>(
    {{IoBackendChoice::kAuto, "auto"},
     {IoBackendChoice::kUring, "uring"},
     {IoBackendChoice::kAio, "aio"},
     {IoBackendChoice::kPosix, "posix"}});
template <>
inline constexpr auto kEnumNames<OptimizerType> =
    std::to_array<EnumName<OptimizerType>>({{OptimizerType::kAdam, "Adam"}, {OptimizerType::kAdamW, "AdamW"}});

template <>
inline constexpr auto kEnumNames<cpu_optim::StateRounding> = std::to_array<EnumName<cpu_optim::StateRounding>>(
    {{cpu_optim::StateRounding::kStochastic, "stochastic"}, {cpu_optim::StateRounding::kNearest, "nearest"}});

const char* tier_name(Tier t) { return enum_name(t); }
const char* offload_device_name(OffloadDevice d) { return enum_name(d); }
const char* io_backend_name(IoBackendChoice b) { return enum_name(b); }

DType Config::compute_dtype() const {
  if (bf16) return DType::kBF16;
  if (fp16.enabled) return DType::kF16;
  return DType::kF32;
}

std::vector<NvmeDir> Config::nvme_dirs() const {
  std::vector<NvmeDir> dirs = strata.nvme;
  auto add = [&](const std::string& path) {
    if (path.empty()) return;
    for (const auto& d : dirs)
      if (d.path == path) return;
    dirs.push_back(NvmeDir{path, 0});
  };
  add(zero.offload_param.nvme_path);
  add(zero.offload_optimizer.nvme_path);
  return dirs;
}

namespace {

// ------------------------------------------------------------------ helpers

// Keys are the user's: clipped, so a 5 MB key is not echoed whole.
std::string join_path(const std::string& parent, std::string_view key) {
  std::string k = clip_for_message(key, 60);
  return parent.empty() ? k : parent + "." + k;
}

// The offending value as the user wrote it (strings quoted), kept short.
std::string show(const json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

Status key_error(const std::string& path, const std::string& what) {
  return Status(StatusCode::kInvalidArgument, path + ": " + what);
}

Status expected(const std::string& path, std::string_view what, const json& got) {
  return key_error(path, fmt::format("expected {}, got {}", what, show(got)));
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// Per-parse state: where warnings and ignored keys go.
struct Ctx {
  ConfigNotes notes;
};

// Walks one JSON object: every key must be taken, ignored or rejected, and
// finish() reports the rest as unknown (with a suggestion when one is close).
class Obj {
 public:
  // allow_auto: accept the "auto" placeholder Hugging Face writes into
  // DeepSpeed configs, meaning "keep the default" (DeepSpeed sections only;
  // Strata's own keys must say what they mean).
  Obj(const json& v, std::string path, Ctx& ctx, bool allow_auto)
      : v_(v), path_(std::move(path)), ctx_(ctx), allow_auto_(allow_auto) {}

  const std::string& path() const { return path_; }
  std::string child(std::string_view key) const { return join_path(path_, key); }
  Ctx& ctx() { return ctx_; }
  bool allow_auto() const { return allow_auto_; }

  // The value of `key`, or nullptr when it is absent or null (null means
  // "default" as in DeepSpeed's Python configs) or, in DeepSpeed sections,
  // the string "auto".
  const json* take(std::string_view key) {
    known_.emplace(key);
    auto it = v_.find(key);
    if (it == v_.end()) return nullptr;
    seen_.emplace(key);
    if (it->is_null()) return nullptr;
    if (allow_auto_ && it->is_string() && it->get_ref<const std::string&>() == "auto") {
      ctx_.notes.auto_keys.push_back(child(key));
      return nullptr;
    }
    return &*it;
  }
  // As take(), but "auto" is returned as a value.
  const json* take_raw(std::string_view key) {
    known_.emplace(key);
    auto it = v_.find(key);
    if (it == v_.end()) return nullptr;
    seen_.emplace(key);
    return it->is_null() ? nullptr : &*it;
  }
  // True when `key` holds a value take() would return (not null, not "auto").
  bool has(std::string_view key) const {
    auto it = v_.find(key);
    if (it == v_.end() || it->is_null()) return false;
    return !(allow_auto_ && it->is_string() && it->get_ref<const std::string&>() == "auto");
  }

  // DeepSpeed keys Strata accepts but does not act on.
  void ignore(std::initializer_list<std::string_view> keys) {
    for (auto key : keys) {
      known_.emplace(key);
      if (v_.contains(key)) {
        seen_.emplace(key);
        ctx_.notes.ignored_keys.push_back(child(key));
      }
    }
  }

  // DeepSpeed features Strata refuses because dropping them silently would
  // change what is trained. {"enabled": false} is accepted (and ignored).
  Status reject(std::string_view key, std::string_view reason) {
    known_.emplace(key);
    auto it = v_.find(key);
    if (it == v_.end() || it->is_null()) return Status::ok_status();
    seen_.emplace(key);
    if (it->is_object()) {
      auto en = it->find("enabled");
      if (en != it->end() && en->is_boolean() && !en->get<bool>()) {
        ctx_.notes.ignored_keys.push_back(child(key));
        return Status::ok_status();
      }
    }
    return key_error(child(key), fmt::format("DeepSpeed feature not supported by Strata: {}", reason));
  }

  Status finish() const {
    for (auto it = v_.begin(); it != v_.end(); ++it) {
      if (seen_.count(it.key())) continue;
      std::string best;
      size_t best_d = 3;
      // A suggestion only for a key that could be a typo of one (edit
      // distance is quadratic in the key's length).
      if (it.key().size() <= 64) {
        for (const auto& k : known_) {
          size_t d = edit_distance(it.key(), k);
          if (d < best_d) {
            best_d = d;
            best = k;
          }
        }
      }
      std::string msg = "unknown key";
      if (!best.empty()) msg += fmt::format(" (did you mean \"{}\"?)", best);
      return key_error(child(it.key()), msg);
    }
    return Status::ok_status();
  }

 private:
  const json& v_;
  std::string path_;
  Ctx& ctx_;
  bool allow_auto_;
  std::set<std::string, std::less<>> seen_;
  std::set<std::string, std::less<>> known_;
};

// An integral JSON number (1e9 written as a float counts: DeepSpeed configs
// often say "buffer_size": 1e8). Sets *out and returns true if so.
bool as_uint(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer()) {
    int64_t i = v.get<int64_t>();
    if (i < 0) return false;
    *out = static_cast<uint64_t>(i);
    return true;
  }
  if (v.is_number_float()) {
    double d = v.get<double>();
    if (!(d >= 0) || d >= 18446744073709551616.0 || std::floor(d) != d) return false;
    *out = static_cast<uint64_t>(d);
    return true;
  }
  return false;
}

Status read_bool(Obj& o, std::string_view key, bool* out) {
  const json* v = o.take(key);
  if (!v) return Status::ok_status();
  if (!v->is_boolean()) return expected(o.child(key), "true or false", *v);
  *out = v->get<bool>();
  return Status::ok_status();
}

// A boolean whose absence (or null) means "Strata decides".
Status read_bool(Obj& o, std::string_view key, std::optional<bool>* out) {
  const json* v = o.take(key);
  if (!v || v->is_null()) return Status::ok_status();
  if (!v->is_boolean()) return expected(o.child(key), "true, false or null", *v);
  *out = v->get<bool>();
  return Status::ok_status();
}

template <typename T>
Status read_uint(Obj& o, std::string_view key, T* out, uint64_t min, uint64_t max) {
  const json* v = o.take(key);
  if (!v) return Status::ok_status();
  uint64_t n = 0;
  const bool ok = as_uint(*v, &n);
  if (ok && n >= min && n <= max) {
    *out = static_cast<T>(n);
    return Status::ok_status();
  }
  if (max == std::numeric_limits<uint64_t>::max() || (!ok && max >= (uint64_t{1} << 62))) {
    if (min == 0) return expected(o.child(key), "a non-negative integer", *v);
    if (min == 1) return expected(o.child(key), "a positive integer", *v);
    return expected(o.child(key), fmt::format("an integer of at least {}", min), *v);
  }
  return expected(o.child(key), fmt::format("an integer from {} to {}", min, max), *v);
}

// A byte count: an integer, or a string such as "24GiB" (common/units.h).
Status read_size(Obj& o, std::string_view key, uint64_t* out) {
  const json* v = o.take(key);
  if (!v) return Status::ok_status();
  const char* what = "a size in bytes (an integer or a string like \"24GiB\")";
  uint64_t n = 0;
  if (v->is_string()) {
    auto r = parse_bytes(v->get_ref<const std::string&>());
    if (!r.ok()) {
      // parse_bytes says 'invalid size "<text>": <why>'; keep the why.
      std::string why = r.status().message();
      auto colon = why.find("\": ");
      if (colon != std::string::npos) why = why.substr(colon + 3);
      return key_error(o.child(key), fmt::format("expected {}, got {}: {}", what, show(*v), why));
    }
    n = r.value();
  } else if (!as_uint(*v, &n)) {
    return expected(o.child(key), what, *v);
  }
  *out = n;
  return Status::ok_status();
}

// A real number in [min, max] (exclusive at min when `min_open`).
Status read_double(Obj& o, std::string_view key, double* out, double min, double max, bool min_open = false) {
  const json* v = o.take(key);
  if (!v) return Status::ok_status();
  if (v->is_number() && !v->is_boolean()) {
    double d = v->get<double>();
    if (std::isfinite(d) && (min_open ? d > min : d >= min) && d <= max) {
      *out = d;
      return Status::ok_status();
    }
  }
  std::string what;
  if (max == std::numeric_limits<double>::max())
    what = min_open ? fmt::format("a number greater than {}", min) : fmt::format("a number of at least {}", min);
  else if (min_open)
    what = fmt::format("a number greater than {} and at most {}", min, max);
  else
    what = fmt::format("a number from {} to {}", min, max);
  return expected(o.child(key), what, *v);
}

Status read_string(Obj& o, std::string_view key, std::string* out, bool allow_empty = true) {
  const json* v = o.take(key);
  if (!v) return Status::ok_status();
  if (!v->is_string() || (!allow_empty && v->get_ref<const std::string&>().empty()))
    return expected(o.child(key), allow_empty ? "a string" : "a non-empty string", *v);
  *out = v->get<std::string>();
  return Status::ok_status();
}

// A string naming one of `names` (an enum's kEnumNames table, or a subset of
// one); the error lists them: "auto", "device", "host" or "nvme".
template <typename E, size_t N>
Status read_enum(Obj& o, std::string_view key, E* out, const std::array<EnumName<E>, N>& names,
                 bool ignore_case = false) {
  const json* v = o.take(key);
  if (!v) return Status::ok_status();
  std::string choices;
  for (size_t i = 0; i < N; ++i)
    choices += fmt::format("{}\"{}\"", i == 0 ? "" : (i + 1 == N ? " or " : ", "), names[i].name);
  if (!v->is_string()) return expected(o.child(key), choices, *v);
  std::string s = v->get<std::string>();
  for (size_t i = 0; i < N; ++i) {
    // Lengths first: "AdamW\u0000junk" is not "AdamW".
    bool eq = ignore_case ? s.size() == std::strlen(names[i].name) && strcasecmp(s.c_str(), names[i].name) == 0
                          : s == names[i].name;
    if (eq) {
      *out = names[i].value;
      return Status::ok_status();
    }
  }
  return expected(o.child(key), choices, *v);
}

// Runs `fn(Obj&)` on the object at `key` (absent/null: nothing).
template <typename Fn>
Status read_object(Obj& parent, std::string_view key, Fn&& fn, bool allow_auto) {
  // A section is an object: "auto" stands for a value, not for a section
  // (DeepSpeed fails on {"optimizer": "auto"} too), so it is no default here.
  const json* v = parent.take_raw(key);
  if (!v) return Status::ok_status();
  if (!v->is_object()) return expected(parent.child(key), "an object", *v);
  Obj o(*v, parent.child(key), parent.ctx(), allow_auto);
  STRATA_RETURN_IF_ERROR(fn(o));
  return o.finish();
}

// A DeepSpeed key Strata takes only at the value that means what Strata does
// anyway (`same`): listed as not used there, refused naming it otherwise
// (`why`: what Strata does instead).
template <typename Same>
Status accept_only(Obj& o, std::string_view key, Same&& same, std::string_view why) {
  const json* v = o.take(key);
  if (!v) return Status::ok_status();  // absent, null or "auto": DeepSpeed's default
  if (!same(*v)) return key_error(o.child(key), fmt::format("is {}: not supported by Strata ({})", show(*v), why));
  o.ctx().notes.ignored_keys.push_back(o.child(key));
  return Status::ok_status();
}

bool is_fp32_name(const json& v) {  // as DeepSpeed, any case
  if (!v.is_string()) return false;
  std::string s = v.get<std::string>();
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s == "fp32" || s == "float32" || s == "torch.float32" || s == "float";
}

// ------------------------------------------------------------------ sections

Status read_offload_device(Obj& o, OffloadDevice* out) {
  // "auto" here is Strata's own value (the planner decides), not DeepSpeed's
  // "keep the default" placeholder, so read it without take()'s filter.
  const json* v = o.take_raw("device");
  if (!v) return Status::ok_status();
  if (v->is_string()) {
    if (std::optional<OffloadDevice> d = find_enum<OffloadDevice>(v->get_ref<const std::string&>())) {
      *out = *d;
      return Status::ok_status();
    }
  }
  return expected(o.child("device"), enum_name_list<OffloadDevice>(", ", "\"", " or "), *v);
}

Status read_offload_param(Obj& o, OffloadParamConfig* c) {
  c->device = OffloadDevice::kNone;  // DeepSpeed's default once the object is present
  STRATA_RETURN_IF_ERROR(read_offload_device(o, &c->device));
  STRATA_RETURN_IF_ERROR(read_string(o, "nvme_path", &c->nvme_path));
  STRATA_RETURN_IF_ERROR(read_uint(o, "buffer_count", &c->buffer_count, 1, std::numeric_limits<uint64_t>::max()));
  STRATA_RETURN_IF_ERROR(read_uint(o, "buffer_size", &c->buffer_size, 1, std::numeric_limits<uint64_t>::max()));
  STRATA_RETURN_IF_ERROR(read_uint(o, "max_in_cpu", &c->max_in_cpu, 0, std::numeric_limits<uint64_t>::max()));
  STRATA_RETURN_IF_ERROR(read_bool(o, "pin_memory", &c->pin_memory));
  return Status::ok_status();
}

Status read_offload_optimizer(Obj& o, OffloadOptimizerConfig* c) {
  c->device = OffloadDevice::kNone;
  STRATA_RETURN_IF_ERROR(read_offload_device(o, &c->device));
  STRATA_RETURN_IF_ERROR(read_string(o, "nvme_path", &c->nvme_path));
  STRATA_RETURN_IF_ERROR(read_uint(o, "buffer_count", &c->buffer_count, 1, std::numeric_limits<uint64_t>::max()));
  STRATA_RETURN_IF_ERROR(read_bool(o, "pin_memory", &c->pin_memory));
  STRATA_RETURN_IF_ERROR(read_bool(o, "pipeline_read", &c->pipeline_read));
  STRATA_RETURN_IF_ERROR(read_bool(o, "pipeline_write", &c->pipeline_write));
  STRATA_RETURN_IF_ERROR(read_bool(o, "fast_init", &c->fast_init));
  STRATA_RETURN_IF_ERROR(read_double(o, "ratio", &c->ratio, 0.0, 1.0));
  if (c->ratio < 1.0)
    o.ctx().notes.warnings.push_back(fmt::format(
        "{}: {} asks DeepSpeed to keep part of the optimizer states on the GPU; Strata keeps them all on host or "
        "NVMe (use strata.groups to choose per group)",
        o.child("ratio"), c->ratio));
  return Status::ok_status();
}

Status read_zero(Obj& o, ZeroConfig* z) {
  z->stage_given = o.has("stage");
  STRATA_RETURN_IF_ERROR(read_uint(o, "stage", &z->stage, 0, 3));
  STRATA_RETURN_IF_ERROR(read_object(
      o, "offload_param", [&](Obj& s) { return read_offload_param(s, &z->offload_param); }, true));
  STRATA_RETURN_IF_ERROR(read_object(
      o, "offload_optimizer", [&](Obj& s) { return read_offload_optimizer(s, &z->offload_optimizer); }, true));
  STRATA_RETURN_IF_ERROR(read_uint(o, "sub_group_size", &z->sub_group_size, 1, std::numeric_limits<uint64_t>::max()));
  if (o.has("stage3_prefetch_bucket_size") && o.has("prefetch_bucket_size"))
    return key_error(o.child("prefetch_bucket_size"),
                     "given together with its alias stage3_prefetch_bucket_size; keep one");
  STRATA_RETURN_IF_ERROR(
      read_uint(o, "stage3_prefetch_bucket_size", &z->prefetch_bucket_size, 0, std::numeric_limits<uint64_t>::max()));
  STRATA_RETURN_IF_ERROR(
      read_uint(o, "prefetch_bucket_size", &z->prefetch_bucket_size, 0, std::numeric_limits<uint64_t>::max()));

  // Deprecated DeepSpeed booleans, mapped as DeepSpeed maps them.
  bool cpu_offload = false, cpu_offload_param = false, pin = false;
  const bool has_pin = o.has("cpu_offload_use_pin_memory");
  STRATA_RETURN_IF_ERROR(read_bool(o, "cpu_offload", &cpu_offload));
  STRATA_RETURN_IF_ERROR(read_bool(o, "cpu_offload_param", &cpu_offload_param));
  STRATA_RETURN_IF_ERROR(read_bool(o, "cpu_offload_use_pin_memory", &pin));
  if (cpu_offload) {
    if (o.has("offload_optimizer"))
      return key_error(o.child("cpu_offload"),
                       "deprecated; it conflicts with offload_optimizer, keep only offload_optimizer");
    z->offload_optimizer.device = OffloadDevice::kCpu;
    o.ctx().notes.warnings.push_back(o.child("cpu_offload") + " is deprecated: use offload_optimizer.device \"cpu\"");
  }
  if (cpu_offload_param) {
    if (o.has("offload_param"))
      return key_error(o.child("cpu_offload_param"),
                       "deprecated; it conflicts with offload_param, keep only offload_param");
    z->offload_param.device = OffloadDevice::kCpu;
    o.ctx().notes.warnings.push_back(o.child("cpu_offload_param") + " is deprecated: use offload_param.device \"cpu\"");
  }
  if (has_pin) {
    z->offload_param.pin_memory = z->offload_param.pin_memory.value_or(false) || pin;
    z->offload_optimizer.pin_memory = z->offload_optimizer.pin_memory || pin;
  }

  // Communication and partitioning knobs: Strata runs one process per GPU and
  // makes these choices itself (or with the strata.* keys).
  o.ignore({"contiguous_gradients",
            "reduce_scatter",
            "reduce_bucket_size",
            "use_multi_rank_bucket_allreduce",
            "allgather_partitions",
            "allgather_bucket_size",
            "overlap_comm",
            "load_from_fp32_weights",
            "elastic_checkpoint",
            "stage3_param_persistence_threshold",
            "stage3_model_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
            "stage3_gather_16bit_weights_on_model_save",
            "gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
            "stage3_module_granularity_threshold",
            "stage3_use_all_reduce_for_fetch_params",
            "stage3_allgather_sequential",
            // The same fields by the names DeepSpeed's pydantic model also
            // accepts (its aliases are the stage3_ ones).
            "param_persistence_threshold",
            "model_persistence_threshold",
            "max_live_parameters",
            "max_reuse_distance",
            "module_granularity_threshold",
            "use_all_reduce_for_fetch_params",
            "allgather_sequential",
            "ignore_unused_parameters",
            "legacy_stage1",
            "round_robin_gradients",
            "zero_hpz_partition_size",
            "zeropp_loco_param",
            "mics_shard_size",
            "mics_hierarchical_params_gather",
            "memory_efficient_linear",
            "pipeline_loading_checkpoint",
            "override_module_apply"});
  // ZeRO++'s quantized communication changes the numbers each rank gets.
  auto off = [](const json& v) { return v.is_boolean() && !v.get<bool>(); };
  for (const char* key : {"zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients"})
    STRATA_RETURN_IF_ERROR(accept_only(o, key, off,
                                       "ZeRO++ quantized communication; Strata moves weights and gradients at full "
                                       "precision"));
  return Status::ok_status();
}

Status read_aio(Obj& o, AioConfig* a) {
  STRATA_RETURN_IF_ERROR(read_size(o, "block_size", &a->block_size));
  // The I/O engine's limits (O_DIRECT wants 4 KiB multiples; see io/io_engine.cpp).
  if (o.has("block_size") && (a->block_size == 0 || a->block_size % 4096 != 0 || a->block_size > (64u << 20)))
    return key_error(
        o.child("block_size"),
        fmt::format("expected a multiple of 4096 bytes from 4 KiB to 64 MiB (O_DIRECT), got {}", a->block_size));
  STRATA_RETURN_IF_ERROR(read_uint(o, "queue_depth", &a->queue_depth, 1, 4096));
  uint64_t threads = 0, intra = 0;
  const bool has_threads = o.has("thread_count"), has_intra = o.has("intra_op_parallelism");
  STRATA_RETURN_IF_ERROR(read_uint(o, "thread_count", &threads, 1, 1024));
  STRATA_RETURN_IF_ERROR(read_uint(o, "intra_op_parallelism", &intra, 1, 1024));
  if (has_threads && has_intra && threads != intra)
    return key_error(
        o.child("thread_count"),
        fmt::format("{} differs from intra_op_parallelism {} (it is that key's older name); keep one", threads, intra));
  if (has_intra)
    a->intra_op_parallelism = intra;
  else if (has_threads)
    a->intra_op_parallelism = threads;
  STRATA_RETURN_IF_ERROR(read_bool(o, "single_submit", &a->single_submit));
  STRATA_RETURN_IF_ERROR(read_bool(o, "overlap_events", &a->overlap_events));
  STRATA_RETURN_IF_ERROR(read_bool(o, "use_gds", &a->use_gds));
  if (a->use_gds)
    o.ctx().notes.warnings.push_back(
        o.child("use_gds") + ": GPUDirect Storage is not used by Strata; NVMe data moves through pinned host buffers");
  return Status::ok_status();
}

Status read_fp16(Obj& o, Fp16Config* f) {
  STRATA_RETURN_IF_ERROR(read_bool(o, "enabled", &f->enabled));
  STRATA_RETURN_IF_ERROR(read_double(o, "loss_scale", &f->loss_scale, 0.0, std::numeric_limits<double>::max()));
  STRATA_RETURN_IF_ERROR(read_uint(o, "initial_scale_power", &f->initial_scale_power, 0, 126));
  STRATA_RETURN_IF_ERROR(read_uint(o, "loss_scale_window", &f->loss_scale_window, 1, 1u << 30));
  STRATA_RETURN_IF_ERROR(read_uint(o, "hysteresis", &f->hysteresis, 1, 1u << 30));
  STRATA_RETURN_IF_ERROR(read_bool(o, "consecutive_hysteresis", &f->consecutive_hysteresis));
  STRATA_RETURN_IF_ERROR(read_double(o, "min_loss_scale", &f->min_loss_scale, 0.0, std::numeric_limits<double>::max()));
  o.ignore({"auto_cast"});
  return accept_only(
      o, "fp16_master_weights_and_grads", [](const json& v) { return v.is_boolean() && !v.get<bool>(); },
      "Strata keeps fp32 master weights and gradients; fp16 ones are not offered");
}

Status read_optimizer(Obj& o, OptimizerConfig* c) {
  STRATA_RETURN_IF_ERROR(read_enum(o, "type", &c->type, kEnumNames<OptimizerType>, /*ignore_case=*/true));
  bool amsgrad = false;
  STRATA_RETURN_IF_ERROR(read_object(
      o, "params",
      [&](Obj& p) {
        // The optimizer computes in fp32: a value past its range became inf
        // and NaN weights, found only inside the first step.
        constexpr double kF32Max = std::numeric_limits<float>::max();
        STRATA_RETURN_IF_ERROR(read_double(p, "lr", &c->lr, 0.0, kF32Max));
        if (const json* b = p.take("betas")) {
          if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number() || !(*b)[1].is_number())
            return expected(p.child("betas"), "[beta1, beta2] with each in [0, 1)", *b);
          double b1 = (*b)[0].get<double>(), b2 = (*b)[1].get<double>();
          if (!(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1))
            return expected(p.child("betas"), "[beta1, beta2] with each in [0, 1)", *b);
          c->beta1 = b1;
          c->beta2 = b2;
        }
        STRATA_RETURN_IF_ERROR(read_double(p, "eps", &c->eps, 0.0, kF32Max, true));
        STRATA_RETURN_IF_ERROR(
            read_double(p, "weight_decay", &c->weight_decay, 0.0, kF32Max));
        STRATA_RETURN_IF_ERROR(read_bool(p, "bias_correction", &c->bias_correction));
        STRATA_RETURN_IF_ERROR(read_bool(p, "adam_w_mode", &c->adam_w_mode));
        STRATA_RETURN_IF_ERROR(read_bool(p, "amsgrad", &amsgrad));
        if (amsgrad) return key_error(p.child("amsgrad"), "AMSGrad is not supported by Strata's optimizers");
        p.ignore({"torch_adam", "fused"});
        return Status::ok_status();
      },
      true));
  // DeepSpeed: effective_adam_w_mode = type is AdamW or adam_w_mode, so
  // AdamW with adam_w_mode false is still AdamW.
  if (c->type == OptimizerType::kAdamW) c->adam_w_mode = true;
  return Status::ok_status();
}

Status read_strata(Obj& o, StrataConfig* s) {
  STRATA_RETURN_IF_ERROR(read_size(o, "device_memory", &s->device_memory));
  s->device_reserve_given = o.has("device_reserve");
  STRATA_RETURN_IF_ERROR(read_size(o, "device_reserve", &s->device_reserve));
  STRATA_RETURN_IF_ERROR(read_size(o, "host_memory", &s->host_memory));
  STRATA_RETURN_IF_ERROR(read_size(o, "pinned_memory", &s->pinned_memory));
  if (s->host_memory != 0 && s->pinned_memory > s->host_memory)
    return key_error(o.child("pinned_memory"),
                     fmt::format("{} is more than strata.host_memory {}; pinned memory is part of it",
                                 format_bytes(s->pinned_memory), format_bytes(s->host_memory)));
  if (const json* n = o.take("nvme")) {
    if (!n->is_array()) return expected(o.child("nvme"), "an array of {\"path\": ..., \"capacity\": ...}", *n);
    s->nvme.clear();
    for (size_t i = 0; i < n->size(); ++i) {
      const json& e = (*n)[i];
      const std::string ep = fmt::format("{}[{}]", o.child("nvme"), i);
      NvmeDir d;
      if (e.is_string()) {
        d.path = e.get<std::string>();
        if (d.path.empty()) return expected(ep, "a non-empty path", e);
      } else if (e.is_object()) {
        Obj eo(e, ep, o.ctx(), false);
        if (!eo.has("path")) return key_error(ep + ".path", "required");
        STRATA_RETURN_IF_ERROR(read_string(eo, "path", &d.path, false));
        STRATA_RETURN_IF_ERROR(read_size(eo, "capacity", &d.capacity));
        STRATA_RETURN_IF_ERROR(eo.finish());
      } else {
        return expected(ep, "a path or {\"path\": ..., \"capacity\": ...}", e);
      }
      for (const auto& prev : s->nvme)
        if (prev.path == d.path) return key_error(ep + ".path", fmt::format("\"{}\" is listed twice", d.path));
      s->nvme.push_back(std::move(d));
    }
  }
  STRATA_RETURN_IF_ERROR(read_uint(o, "prefetch_depth", &s->prefetch_depth, 0, 64));
  STRATA_RETURN_IF_ERROR(read_uint(o, "held_groups", &s->held_groups, 1, 64));
  STRATA_RETURN_IF_ERROR(read_bool(o, "debug_poison_released", &s->debug_poison_released));
  STRATA_RETURN_IF_ERROR(read_size(o, "prefetch_bytes", &s->prefetch_bytes));
  constexpr auto kStateDtypes = std::to_array<EnumName<DType>>({{DType::kF32, "fp32"}, {DType::kBF16, "bf16"}});
  STRATA_RETURN_IF_ERROR(read_enum(o, "optimizer_state_dtype", &s->optimizer_state_dtype, kStateDtypes));
  STRATA_RETURN_IF_ERROR(read_enum(o, "optimizer_state_rounding", &s->optimizer_state_rounding,
                                   kEnumNames<cpu_optim::StateRounding>));
  STRATA_RETURN_IF_ERROR(read_enum(o, "io_backend", &s->io_backend, kEnumNames<IoBackendChoice>));
  STRATA_RETURN_IF_ERROR(read_bool(o, "overlap_backward", &s->overlap_backward));
  STRATA_RETURN_IF_ERROR(read_bool(o, "pipelined_step", &s->pipelined_step));
  STRATA_RETURN_IF_ERROR(read_bool(o, "optimizer_handoff", &s->optimizer_handoff));
  STRATA_RETURN_IF_ERROR(read_bool(o, "gradient_staging", &s->gradient_staging));
  STRATA_RETURN_IF_ERROR(read_bool(o, "gradient_in_compute_dtype", &s->gradient_in_compute_dtype));
  STRATA_RETURN_IF_ERROR(read_bool(o, "average_micro_batches", &s->average_micro_batches));
  STRATA_RETURN_IF_ERROR(read_string(o, "trace", &s->trace));
  STRATA_RETURN_IF_ERROR(read_uint(o, "world_size", &s->world_size, 1, 1u << 20));
  STRATA_RETURN_IF_ERROR(read_uint(o, "rank", &s->rank, 0, (1u << 20) - 1));
  if (s->rank >= s->world_size)
    return key_error(o.child("rank"), fmt::format("{} is out of range for world_size {}", s->rank, s->world_size));
  STRATA_RETURN_IF_ERROR(read_uint(o, "shard_alignment", &s->shard_alignment, 1, uint64_t{1} << 30));
  STRATA_RETURN_IF_ERROR(read_uint(o, "optimizer_chunk", &s->optimizer_chunk, 1, uint64_t{1} << 40));
  STRATA_RETURN_IF_ERROR(read_bool(o, "swap_checksums", &s->swap_checksums));
  if (const json* g = o.take("groups")) {
    if (!g->is_array()) return expected(o.child("groups"), "an array of {\"match\": ..., \"compute\": ...}", *g);
    s->groups.clear();
    for (size_t i = 0; i < g->size(); ++i) {
      const json& e = (*g)[i];
      const std::string ep = fmt::format("{}[{}]", o.child("groups"), i);
      if (!e.is_object()) return expected(ep, "an object {\"match\": ..., \"compute\": ...}", e);
      Obj eo(e, ep, o.ctx(), false);
      GroupTierRule r;
      if (!eo.has("match")) return key_error(ep + ".match", "required");
      STRATA_RETURN_IF_ERROR(read_string(eo, "match", &r.match, false));
      STRATA_RETURN_IF_ERROR(read_enum(eo, "compute", &r.compute, kEnumNames<Tier>));
      STRATA_RETURN_IF_ERROR(read_enum(eo, "master", &r.master, kEnumNames<Tier>));
      STRATA_RETURN_IF_ERROR(read_enum(eo, "optimizer", &r.optimizer, kEnumNames<Tier>));
      STRATA_RETURN_IF_ERROR(read_enum(eo, "grad", &r.grad, kEnumNames<Tier>));
      STRATA_RETURN_IF_ERROR(eo.finish());
      s->groups.push_back(std::move(r));
    }
  }
  return Status::ok_status();
}

Status read_root(Obj& o, Config* c) {
  STRATA_RETURN_IF_ERROR(read_object(
      o, "zero_optimization", [&](Obj& z) { return read_zero(z, &c->zero); }, true));
  STRATA_RETURN_IF_ERROR(read_object(
      o, "aio", [&](Obj& a) { return read_aio(a, &c->aio); }, true));
  STRATA_RETURN_IF_ERROR(read_object(
      o, "fp16", [&](Obj& f) { return read_fp16(f, &c->fp16); }, true));
  if (o.has("bf16") && o.has("bfloat16")) return key_error("bfloat16", "given together with its alias bf16; keep one");
  for (const char* key : {"bf16", "bfloat16"}) {
    STRATA_RETURN_IF_ERROR(read_object(
        o, key,
        [&](Obj& b) {
          STRATA_RETURN_IF_ERROR(read_bool(b, "enabled", &c->bf16));
          b.ignore({"immediate_grad_update"});
          return Status::ok_status();
        },
        true));
  }
  if (c->bf16 && c->fp16.enabled)
    return key_error("bf16.enabled", "true together with fp16.enabled; choose one precision");
  STRATA_RETURN_IF_ERROR(read_object(
      o, "optimizer", [&](Obj& p) { return read_optimizer(p, &c->optimizer); }, true));
  STRATA_RETURN_IF_ERROR(
      read_double(o, "gradient_clipping", &c->gradient_clipping, 0.0, std::numeric_limits<double>::max()));
  o.ctx().notes.gradient_accumulation_given = o.has("gradient_accumulation_steps");
  STRATA_RETURN_IF_ERROR(read_uint(o, "gradient_accumulation_steps", &c->gradient_accumulation_steps, 1, 1u << 20));
  // The trainer's batch sizes: checked here (positive integers), kept in the notes.
  STRATA_RETURN_IF_ERROR(read_uint(o, "train_batch_size", &o.ctx().notes.train_batch_size, 1, uint64_t{1} << 40));
  STRATA_RETURN_IF_ERROR(read_uint(o, "train_micro_batch_size_per_gpu", &o.ctx().notes.train_micro_batch_size_per_gpu,
                                   1, uint64_t{1} << 40));
  STRATA_RETURN_IF_ERROR(read_object(
      o, "strata", [&](Obj& s) { return read_strata(s, &c->strata); }, false));
  // Lower-precision reductions and accumulation than Strata's fp32 ones.
  STRATA_RETURN_IF_ERROR(accept_only(o, "communication_data_type", is_fp32_name,
                                     "Strata reduces gradients in fp32, in a fixed order; remove the key or say "
                                     "\"fp32\""));
  STRATA_RETURN_IF_ERROR(read_object(
      o, "data_types",
      [&](Obj& d) {
        // param_dtype must match bf16/fp16 in DeepSpeed itself; Strata keeps
        // buffers as loaded, DeepSpeed's default (buffer_dtype null).
        d.ignore({"param_dtype", "keep_in_fp32_modules"});
        STRATA_RETURN_IF_ERROR(accept_only(
            d, "buffer_dtype", [](const json&) { return false; },
            "Strata leaves buffers in their loaded dtype, DeepSpeed's default (null)"));
        return accept_only(d, "grad_accum_dtype", is_fp32_name,
                           "Strata accumulates gradients in fp32; remove the key or say \"fp32\"");
      },
      true));
  // The learning-rate schedule is the trainer's: kept as written (strata
  // finetune follows it, train/schedule.h; strata.torch reads it itself).
  if (const json* sched = o.take_raw("scheduler")) o.ctx().notes.scheduler_json = sched->dump();

  // The trainer's business (batch sizes, schedule, logging, monitoring) or
  // choices Strata makes itself: accepted so DeepSpeed configs load, listed once.
  o.ignore({"steps_per_print",
            "wall_clock_breakdown",
            "memory_breakdown",
            "dump_state",
            "prescale_gradients",
            "gradient_predivide_factor",
            "seq_parallel_communication_data_type",
            "sparse_gradients",
            "zero_allow_untested_optimizer",
            "zero_force_ds_cpu_optimizer",
            "activation_checkpointing",
            "flops_profiler",
            "tensorboard",
            "wandb",
            "csv_monitor",
            "comet",
            "comms_logger",
            "checkpoint",
            "dataloader_drop_last",
            "disable_allgather",
            "timers",
            "seed"});
  // Features whose silent absence would change what is trained.
  STRATA_RETURN_IF_ERROR(o.reject("amp", "Apex AMP; use \"bf16\" or \"fp16\""));
  STRATA_RETURN_IF_ERROR(o.reject("sparse_attention", "it changes the model's attention"));
  STRATA_RETURN_IF_ERROR(o.reject("pipeline", "pipeline parallelism"));
  STRATA_RETURN_IF_ERROR(o.reject("compression_training", "it changes the trained model"));
  STRATA_RETURN_IF_ERROR(o.reject("quantize_training", "it changes the trained model"));
  STRATA_RETURN_IF_ERROR(o.reject("progressive_layer_drop", "it changes the training computation"));
  STRATA_RETURN_IF_ERROR(o.reject("curriculum_learning", "it changes the data order; the trainer owns the data"));
  STRATA_RETURN_IF_ERROR(o.reject("data_efficiency", "it changes the data order; the trainer owns the data"));
  STRATA_RETURN_IF_ERROR(o.reject("elasticity", "it changes batch sizes with the world size"));
  STRATA_RETURN_IF_ERROR(o.finish());

  // Cross-key checks.
  const bool has_dirs = !c->strata.nvme.empty();
  if (c->zero.offload_param.device == OffloadDevice::kNvme && c->zero.offload_param.nvme_path.empty() && !has_dirs)
    return key_error("zero_optimization.offload_param.nvme_path",
                     "required when device is \"nvme\" (or list directories in strata.nvme)");
  if (c->zero.offload_optimizer.device == OffloadDevice::kNvme && c->zero.offload_optimizer.nvme_path.empty() &&
      !has_dirs)
    return key_error("zero_optimization.offload_optimizer.nvme_path",
                     "required when device is \"nvme\" (or list directories in strata.nvme)");
  return Status::ok_status();
}

}  // namespace

Result<Config> parse_config(std::string_view text, std::string_view origin, ConfigNotes* notes) {
  // Duplicate keys are refused (DeepSpeed refuses them too; nlohmann would
  // silently keep the last), and so is nesting no config needs.
  json root;
  JsonError jerr;
  if (!parse_json(text, &root, &jerr, JsonParseOptions{.allow_comments = true}))
    return Status(StatusCode::kInvalidArgument, fmt::format("{}: {}", origin, jerr.message()));
  if (!root.is_object())
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: expected a JSON object at the top, got {}", origin, show(root)));

  Config config;
  Ctx ctx;
  Status st;
  try {
    Obj o(root, "", ctx, true);
    st = read_root(o, &config);
  } catch (const std::exception& e) {  // a bug in a reader above, not bad input
    return Status(StatusCode::kInternal, fmt::format("{}: reading config: {}", origin, e.what()));
  }
  if (!st.ok()) return Status(st.code(), fmt::format("{}: {}", origin, st.message()));

  if (!ctx.notes.ignored_keys.empty()) {
    std::string list;
    for (const auto& k : ctx.notes.ignored_keys) list += (list.empty() ? "" : ", ") + k;
    log_once(LogLevel::kWarn, "config.ignored:" + list,
             fmt::format("{}: DeepSpeed keys accepted but not used by Strata: {}", origin, list));
  }
  for (const auto& w : ctx.notes.warnings)
    log_once(LogLevel::kWarn, "config.warning:" + w, fmt::format("{}: {}", origin, w));
  if (notes) *notes = std::move(ctx.notes);
  return config;
}

Result<Config> load_config_file(const std::string& path, ConfigNotes* notes) {
  struct stat sb;
  if (::stat(path.c_str(), &sb) != 0) {
    const int err = errno;
    if (err == ENOENT) return Status(StatusCode::kNotFound, fmt::format("config file {} does not exist", path));
    return Status::from_errno(err, fmt::format("cannot open config file {}", path));
  }
  if (S_ISDIR(sb.st_mode))
    return Status(StatusCode::kInvalidArgument, fmt::format("config file {} is a directory", path));
  // A FIFO or device would block the read (or never end): refused.
  if (!S_ISREG(sb.st_mode))
    return Status(StatusCode::kInvalidArgument, fmt::format("config file {} is not a regular file", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::from_errno(errno, fmt::format("cannot open config file {}", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status::from_errno(errno, fmt::format("reading config file {} failed", path));
  return parse_config(ss.str(), path, notes);
}

std::string config_to_json(const Config& c) {
  json j;
  const auto& op = c.zero.offload_param;
  const auto& oo = c.zero.offload_optimizer;
  j["zero_optimization"] = {
      {"stage", c.zero.stage},
      {"offload_param",
       {{"device", offload_device_name(op.device)},
        {"nvme_path", op.nvme_path.empty() ? json(nullptr) : json(op.nvme_path)},
        {"buffer_count", op.buffer_count},
        {"buffer_size", op.buffer_size},
        {"max_in_cpu", op.max_in_cpu},
        {"pin_memory", op.pin_memory ? json(*op.pin_memory) : json(nullptr)}}},
      {"offload_optimizer",
       {{"device", offload_device_name(oo.device)},
        {"nvme_path", oo.nvme_path.empty() ? json(nullptr) : json(oo.nvme_path)},
        {"buffer_count", oo.buffer_count},
        {"pin_memory", oo.pin_memory},
        {"pipeline_read", oo.pipeline_read},
        {"pipeline_write", oo.pipeline_write},
        {"fast_init", oo.fast_init},
        {"ratio", oo.ratio}}},
      {"sub_group_size", c.zero.sub_group_size},
      {"stage3_prefetch_bucket_size", c.zero.prefetch_bucket_size},
  };
  if (!c.zero.stage_given && c.zero.stage == 0) j["zero_optimization"].erase("stage");  // unset stays unset
  // 0 = not set: written as null so that the environment still decides.
  auto unset_null = [](uint64_t v) { return v ? json(v) : json(nullptr); };
  j["aio"] = {{"block_size", unset_null(c.aio.block_size)},
              {"queue_depth", unset_null(c.aio.queue_depth)},
              {"intra_op_parallelism", c.aio.intra_op_parallelism},
              {"single_submit", c.aio.single_submit},
              {"overlap_events", c.aio.overlap_events},
              {"use_gds", c.aio.use_gds}};
  j["fp16"] = {{"enabled", c.fp16.enabled},
               {"loss_scale", c.fp16.loss_scale},
               {"initial_scale_power", c.fp16.initial_scale_power},
               {"loss_scale_window", c.fp16.loss_scale_window},
               {"hysteresis", c.fp16.hysteresis},
               {"consecutive_hysteresis", c.fp16.consecutive_hysteresis},
               {"min_loss_scale", c.fp16.min_loss_scale}};
  j["bf16"] = {{"enabled", c.bf16}};
  j["optimizer"] = {{"type", c.optimizer.type == OptimizerType::kAdamW ? "AdamW" : "Adam"},
                    {"params",
                     {{"lr", c.optimizer.lr},
                      {"betas", {c.optimizer.beta1, c.optimizer.beta2}},
                      {"eps", c.optimizer.eps},
                      {"weight_decay", c.optimizer.weight_decay},
                      {"bias_correction", c.optimizer.bias_correction},
                      {"adam_w_mode", c.optimizer.adam_w_mode}}}};
  j["gradient_clipping"] = c.gradient_clipping;
  j["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
  const auto& s = c.strata;
  json nvme = json::array();
  for (const auto& d : s.nvme) nvme.push_back({{"path", d.path}, {"capacity", d.capacity}});
  json groups = json::array();
  for (const auto& g : s.groups)
    groups.push_back({{"match", g.match},
                      {"compute", tier_name(g.compute)},
                      {"master", tier_name(g.master)},
                      {"optimizer", tier_name(g.optimizer)},
                      {"grad", tier_name(g.grad)}});
  j["strata"] = {{"device_memory", s.device_memory},
                 {"device_reserve", s.device_reserve},
                 {"host_memory", s.host_memory},
                 {"pinned_memory", s.pinned_memory},
                 {"nvme", nvme},
                 {"prefetch_depth", s.prefetch_depth},
                 {"held_groups", s.held_groups},
                 {"debug_poison_released", s.debug_poison_released},
                 {"prefetch_bytes", s.prefetch_bytes},
                 {"optimizer_state_dtype", dtype_name(s.optimizer_state_dtype)},
                 {"optimizer_state_rounding", enum_name(s.optimizer_state_rounding)},
                 {"io_backend", io_backend_name(s.io_backend)},
                 {"overlap_backward", s.overlap_backward},
                 {"pipelined_step", s.pipelined_step},
                 {"optimizer_handoff", s.optimizer_handoff},
                 {"gradient_staging", s.gradient_staging ? json(*s.gradient_staging) : json(nullptr)},
                 {"gradient_in_compute_dtype",
                  s.gradient_in_compute_dtype ? json(*s.gradient_in_compute_dtype) : json(nullptr)},
                 {"average_micro_batches", s.average_micro_batches},
                 {"trace", s.trace},
                 {"world_size", s.world_size},
                 {"rank", s.rank},
                 {"shard_alignment", s.shard_alignment},
                 {"optimizer_chunk", s.optimizer_chunk},
                 {"swap_checksums", s.swap_checksums},
                 {"groups", groups}};
  if (!s.device_reserve_given) j["strata"].erase("device_reserve");  // unset stays unset: finetune sizes it
  return j.dump(2) + "\n";
}

}  // namespace strata
