// `strata bench accumulate`: the engine's gradient accumulation kernel
// (cpu_optim::accumulate: dst += float(g) with the norm's block squares in
// the same pass) against the memory bandwidth ceiling b[i] += s*c[i]
// (cpu_optim/membw.h, best ISA, same threads) and against the loop it
// replaced (the engine's scalar add on one thread, no squares), all measured
// in this run, iterations interleaved so drift on a shared machine hits all
// three alike.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_util.h"
#include "commands.h"
#include "common/float_convert.h"
#include "common/host_memory.h"
#include "common/units.h"
#include "cpu_optim/dispatch.h"
#include "cpu_optim/membw.h"
#include "cpu_optim/optimizer.h"

namespace strata::tools {
namespace {

using namespace strata::cpu_optim;

struct AccumBenchOptions {
  std::string elements = "32M";
  std::string grad = "bf16";
  int threads = 0;
  int iters = 10;
  bool json = false;
};

int fail(const std::string& msg) {
  std::fprintf(stderr, "strata bench accumulate: %s\n", msg.c_str());
  return 1;
}

// The engine's accumulation before cpu_optim::accumulate (one thread).
void old_loop(float* dst, const void* src, DType dtype, std::size_t n) {
  if (dtype == DType::kF32) {
    const float* s = static_cast<const float*>(src);
    for (std::size_t i = 0; i < n; ++i) dst[i] = dst[i] + s[i];
  } else if (dtype == DType::kBF16) {
    const auto* s = static_cast<const std::uint16_t*>(src);
    for (std::size_t i = 0; i < n; ++i) dst[i] = dst[i] + bf16_bits_to_f32(s[i]);
  } else {
    const auto* s = static_cast<const std::uint16_t*>(src);
    for (std::size_t i = 0; i < n; ++i) dst[i] = dst[i] + f16_bits_to_f32(s[i]);
  }
}

int run(const AccumBenchOptions& o) {
  auto count = parse_bytes(o.elements);
  if (!count.ok() || count.value() == 0 || count.value() > (std::size_t{1} << 36))
    return fail("--elements '" + o.elements + "': expected a count such as 33554432 or 32M, 1..64G");
  const std::size_t n = count.value();
  auto gd = parse_dtype(o.grad.c_str());
  if (!gd.ok()) return fail("--grad: " + gd.status().message());
  if (o.threads < 0 || o.threads > 4096) return fail("--threads: expected 0..4096");
  if (o.iters < 1 || o.iters > 100000) return fail("--iters: expected 1..100000");
  const std::size_t gsz = dtype_size(gd.value());
  const std::size_t bytes_per_elem = 4 + gsz + 4;  // read dst and g, write dst
  const std::uint64_t need = 2ull * n * (4 + gsz);
  if (const std::uint64_t avail = available_memory(); avail > 0 && need > avail)
    return fail(fmt::format("--elements {} needs {} of memory, {} is available: lower --elements", o.elements,
                            format_bytes(need), format_bytes(avail)));
  const int threads = detail::resolve_threads(o.threads);

  auto dst = HostArray<float>::create(n, true);
  auto g = HostArray<std::uint8_t>::create(n * gsz, true);
  const std::size_t nbw = std::max<std::size_t>(n * (4 + gsz) / 8, 1);  // the same footprint
  auto bw_b = HostArray<float>::create(nbw, true);
  auto bw_c = HostArray<float>::create(nbw, true);
  for (auto* s : {&dst.status(), &g.status(), &bw_b.status(), &bw_c.status()})
    if (!s->ok()) return fail(s->message());
  // 0x3c..: small positive numbers in every dtype; the sums stay finite.
  std::memset(dst->data(), 0, n * 4);
  std::memset(g->data(), 0x3c, n * gsz);
  std::memset(bw_b->data(), 0, nbw * 4);
  std::memset(bw_c->data(), 0x3c, nbw * 4);
  std::vector<double> block_sq((n + kNormBlock - 1) / kNormBlock);

  const ExecOptions ex{Isa::kAuto, threads};
  const ExecOptions ex_bw{best_isa(), threads};
  using Clock = std::chrono::steady_clock;
  auto secs = [](Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  std::vector<double> t_new, t_old, t_bw;
  for (int it = -1; it < o.iters; ++it) {  // -1: warm-up
    auto t0 = Clock::now();
    Status s = accumulate(dst->data(), g->data(), gd.value(), n, false, block_sq.data(), ex);
    auto t1 = Clock::now();
    if (!s.ok()) return fail(s.to_string());
    old_loop(dst->data(), g->data(), gd.value(), n);
    auto t2 = Clock::now();
    s = membw_rmw(bw_b->data(), bw_c->data(), 1e-7f, nbw, ex_bw);
    auto t3 = Clock::now();
    if (!s.ok()) return fail(s.to_string());
    if (it >= 0) {
      t_new.push_back(secs(t0, t1));
      t_old.push_back(secs(t1, t2));
      t_bw.push_back(secs(t2, t3));
    }
  }
  const double tn = median(t_new), to = median(t_old), tb = median(t_bw);
  const double gbps_new = static_cast<double>(n * bytes_per_elem) / tn / 1e9;
  const double gbps_old = static_cast<double>(n * bytes_per_elem) / to / 1e9;
  const double ceiling = static_cast<double>(nbw) * kMembwBytesPerElement / tb / 1e9;
  if (o.json) {
    nlohmann::json j;
    j["elements"] = n;
    j["grad"] = dtype_name(gd.value());
    j["threads"] = threads;
    j["isa"] = isa_name(resolve_isa(Isa::kAuto).value());
    j["iters"] = o.iters;
    j["seconds_median"] = tn;
    j["gbps"] = gbps_new;
    j["old_loop_seconds_median"] = to;
    j["old_loop_gbps"] = gbps_old;
    j["ceiling_gbps"] = ceiling;
    j["ratio"] = gbps_new / ceiling;
    j["speedup_vs_old_loop"] = to / tn;
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("gradient accumulation: %zu elements, %s gradient into fp32, %d threads, isa %s\n", n,
                dtype_name(gd.value()), threads, isa_name(resolve_isa(Isa::kAuto).value()));
    std::printf("  cpu_optim::accumulate (with the norm's squares): median of %d %.2f ms  %.1f GB/s\n", o.iters,
                tn * 1e3, gbps_new);
    std::printf("  the loop it replaced (scalar, 1 thread, no squares): %.2f ms  %.1f GB/s\n", to * 1e3, gbps_old);
    std::printf("  ceiling b[i] += s*c[i] (%s, %d threads): %.1f GB/s\n", isa_name(ex_bw.isa), threads, ceiling);
    std::printf("  ratio to ceiling: %.3f   speedup over the old loop: %.2fx\n", gbps_new / ceiling, to / tn);
  }
  return 0;
}

}  // namespace

void register_bench_accumulate(CLI::App& bench) {
  auto o = std::make_shared<AccumBenchOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "accumulate", "Gradient accumulation (with the norm) vs. memory bandwidth and the old loop, in the same run");
  cmd->add_option("--elements", o->elements, "fp32 accumulator elements (32M = 32*2^20)")->capture_default_str();
  cmd->add_option("--grad", o->grad, "Gradient dtype: fp32|bf16|fp16")->capture_default_str();
  cmd->add_option("--threads", o->threads, "Threads (0 = STRATA_THREADS or the CPUs this process may use)")
      ->capture_default_str();
  cmd->add_option("--iters", o->iters, "Timed iterations (median reported)")->capture_default_str();
  cmd->add_flag("--json", o->json, "Print one JSON object");
  for (CLI::Option* opt : cmd->get_options()) opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd->callback([o] { set_exit_code(run(*o)); });
}

}  // namespace strata::tools
