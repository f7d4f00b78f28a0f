// The command line's flag parsing (tools/finetune_flags.h): every user string
// becomes a typed trainer option, or an error naming the flag and the value.
#include "finetune_flags.h"

#include "cli_values.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace strata::tools {
namespace {

// Moved from tests/train/trainer_test.cpp (DeviceChoice) with the parser.
TEST(FinetuneFlags, DeviceNames) {
  EXPECT_EQ(parse_train_device("auto").value(), train::TrainDevice::kAuto);
  EXPECT_EQ(parse_train_device("cuda").value(), train::TrainDevice::kCuda);
  EXPECT_EQ(parse_train_device("cpu").value(), train::TrainDevice::kCpu);
  auto bad = parse_train_device("gpu");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("\"gpu\""), std::string::npos) << bad.status().message();
  EXPECT_EQ(bad.status().message(), "device \"gpu\" is not one of auto, cuda, cpu");
}

TEST(FinetuneFlags, OffloadTargets) {
  OffloadDevice d = OffloadDevice::kAuto;
  std::string path;
  ASSERT_TRUE(parse_offload_flag("nvme:/mnt/x", &d, &path).ok());
  EXPECT_EQ(d, OffloadDevice::kNvme);
  EXPECT_EQ(path, "/mnt/x");
  ASSERT_TRUE(parse_offload_flag("cpu", &d, &path).ok());
  EXPECT_EQ(d, OffloadDevice::kCpu);
  Status bad = parse_offload_flag("nvme:", &d, &path);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.message(), "offload target \"nvme:\" is not one of nvme:DIR, cpu, none, auto");
}

// Parsed into typed options: the trainer gets enums, numbers and a dtype.
TEST(FinetuneFlags, TypedOptions) {
  CLI::App app;
  CLI::App* cmd = app.add_subcommand("finetune");
  FinetuneFlags f;
  add_finetune_flags(cmd, &f);
  app.parse("finetune --model m --data d --device cpu --export-dtype bf16 --progress bar --host-mem 64GiB",
            /*program_name_included=*/false);
  train::TrainerOptions o;
  ASSERT_TRUE(build_trainer_options(f, &o).ok());
  EXPECT_EQ(o.config.strata.host_memory, uint64_t{64} << 30);
  EXPECT_EQ(o.progress, train::ProgressMode::kBar);
  EXPECT_EQ(o.export_dtype, DType::kBF16);
  EXPECT_EQ(o.device, train::TrainDevice::kCpu);

  FinetuneFlags g = f;
  g.progress = "loud";
  EXPECT_EQ(build_trainer_options(g, &o).message(), "--progress \"loud\" is not one of auto, bar, lines, quiet");
  g = f;
  g.export_dtype = "fp8";
  EXPECT_EQ(build_trainer_options(g, &o).message(), "--export-dtype: unknown dtype 'fp8' (expected fp32|bf16|fp16)");
}

// What CLI11 2.1 would bend is refused naming the option (cli_values.h):
// 64-bit overflow (clamped), negative unsigned values (wrapped), empty values
// (read as 0 or the default); leading zeros are decimal, not octal.
TEST(FinetuneFlags, ValuesAreReadStrictly) {
  auto parse = [](const std::vector<std::string>& extra, FinetuneFlags* f) -> std::string {
    CLI::App app;
    CLI::App* cmd = app.add_subcommand("finetune");
    add_finetune_flags(cmd, f);
    read_values_strictly(app);
    std::vector<std::string> args = {"finetune", "--model", "m", "--data", "d"};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 takes the arguments reversed
    try {
      app.parse(reversed);
    } catch (const CLI::ParseError& e) {
      return e.what();
    }
    return "";
  };
  FinetuneFlags f;
  EXPECT_EQ(parse({"--steps", "010", "--seed", "+7", "--warmup", "-0"}, &f), "");
  EXPECT_EQ(f.steps, 10);
  EXPECT_EQ(f.seed, 7u);
  EXPECT_EQ(f.warmup, 0);
  EXPECT_EQ(parse({"--steps", "9223372036854775807"}, &f), "");
  EXPECT_EQ(f.steps, INT64_MAX);
  EXPECT_EQ(parse({"--steps", "99999999999999999999"}, &f),
            "--steps: '99999999999999999999' is out of range (-9223372036854775808 to 9223372036854775807)");
  EXPECT_EQ(parse({"--seed", "18446744073709551616"}, &f),
            "--seed: '18446744073709551616' is out of range (0 to 18446744073709551615)");
  EXPECT_EQ(parse({"--seed", "-1"}, &f), "--seed: '-1' is negative: expected 0 to 18446744073709551615");
  for (const char* bad : {"1.5", "0x10", "1e3", "", "-", "+-3", " 4"}) {
    FinetuneFlags g;
    const std::string why = parse({"--save-every", bad}, &g);
    EXPECT_NE(why.find("--save-every: "), std::string::npos) << bad << ": " << why;
  }
  for (const char* opt : {"--lr", "--device-mem", "--lora-targets", "--out"}) {
    FinetuneFlags g;
    EXPECT_EQ(parse({opt, ""}, &g), std::string(opt) + ": an empty value: give one, or leave the option out");
  }
}

}  // namespace
}  // namespace strata::tools
