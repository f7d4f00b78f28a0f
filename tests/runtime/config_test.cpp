// The config file (src/runtime/config.h): DeepSpeed samples load with
// DeepSpeed's meaning, every refusal names the key's full path, and a resolved
// config survives config_to_json -> parse_config unchanged.
#include "runtime/config.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

namespace strata {
namespace {

const std::string kData = STRATA_RUNTIME_TEST_DATA;

Config load(const std::string& name, ConfigNotes* notes = nullptr) {
  auto r = load_config_file(kData + "/" + name, notes);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? r.value() : Config{};
}

Config parse_ok(const std::string& text, ConfigNotes* notes = nullptr) {
  auto r = parse_config(text, "<string>", notes);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? r.value() : Config{};
}

// The full message of a refused config.
std::string error_of(const std::string& text, StatusCode code = StatusCode::kInvalidArgument) {
  auto r = parse_config(text);
  EXPECT_FALSE(r.ok()) << "accepted: " << text;
  if (r.ok()) return "";
  EXPECT_EQ(r.status().code(), code) << r.status().to_string();
  return r.status().message();
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

// ------------------------------------------------------------------ samples

TEST(ConfigSamples, ZeroInfinityNvme) {
  ConfigNotes notes;
  Config c = load("ds_zero3_infinity_nvme.json", &notes);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(c.zero.offload_param.nvme_path, "/local_nvme");
  EXPECT_EQ(c.zero.offload_param.pin_memory, std::optional<bool>(true));
  EXPECT_EQ(c.zero.offload_param.buffer_count, 5u);
  EXPECT_EQ(c.zero.offload_param.buffer_size, 100000000u);  // written 1e8
  EXPECT_EQ(c.zero.offload_param.max_in_cpu, 1000000000u);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(c.zero.offload_optimizer.buffer_count, 4u);
  EXPECT_TRUE(c.zero.offload_optimizer.pipeline_read);
  EXPECT_TRUE(c.zero.offload_optimizer.pipeline_write);
  EXPECT_FALSE(c.zero.offload_optimizer.fast_init);
  EXPECT_EQ(c.zero.sub_group_size, 1000000000u);
  EXPECT_EQ(c.zero.prefetch_bucket_size, 50000000u);
  EXPECT_EQ(c.aio.block_size, 1048576u);
  EXPECT_EQ(c.aio.queue_depth, 32u);
  EXPECT_EQ(c.aio.intra_op_parallelism, 2u);
  EXPECT_FALSE(c.aio.single_submit);
  EXPECT_TRUE(c.aio.overlap_events);
  EXPECT_TRUE(c.bf16);
  EXPECT_EQ(c.compute_dtype(), DType::kBF16);
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdamW);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 2e-5);
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.9);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.1);
  EXPECT_TRUE(c.optimizer.decoupled_weight_decay());
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.gradient_accumulation_steps, 8u);
  // One directory, named by both offload sections.
  ASSERT_EQ(c.nvme_dirs().size(), 1u);
  EXPECT_EQ(c.nvme_dirs()[0].path, "/local_nvme");
  EXPECT_EQ(c.nvme_dirs()[0].capacity, 0u);
  EXPECT_EQ(notes.ignored_keys,
            (std::vector<std::string>{
                "zero_optimization.contiguous_gradients", "zero_optimization.reduce_bucket_size",
                "zero_optimization.overlap_comm", "zero_optimization.stage3_param_persistence_threshold",
                "zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_max_reuse_distance",
                "zero_optimization.stage3_gather_16bit_weights_on_model_save", "steps_per_print",
                "wall_clock_breakdown", "activation_checkpointing"}));
  EXPECT_TRUE(notes.warnings.empty());
  // The trainer's batch sizes, kept for it (strata finetune derives its batch from them).
  EXPECT_EQ(notes.train_batch_size, 16u);
  EXPECT_EQ(notes.train_micro_batch_size_per_gpu, 2u);
  EXPECT_TRUE(notes.gradient_accumulation_given);
}

TEST(ConfigSamples, HuggingFaceAutoValuesKeepDefaults) {
  ConfigNotes notes;
  Config c = load("ds_zero3_cpu_hf_auto.json", &notes);
  const Config d;
  EXPECT_FALSE(c.fp16.enabled);  // "auto": the default
  EXPECT_FALSE(c.bf16);
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.optimizer, d.optimizer);
  EXPECT_EQ(c.gradient_accumulation_steps, 1u);
  EXPECT_EQ(c.gradient_clipping, 1.0);  // "auto": DeepSpeed's default, 1.0
  EXPECT_EQ(c.zero.prefetch_bucket_size, d.zero.prefetch_bucket_size);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.zero.offload_param.pin_memory, std::optional<bool>(true));
  EXPECT_TRUE(c.nvme_dirs().empty());
  EXPECT_TRUE(contains(notes.ignored_keys, "zero_optimization.reduce_bucket_size"));
  EXPECT_EQ(notes.train_batch_size, 0u);  // "auto": not given
  EXPECT_EQ(notes.train_micro_batch_size_per_gpu, 0u);
  EXPECT_FALSE(notes.gradient_accumulation_given);
  EXPECT_FALSE(contains(notes.ignored_keys, "scheduler"));  // kept for the trainer (its "auto" values: refused there)
  EXPECT_NE(notes.scheduler_json.find("\"WarmupLR\""), std::string::npos) << notes.scheduler_json;
  // Which keys were "auto" (strata finetune fills optimizer.params.lr from --lr).
  EXPECT_TRUE(contains(notes.auto_keys, "optimizer.params.lr"));
  EXPECT_TRUE(contains(notes.auto_keys, "train_batch_size"));
  EXPECT_FALSE(contains(notes.auto_keys, "zero_optimization.stage"));
}

TEST(ConfigSamples, ZeroFieldsByEitherNameDeepSpeedAccepts) {
  // DeepSpeed's ZeRO model takes both max_live_parameters and its alias
  // stage3_max_live_parameters (and so on): both are listed as not used.
  ConfigNotes notes;
  auto c = parse_config(R"({"zero_optimization": {"max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
      "param_persistence_threshold": 1e5, "model_persistence_threshold": 1e9, "module_granularity_threshold": 0,
      "use_all_reduce_for_fetch_params": false, "allgather_sequential": false}})",
                        "<string>", &notes);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  for (const char* k : {"max_live_parameters", "stage3_max_reuse_distance", "param_persistence_threshold",
                        "allgather_sequential"})
    EXPECT_TRUE(contains(notes.ignored_keys, std::string("zero_optimization.") + k)) << k;
}

TEST(ConfigErrors, OptimizerValuesPastFp32AreRefused) {
  // The optimizer computes in fp32: 1e40 became inf and NaN weights inside the first step.
  EXPECT_EQ(error_of(R"({"optimizer": {"params": {"weight_decay": 1e40}}})"),
            "<string>: optimizer.params.weight_decay: expected a number from 0 to 3.4028234663852886e+38, got 1e+40");
  EXPECT_NE(error_of(R"({"optimizer": {"params": {"lr": 1e39}}})").find("optimizer.params.lr"), std::string::npos);
  EXPECT_NE(error_of(R"({"optimizer": {"params": {"eps": 1e39}}})").find("optimizer.params.eps"), std::string::npos);
}

TEST(ConfigErrors, AutoStandsForAValueNotASection) {
  // DeepSpeed fails on these (TypeError); a section given as "auto" was read
  // as absent, so {"fp16": "auto", "optimizer": "auto"} trained fp32 AdamW.
  for (const char* key : {"fp16", "bf16", "optimizer", "zero_optimization", "aio", "data_types"})
    EXPECT_EQ(error_of(fmt::format(R"({{"{}": "auto"}})", key)),
              fmt::format("<string>: {}: expected an object, got \"auto\"", key));
  EXPECT_EQ(error_of(R"({"zero_optimization": {"offload_param": "auto"}})"),
            "<string>: zero_optimization.offload_param: expected an object, got \"auto\"");
}

TEST(ConfigSamples, ZeroOffloadFp16Adam) {
  ConfigNotes notes;
  Config c = load("ds_zero2_offload_fp16.json", &notes);
  EXPECT_EQ(c.zero.stage, 2);
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_EQ(c.compute_dtype(), DType::kF16);
  EXPECT_EQ(c.fp16.loss_scale, 0.0);
  EXPECT_EQ(c.fp16.initial_scale_power, 12);
  EXPECT_EQ(c.fp16.loss_scale_window, 500);
  EXPECT_EQ(c.fp16.hysteresis, 4);
  EXPECT_TRUE(c.fp16.consecutive_hysteresis);
  EXPECT_EQ(c.fp16.min_loss_scale, 0.0);
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdam);
  EXPECT_FALSE(c.optimizer.adam_w_mode);
  EXPECT_FALSE(c.optimizer.decoupled_weight_decay());  // classic Adam with L2
  EXPECT_DOUBLE_EQ(c.optimizer.eps, 1e-6);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kAuto);  // absent: the planner decides
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_DOUBLE_EQ(c.zero.offload_optimizer.ratio, 0.3);
  EXPECT_EQ(c.aio.block_size, 262144u);
  EXPECT_EQ(c.aio.intra_op_parallelism, 4u);  // from the older name thread_count
  EXPECT_TRUE(c.aio.single_submit);
  EXPECT_FALSE(c.aio.overlap_events);
  ASSERT_EQ(notes.warnings.size(), 1u);
  EXPECT_EQ(notes.warnings[0],
            "zero_optimization.offload_optimizer.ratio: 0.3 asks DeepSpeed to keep part of the optimizer states on the "
            "GPU; Strata keeps them all on host or NVMe (use strata.groups to choose per group)");
  EXPECT_TRUE(contains(notes.ignored_keys, "zero_optimization.round_robin_gradients"));
  EXPECT_TRUE(contains(notes.ignored_keys, "zero_allow_untested_optimizer"));
}

TEST(ConfigSamples, StrataSection) {
  Config c = load("strata_full.json");
  const StrataConfig& s = c.strata;
  EXPECT_EQ(s.device_memory, 22ull << 30);
  EXPECT_EQ(s.device_reserve, 3ull << 30);
  EXPECT_TRUE(s.device_reserve_given);
  EXPECT_EQ(s.host_memory, 64ull << 30);
  EXPECT_EQ(s.pinned_memory, 8ull << 30);
  ASSERT_EQ(s.nvme.size(), 2u);
  EXPECT_EQ(s.nvme[0], (NvmeDir{"/nvme0/strata", 3ull << 39}));
  EXPECT_EQ(s.nvme[1], (NvmeDir{"/nvme2/strata", 0}));
  EXPECT_EQ(s.prefetch_depth, 3u);
  EXPECT_EQ(s.prefetch_bytes, 4ull << 30);
  EXPECT_EQ(s.optimizer_state_dtype, DType::kBF16);
  EXPECT_EQ(s.optimizer_state_rounding, cpu_optim::StateRounding::kNearest);
  EXPECT_EQ(s.io_backend, IoBackendChoice::kUring);
  EXPECT_TRUE(s.overlap_backward);
  EXPECT_FALSE(s.pipelined_step);
  EXPECT_EQ(s.trace, "/tmp/strata-trace.json");
  EXPECT_EQ(s.world_size, 2u);
  EXPECT_EQ(s.rank, 1u);
  EXPECT_EQ(s.shard_alignment, 4096u);
  EXPECT_EQ(s.optimizer_chunk, 8388608u);
  ASSERT_EQ(s.groups.size(), 2u);
  EXPECT_EQ(s.groups[0], (GroupTierRule{"embed", Tier::kHost, Tier::kAuto, Tier::kAuto, Tier::kAuto}));
  EXPECT_EQ(s.groups[1], (GroupTierRule{"layers.*", Tier::kAuto, Tier::kAuto, Tier::kNvme, Tier::kHost}));
  EXPECT_EQ(c.aio.block_size, 1u << 20);
  EXPECT_EQ(c.aio.queue_depth, 64u);
  EXPECT_EQ(c.zero.offload_optimizer.buffer_count, 3u);
  // strata.nvme first, then the offload_optimizer path.
  auto dirs = c.nvme_dirs();
  ASSERT_EQ(dirs.size(), 3u);
  EXPECT_EQ(dirs[2].path, "/nvme1/strata");
}

TEST(ConfigDefaults, EmptyObjectIsTheDefaultConfig) {
  EXPECT_EQ(parse_ok("{}"), Config{});
  const Config d;
  // DeepSpeed's defaults (offload_config.py, aio constants, zero/config.py).
  EXPECT_EQ(d.zero.stage, 0);
  EXPECT_EQ(d.zero.offload_param.buffer_count, 5u);
  EXPECT_EQ(d.zero.offload_param.buffer_size, 100000000u);
  EXPECT_EQ(d.zero.offload_param.max_in_cpu, 1000000000u);
  EXPECT_EQ(d.zero.offload_optimizer.buffer_count, 4u);
  EXPECT_EQ(d.zero.sub_group_size, 1000000000u);
  EXPECT_EQ(d.zero.prefetch_bucket_size, 50000000u);
  // Not set: STRATA_IO_BLOCK_BYTES / STRATA_IO_QUEUE_DEPTH, then the engine decides.
  EXPECT_EQ(d.aio.block_size, 0u);
  EXPECT_EQ(d.aio.queue_depth, 0u);
  EXPECT_EQ(d.aio.intra_op_parallelism, 1u);
  EXPECT_FALSE(d.aio.single_submit);
  EXPECT_TRUE(d.aio.overlap_events);
  EXPECT_EQ(d.fp16.initial_scale_power, 16);
  EXPECT_EQ(d.fp16.loss_scale_window, 1000);
  EXPECT_EQ(d.fp16.hysteresis, 2);
  EXPECT_EQ(d.fp16.min_loss_scale, 1.0);
  EXPECT_EQ(d.compute_dtype(), DType::kF32);
  EXPECT_FALSE(d.strata.device_reserve_given);  // strata finetune sizes it
  EXPECT_EQ(config_to_json(d).find("device_reserve"), std::string::npos);
}

TEST(ConfigDefaults, PresentOffloadObjectDefaultsToNone) {
  // DeepSpeed's default device once the object is there is "none".
  Config c = parse_ok(R"({"zero_optimization": {"offload_param": {"pin_memory": true}}})");
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kNone);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kAuto);
  c = parse_ok(R"({"zero_optimization": {"offload_param": {"device": "auto"}}})");
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kAuto);
}

TEST(ConfigDefaults, PinMemoryIsDecidedByStrataUnlessGiven) {
  EXPECT_EQ(parse_ok("{}").zero.offload_param.pin_memory, std::nullopt);
  EXPECT_EQ(parse_ok(R"({"zero_optimization": {"offload_param": {"pin_memory": null}}})").zero.offload_param.pin_memory,
            std::nullopt);
  EXPECT_EQ(parse_ok(R"({"zero_optimization": {"offload_param": {"pin_memory": false}}})").zero.offload_param.pin_memory,
            std::optional<bool>(false));
  Config c = parse_ok(R"({"zero_optimization": {"cpu_offload_use_pin_memory": false}})");
  EXPECT_EQ(c.zero.offload_param.pin_memory, std::optional<bool>(false));
  for (const char* text : {"{}", R"({"zero_optimization": {"offload_param": {"pin_memory": false}}})"}) {
    const Config a = parse_ok(text);
    EXPECT_EQ(parse_ok(config_to_json(a)), a) << text;
  }
}

TEST(ConfigDefaults, DeprecatedCpuOffloadBooleans) {
  ConfigNotes notes;
  Config c = parse_ok(R"({"zero_optimization": {"stage": 2, "cpu_offload": true, "cpu_offload_use_pin_memory": true}})",
                      &notes);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_TRUE(c.zero.offload_optimizer.pin_memory);
  ASSERT_EQ(notes.warnings.size(), 1u);
  EXPECT_EQ(notes.warnings[0], "zero_optimization.cpu_offload is deprecated: use offload_optimizer.device \"cpu\"");
}

TEST(ConfigDefaults, IntegralFloatsAndNullsAreAccepted) {
  Config c = parse_ok(R"({"zero_optimization": {"sub_group_size": 1e8, "offload_param": {"device": "cpu",
                          "nvme_path": null, "buffer_count": null}}})");
  EXPECT_EQ(c.zero.sub_group_size, 100000000u);
  EXPECT_EQ(c.zero.offload_param.buffer_count, 5u);
  EXPECT_TRUE(c.zero.offload_param.nvme_path.empty());
}

TEST(ConfigDefaults, DisabledRejectedFeatureIsOnlyIgnored) {
  ConfigNotes notes;
  parse_ok(R"({"curriculum_learning": {"enabled": false}})", &notes);
  EXPECT_EQ(notes.ignored_keys, std::vector<std::string>{"curriculum_learning"});
}

// ------------------------------------------------------------------ refusals

TEST(ConfigErrors, UnknownKeyNamesPathAndSuggests) {
  EXPECT_EQ(error_of(R"({"zero_optimization": {"offload_optimizer": {"devcie": "cpu"}}})"),
            "<string>: zero_optimization.offload_optimizer.devcie: unknown key (did you mean \"device\"?)");
  EXPECT_EQ(error_of(R"({"bf16": {"enable": true}})"),
            "<string>: bf16.enable: unknown key (did you mean \"enabled\"?)");
  EXPECT_EQ(error_of(R"({"zero_optimisation": {}})"),
            "<string>: zero_optimisation: unknown key (did you mean \"zero_optimization\"?)");
  EXPECT_EQ(error_of(R"({"frobnicate": 1})"), "<string>: frobnicate: unknown key");
  EXPECT_EQ(error_of(R"({"strata": {"nvme": [{"path": "/a", "capactiy": "1TB"}]}})"),
            "<string>: strata.nvme[0].capactiy: unknown key (did you mean \"capacity\"?)");
  // An unknown key inside fp16 (Apex's opt_level) is refused like any other.
  EXPECT_EQ(error_of(R"({"fp16": {"enabled": true, "opt_level": "O2"}})"), "<string>: fp16.opt_level: unknown key");
  // A 1 MB key: clipped in the message, and no suggestion (the edit
  // distance over it took 1.6 s per MB).
  const std::string huge(1 << 20, 'k');
  const std::string msg = error_of("{\"" + huge + "\": 1}");
  EXPECT_LT(msg.size(), 200u) << msg.substr(0, 200);
  EXPECT_NE(msg.find("...(1048576 bytes): unknown key"), std::string::npos) << msg.substr(0, 200);
  // A name with a NUL in it is not the name before the NUL.
  EXPECT_NE(error_of(R"({"optimizer": {"type": "AdamW\u0000junk"}})").find("optimizer.type: expected"),
            std::string::npos);
}

TEST(ConfigErrors, WrongTypesNamePathAndValue) {
  EXPECT_EQ(error_of(R"({"zero_optimization": {"offload_optimizer": {"buffer_count": "four"}}})"),
            "<string>: zero_optimization.offload_optimizer.buffer_count: expected a positive integer, got \"four\"");
  EXPECT_EQ(error_of(R"({"zero_optimization": {"offload_optimizer": {"buffer_count": 0}}})"),
            "<string>: zero_optimization.offload_optimizer.buffer_count: expected a positive integer, got 0");
  EXPECT_EQ(error_of(R"({"zero_optimization": {"offload_param": {"buffer_size": 1.5}}})"),
            "<string>: zero_optimization.offload_param.buffer_size: expected a positive integer, got 1.5");
  EXPECT_EQ(error_of(R"({"zero_optimization": {"stage": 4}})"),
            "<string>: zero_optimization.stage: expected an integer from 0 to 3, got 4");
  EXPECT_EQ(error_of(R"({"zero_optimization": {"offload_param": {"device": "gpu"}}})"),
            "<string>: zero_optimization.offload_param.device: expected \"none\", \"cpu\", \"nvme\" or \"auto\", got "
            "\"gpu\"");
  EXPECT_EQ(error_of(R"({"zero_optimization": {"offload_param": {"pin_memory": "yes"}}})"),
            "<string>: zero_optimization.offload_param.pin_memory: expected true, false or null, got \"yes\"");
  EXPECT_EQ(error_of(R"({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}})"),
            "<string>: zero_optimization.offload_optimizer.ratio: expected a number from 0 to 1, got 1.5");
  EXPECT_EQ(error_of(R"({"zero_optimization": []})"), "<string>: zero_optimization: expected an object, got []");
  EXPECT_EQ(error_of(R"({"gradient_clipping": -1})"),
            "<string>: gradient_clipping: expected a number of at least 0, got -1");
  EXPECT_EQ(error_of(R"({"gradient_accumulation_steps": 0})"),
            "<string>: gradient_accumulation_steps: expected an integer from 1 to 1048576, got 0");
  EXPECT_EQ(error_of(R"({"optimizer": {"type": "Lamb"}})"),
            "<string>: optimizer.type: expected \"Adam\" or \"AdamW\", got \"Lamb\"");
  EXPECT_EQ(error_of(R"({"optimizer": {"params": {"betas": [0.9]}}})"),
            "<string>: optimizer.params.betas: expected [beta1, beta2] with each in [0, 1), got [0.9]");
  EXPECT_EQ(error_of(R"({"optimizer": {"params": {"eps": 0}}})"),
            "<string>: optimizer.params.eps: expected a number greater than 0 and at most 3.4028234663852886e+38, "
            "got 0");
  EXPECT_EQ(error_of(R"({"optimizer": {"params": {"amsgrad": true}}})"),
            "<string>: optimizer.params.amsgrad: AMSGrad is not supported by Strata's optimizers");
  // DeepSpeed's rule: type AdamW is AdamW whatever adam_w_mode says
  // (effective_adam_w_mode = name == AdamW or adam_w_mode).
  {
    auto c = parse_config(R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})");
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    EXPECT_TRUE(c->optimizer.adam_w_mode);
  }
  EXPECT_EQ(error_of(R"({"aio": {"block_size": 1000}})"),
            "<string>: aio.block_size: expected a multiple of 4096 bytes from 4 KiB to 64 MiB (O_DIRECT), got 1000");
  EXPECT_EQ(
      error_of(R"({"aio": {"block_size": "128MiB"}})"),
      "<string>: aio.block_size: expected a multiple of 4096 bytes from 4 KiB to 64 MiB (O_DIRECT), got 134217728");
  EXPECT_EQ(parse_ok(R"({"aio": {"block_size": "auto", "queue_depth": null}})").aio, AioConfig{});
  EXPECT_EQ(error_of(R"({"aio": {"queue_depth": 5000}})"),
            "<string>: aio.queue_depth: expected an integer from 1 to 4096, got 5000");
  EXPECT_EQ(
      error_of(R"({"aio": {"thread_count": 2, "intra_op_parallelism": 4}})"),
      "<string>: aio.thread_count: 2 differs from intra_op_parallelism 4 (it is that key's older name); keep one");
  EXPECT_EQ(error_of("[1, 2]"), "<string>: expected a JSON object at the top, got [1,2]");
}

TEST(ConfigErrors, SizesNegativeOrMalformed) {
  EXPECT_EQ(error_of(R"({"strata": {"host_memory": -5}})"),
            "<string>: strata.host_memory: expected a size in bytes (an integer or a string like \"24GiB\"), got -5");
  EXPECT_EQ(error_of(R"({"strata": {"host_memory": "-5GiB"}})"),
            "<string>: strata.host_memory: expected a size in bytes (an integer or a string like \"24GiB\"), got "
            "\"-5GiB\": a size cannot be negative");
  EXPECT_EQ(error_of(R"({"strata": {"device_memory": "12XB"}})"),
            "<string>: strata.device_memory: expected a size in bytes (an integer or a string like \"24GiB\"), got "
            "\"12XB\": unknown unit \"XB\" (use B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB or PiB)");
  EXPECT_EQ(
      error_of(R"({"strata": {"nvme": [{"path": "/a", "capacity": true}]}})"),
      "<string>: strata.nvme[0].capacity: expected a size in bytes (an integer or a string like \"24GiB\"), got true");
  EXPECT_EQ(error_of(R"({"aio": {"block_size": 0}})"),
            "<string>: aio.block_size: expected a multiple of 4096 bytes from 4 KiB to 64 MiB (O_DIRECT), got 0");
  EXPECT_EQ(
      error_of(R"({"strata": {"host_memory": "8GiB", "pinned_memory": "16GiB"}})"),
      "<string>: strata.pinned_memory: 16.0 GiB is more than strata.host_memory 8.0 GiB; pinned memory is part of it");
}

TEST(ConfigErrors, StrataKeysAreStrict) {
  // "auto" is a DeepSpeed placeholder; Strata's own keys must say what they mean.
  EXPECT_EQ(error_of(R"({"strata": {"prefetch_depth": "auto"}})"),
            "<string>: strata.prefetch_depth: expected an integer from 0 to 64, got \"auto\"");
  EXPECT_EQ(error_of(R"({"strata": {"world_size": 4, "rank": 4}})"),
            "<string>: strata.rank: 4 is out of range for world_size 4");
  EXPECT_EQ(error_of(R"({"strata": {"optimizer_state_dtype": "fp16"}})"),
            "<string>: strata.optimizer_state_dtype: expected \"fp32\" or \"bf16\", got \"fp16\"");
  EXPECT_EQ(error_of(R"({"strata": {"optimizer_state_rounding": "round"}})"),
            "<string>: strata.optimizer_state_rounding: expected \"stochastic\" or \"nearest\", got \"round\"");
  EXPECT_EQ(error_of(R"({"strata": {"groups": [{"compute": "host"}]}})"), "<string>: strata.groups[0].match: required");
  EXPECT_EQ(error_of(R"({"strata": {"groups": [{"match": "x", "grad": "gpu"}]}})"),
            "<string>: strata.groups[0].grad: expected \"auto\", \"device\", \"host\" or \"nvme\", got \"gpu\"");
  EXPECT_EQ(error_of(R"({"strata": {"nvme": ["/a", {"path": "/a"}]}})"),
            "<string>: strata.nvme[1].path: \"/a\" is listed twice");
  EXPECT_EQ(error_of(R"({"strata": {"nvme": [""]}})"), "<string>: strata.nvme[0]: expected a non-empty path, got \"\"");
}

TEST(ConfigErrors, CrossKeyChecks) {
  EXPECT_EQ(error_of(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})"),
            "<string>: bf16.enabled: true together with fp16.enabled; choose one precision");
  EXPECT_EQ(error_of(R"({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})"),
            "<string>: zero_optimization.offload_optimizer.nvme_path: required when device is \"nvme\" (or list "
            "directories in strata.nvme)");
  // ... but strata.nvme is enough.
  parse_ok(R"({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}, "strata": {"nvme": ["/n"]}})");
  EXPECT_EQ(error_of(R"({"bf16": {"enabled": true}, "bfloat16": {"enabled": true}})"),
            "<string>: bfloat16: given together with its alias bf16; keep one");
  EXPECT_EQ(error_of(R"({"zero_optimization": {"cpu_offload": true, "offload_optimizer": {"device": "cpu"}}})"),
            "<string>: zero_optimization.cpu_offload: deprecated; it conflicts with offload_optimizer, keep only "
            "offload_optimizer");
}

TEST(ConfigErrors, RejectedDeepSpeedFeatures) {
  EXPECT_EQ(error_of(R"({"amp": {"enabled": true, "opt_level": "O1"}})"),
            "<string>: amp: DeepSpeed feature not supported by Strata: Apex AMP; use \"bf16\" or \"fp16\"");
  EXPECT_EQ(error_of(R"({"sparse_attention": {"mode": "fixed"}})"),
            "<string>: sparse_attention: DeepSpeed feature not supported by Strata: it changes the model's attention");
  // Lower precision than Strata's fp32 masters, reductions and accumulation:
  // refused when asked for, accepted (listed as not used) at fp32 / false.
  EXPECT_EQ(error_of(R"({"fp16": {"enabled": true, "fp16_master_weights_and_grads": true}})"),
            "<string>: fp16.fp16_master_weights_and_grads: is true: not supported by Strata (Strata keeps fp32 "
            "master weights and gradients; fp16 ones are not offered)");
  EXPECT_EQ(error_of(R"({"communication_data_type": "bf16"})"),
            "<string>: communication_data_type: is \"bf16\": not supported by Strata (Strata reduces gradients in "
            "fp32, in a fixed order; remove the key or say \"fp32\")");
  EXPECT_EQ(error_of(R"({"data_types": {"grad_accum_dtype": "bf16"}})"),
            "<string>: data_types.grad_accum_dtype: is \"bf16\": not supported by Strata (Strata accumulates "
            "gradients in fp32; remove the key or say \"fp32\")");
  EXPECT_NE(error_of(R"({"data_types": {"grad_accum": "fp32"}})").find("data_types.grad_accum"), std::string::npos);
  EXPECT_NE(error_of(R"({"zero_optimization": {"stage": 3, "zero_quantized_gradients": true}})")
                .find("zero_optimization.zero_quantized_gradients: is true: not supported by Strata (ZeRO++"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"data_types": {"buffer_dtype": "bf16"}})").find("data_types.buffer_dtype: is \"bf16\""),
            std::string::npos);
  ConfigNotes notes;
  auto ok = parse_config(R"({"fp16": {"fp16_master_weights_and_grads": false}, "communication_data_type": "FP32",
                             "data_types": {"grad_accum_dtype": "fp32", "param_dtype": "bf16",
                                            "keep_in_fp32_modules": "auto", "buffer_dtype": null}})",
                         "<string>", &notes);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(notes.ignored_keys,
            (std::vector<std::string>{"fp16.fp16_master_weights_and_grads", "communication_data_type",
                                      "data_types.param_dtype", "data_types.keep_in_fp32_modules",
                                      "data_types.grad_accum_dtype"}));
}

TEST(ConfigErrors, DuplicateKeys) {
  EXPECT_EQ(error_of(R"({"zero_optimization": {"stage": 3, "stage": 2}})"),
            "<string>: zero_optimization.stage: duplicate key (only one value may be given)");
  EXPECT_EQ(error_of(R"({"strata": {"nvme": [{"path": "/a"}, {"path": "/b", "path": "/c"}]}})"),
            "<string>: strata.nvme[1].path: duplicate key (only one value may be given)");
}

// Issue 10: 200 KB of nesting once took 2.8 GB before failing; now it is
// refused at the 65th level, naming where.
TEST(ConfigErrors, DeepNestingIsRefusedEarly) {
  std::string deep = R"({"strata": {"x": )";
  for (int i = 0; i < 100000; ++i) deep += "[";
  for (int i = 0; i < 100000; ++i) deep += "]";
  deep += "}}";
  // Two objects and 62 arrays are kept (64 levels); the path names the 65th.
  std::string where = "strata.x";
  for (int i = 0; i < 62; ++i) where += "[0]";
  EXPECT_EQ(error_of(deep), "<string>: " + where + ": nested deeper than 64 levels");
}

TEST(ConfigErrors, MalformedJsonSaysWhere) {
  // nlohmann reports how many bytes it read: 23, the '}' after "tru" (index
  // 22), which is line 3, column 11.
  EXPECT_EQ(error_of("{\n  \"a\": 1,\n  \"b\": tru}"),
            "<string>: malformed JSON at byte 23 (line 3, column 11): syntax error while parsing value - invalid "
            "literal; last read: '\"b\": tru}'");
  EXPECT_EQ(error_of("{\"a\": 1,}"),
            "<string>: malformed JSON at byte 9 (line 1, column 9): syntax error while parsing object key - "
            "unexpected '}'; expected string literal");
  EXPECT_EQ(error_of(""),
            "<string>: malformed JSON at byte 1 (line 1, column 1): syntax error while parsing value - unexpected end "
            "of input; expected '[', '{', or a literal");
}

TEST(ConfigFiles, MissingFileIsNotFound) {
  auto r = load_config_file("/nonexistent-dir/strata.json");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(r.status().message(), "config file /nonexistent-dir/strata.json does not exist");
}

TEST(ConfigFiles, ErrorsNameTheFile) {
  char path[] = "/tmp/strata-config-test-XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  const std::string text = "{\"aio\": {\"queue_depth\": -1}}";
  ASSERT_EQ(write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
  close(fd);
  auto r = load_config_file(path);
  unlink(path);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), std::string(path) + ": aio.queue_depth: expected an integer from 1 to 4096, got -1");

  auto d = load_config_file("/tmp");
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().message(), "config file /tmp is a directory");
}

// ------------------------------------------------------------------ round trip

TEST(ConfigRoundTrip, SamplesSurviveToJsonAndBack) {
  for (const char* name :
       {"ds_zero3_infinity_nvme.json", "ds_zero3_cpu_hf_auto.json", "ds_zero2_offload_fp16.json", "strata_full.json"}) {
    SCOPED_TRACE(name);
    Config c = load(name);
    const std::string text = config_to_json(c);
    ConfigNotes notes;
    Config back = parse_ok(text, &notes);
    EXPECT_EQ(back, c) << text;
    EXPECT_TRUE(notes.ignored_keys.empty());  // the output holds only keys Strata uses
    EXPECT_EQ(config_to_json(back), text);
  }
}

// "stage" absent and "stage": 0 differ with N ranks (unset runs as stage 3,
// 0 is refused): both survive the round trip as they were.
TEST(ConfigRoundTrip, AnUnsetStageStaysUnset) {
  Config unset = parse_ok("{}");
  EXPECT_FALSE(unset.zero.stage_given);
  EXPECT_EQ(parse_ok(config_to_json(unset)), unset);
  Config zero = parse_ok(R"({"zero_optimization": {"stage": 0}})");
  EXPECT_TRUE(zero.zero.stage_given);
  EXPECT_EQ(zero.zero.stage, 0);
  EXPECT_EQ(parse_ok(config_to_json(zero)), zero);
}

TEST(ConfigRoundTrip, NonDefaultValuesEverywhere) {
  Config c;
  c.zero.stage = 1;
  c.zero.stage_given = true;
  c.zero.offload_param = {OffloadDevice::kCpu, "/p", 7, 12345, 99, true};
  c.zero.offload_optimizer = {OffloadDevice::kNone, "", 9, true, true, false, true, 0.25};
  c.zero.sub_group_size = 123;
  c.zero.prefetch_bucket_size = 0;
  c.aio = {4096, 3, 5, true, false, true};
  c.fp16 = {true, 128.0, 10, 77, 3, true, 0.5};
  c.optimizer = {OptimizerType::kAdam, 0.1, 0.8, 0.888, 1e-12, 0.3, false, false};
  c.gradient_clipping = 0.123456789012345;
  c.gradient_accumulation_steps = 17;
  c.strata.device_memory = 1;
  c.strata.device_reserve = 0;
  c.strata.device_reserve_given = true;
  c.strata.host_memory = UINT64_MAX;
  c.strata.pinned_memory = 5;
  c.strata.nvme = {{"/x", 1}, {"/y", 0}};
  c.strata.prefetch_depth = 0;
  c.strata.prefetch_bytes = 77;
  c.strata.io_backend = IoBackendChoice::kPosix;
  c.strata.trace = "t.json";
  c.strata.world_size = 8;
  c.strata.rank = 7;
  c.strata.shard_alignment = 1;
  c.strata.optimizer_chunk = 3;
  c.strata.groups = {{"a*", Tier::kDevice, Tier::kDevice, Tier::kDevice, Tier::kDevice}, {"b", Tier::kNvme}};
  auto r = parse_config(config_to_json(c));
  ASSERT_TRUE(r.ok()) << r.status().to_string() << "\n" << config_to_json(c);
  EXPECT_EQ(r.value(), c) << config_to_json(c);
}

}  // namespace
}  // namespace strata
