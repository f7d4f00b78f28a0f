// `strata bench adam`: the CPU optimizer step against the machine's memory
// bandwidth, both measured in this run. The ceiling is the read-modify-write
// kernel b[i] += s*c[i] (cpu_optim/membw.h) on arrays as large as the
// optimizer's, with the same threads and blocks, and with the best ISA this
// machine has (not the one forced with --isa): a narrower ISA can fall short
// of the memory's bandwidth, and the ceiling is the machine's, not the
// kernel's. Iterations of the two alternate so that drift on a shared
// machine hits both alike.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_util.h"
#include "commands.h"
#include "common/host_memory.h"
#include "common/units.h"
#include "cpu_optim/dispatch.h"
#include "cpu_optim/membw.h"
#include "cpu_optim/optimizer.h"
#include "cpu_optim/types.h"

namespace strata::tools {
namespace {

using namespace strata::cpu_optim;

struct AdamBenchOptions {
  std::string params = "128M";
  std::string threads = "0";
  std::string grad = "fp32";
  std::string states = "fp32";
  std::string optimizer = "adamw";
  std::string isa = "auto";
  std::string iters = "10";
  bool out_bf16 = false;
  bool out_fp16 = false;
  bool amsgrad = false;
  bool no_huge_pages = false;
  bool json = false;
};

int fail(const std::string& msg) {
  std::fprintf(stderr, "strata bench adam: %s\n", msg.c_str());
  return 1;
}

bool parse_int(const std::string& s, long lo, long hi, long* out) {
  char* end = nullptr;
  long v = std::strtol(s.c_str(), &end, 10);
  if (s.empty() || !end || *end != '\0' || v < lo || v > hi) return false;
  *out = v;
  return true;
}

template <class T>
Result<HostArray<T>> alloc(std::size_t n, bool huge) {
  return HostArray<T>::create(n, huge);
}

// Touches every page from the threads that will use it (first touch), in
// the same blocks as the kernels, and fills with a byte pattern.
void fill(void* p, std::size_t bytes, std::uint8_t byte, int threads) {
  struct Ctx {
    std::uint8_t* p;
    std::size_t bytes;
    std::uint8_t byte;
  } ctx{static_cast<std::uint8_t*>(p), bytes, byte};
  constexpr std::size_t kChunk = std::size_t{1} << 21;
  detail::parallel_blocks((bytes + kChunk - 1) / kChunk, threads,
                          [](void* c, std::size_t b0, std::size_t b1) {
                            auto* x = static_cast<Ctx*>(c);
                            std::size_t lo = b0 * kChunk, hi = std::min(x->bytes, b1 * kChunk);
                            std::memset(x->p + lo, x->byte, hi - lo);
                          },
                          &ctx);
}

int run(const AdamBenchOptions& o) {
  auto count_r = parse_bytes(o.params);
  if (!count_r.ok())
    return fail("--params '" + o.params + "': expected a parameter count such as 134217728, 128M or 1G (K/M/G = 2^10/2^20/2^30)");
  const std::size_t n = count_r.value();
  if (n == 0) return fail("--params must be > 0");
  // Checked before any size arithmetic (n * bytes per element must not wrap).
  if (n > (std::size_t{1} << 40)) return fail("--params '" + o.params + "': at most 1T (2^40) parameters");
  long threads_l = 0, iters = 0;
  if (!parse_int(o.threads, 0, 4096, &threads_l)) return fail("--threads '" + o.threads + "': expected 0..4096");
  if (!parse_int(o.iters, 1, 100000, &iters)) return fail("--iters '" + o.iters + "': expected 1..100000");
  auto gd = parse_dtype(o.grad.c_str());
  if (!gd.ok()) return fail("--grad: " + gd.status().message());
  auto sd = parse_dtype(o.states.c_str());
  if (!sd.ok() || sd.value() == DType::kF16) return fail("--states '" + o.states + "': expected fp32|bf16");
  auto kind = parse_optimizer(o.optimizer.c_str());
  if (!kind.ok()) return fail("--optimizer: " + kind.status().message());
  auto isa_req = parse_isa(o.isa);
  if (!isa_req.ok()) return fail("--isa: " + isa_req.status().message());
  auto isa = resolve_isa(isa_req.value());
  if (!isa.ok()) return fail(isa.status().message());
  if (o.out_bf16 && o.out_fp16) return fail("--out-bf16 and --out-fp16 are exclusive");
  const int threads = detail::resolve_threads(static_cast<int>(threads_l));
  const bool huge = !o.no_huge_pages;

  OptimizerConfig cfg;
  cfg.kind = kind.value();
  cfg.lr = 1e-4;
  cfg.weight_decay = 0.01;
  cfg.amsgrad = o.amsgrad;
  if (cfg.kind == OptimizerKind::kSgd) cfg.momentum = 0.9;
  if (cfg.kind == OptimizerKind::kLion) cfg.beta2 = 0.99;
  const int nstates = state_count(cfg);

  // Everything below is touched: refuse what this machine cannot hold rather
  // than be killed by the OOM killer halfway. The optimizer's arrays, plus
  // ceiling arrays of the same total size.
  {
    std::size_t per_param = 4 + dtype_size(gd.value()) + nstates * dtype_size(sd.value());
    if (o.out_bf16 || o.out_fp16) per_param += 2;
    const std::uint64_t need = 2ull * n * per_param;
    const std::uint64_t avail = available_memory();
    if (avail > 0 && need > avail)
      return fail(
          fmt::format("--params {} needs {} of memory ({} for the optimizer's arrays and as much for the "
                      "bandwidth ceiling's), but only {} is available here: lower --params",
                      o.params, format_bytes(need), format_bytes(need / 2), format_bytes(avail)));
  }

  // Optimizer buffers.
  auto p = alloc<float>(n, huge);
  if (!p.ok()) return fail(p.status().message());
  auto g = alloc<std::uint8_t>(n * dtype_size(gd.value()), huge);
  if (!g.ok()) return fail(g.status().message());
  std::vector<HostArray<std::uint8_t>> st;
  for (int i = 0; i < nstates; ++i) {
    auto s = alloc<std::uint8_t>(n * dtype_size(sd.value()), huge);
    if (!s.ok()) return fail(s.status().message());
    st.push_back(std::move(s.value()));
  }
  HostArray<std::uint8_t> out;
  if (o.out_bf16 || o.out_fp16) {
    auto r = alloc<std::uint8_t>(n * 2, huge);
    if (!r.ok()) return fail(r.status().message());
    out = std::move(r.value());
  }
  StepBuffers b;
  b.params = p->data();
  b.grads = g->data();
  b.grad_dtype = gd.value();
  for (int i = 0; i < nstates; ++i) b.state[i] = st[i].data();
  b.state_dtype = sd.value();
  if (out.data()) {
    b.params_out = out.data();
    b.out_dtype = o.out_fp16 ? DType::kF16 : DType::kBF16;
  }
  // 0x3c.. is a small positive number in fp32 (0.0115), bf16 (0.0115) and fp16 (1.06).
  fill(p->data(), n * 4, 0x3c, threads);
  fill(g->data(), g->size(), 0x3c, threads);
  for (auto& s : st) fill(s.data(), s.size(), 0, threads);
  if (out.data()) fill(out.data(), out.size(), 0, threads);
  std::size_t footprint = n * 4 + g->size();
  for (auto& s : st) footprint += s.size();
  footprint += out.size();

  // Ceiling arrays: as many bytes as the optimizer's, split over b and c.
  const std::size_t nbw = std::max<std::size_t>(footprint / 8, 1);
  auto bw_b = alloc<float>(nbw, huge);
  if (!bw_b.ok()) return fail(bw_b.status().message());
  auto bw_c = alloc<float>(nbw, huge);
  if (!bw_c.ok()) return fail(bw_c.status().message());
  fill(bw_b->data(), nbw * 4, 0, threads);
  fill(bw_c->data(), nbw * 4, 0x3c, threads);

  const ExecOptions ex{isa.value(), threads};
  const ExecOptions ex_bw{best_isa(), threads};
  using Clock = std::chrono::steady_clock;
  std::vector<double> t_opt, t_bw;
  std::int64_t step_no = 0;
  for (long it = -1; it < iters; ++it) {  // it == -1: warm-up, not recorded
    auto t0 = Clock::now();
    Status s = step(cfg, ++step_no, b, n, ex);
    auto t1 = Clock::now();
    if (!s.ok()) return fail(s.to_string());
    s = membw_rmw(bw_b->data(), bw_c->data(), 1e-7f, nbw, ex_bw);
    auto t2 = Clock::now();
    if (!s.ok()) return fail(s.to_string());
    if (it >= 0) {
      t_opt.push_back(std::chrono::duration<double>(t1 - t0).count());
      t_bw.push_back(std::chrono::duration<double>(t2 - t1).count());
    }
  }
  const double topt = median(t_opt), tbw = median(t_bw);
  const std::size_t bpp = bytes_per_param(cfg, b);
  const double params_per_s = static_cast<double>(n) / topt;
  const double gbps = params_per_s * static_cast<double>(bpp) / 1e9;
  const double ceiling = static_cast<double>(nbw) * kMembwBytesPerElement / tbw / 1e9;
  const double ratio = gbps / ceiling;
  const bool huge_ok = p->huge_pages();

  if (o.json) {
    nlohmann::json j;
    j["optimizer"] = optimizer_name(cfg.kind);
    j["params"] = n;
    j["threads"] = threads;
    j["isa"] = isa_name(isa.value());
    j["grad"] = dtype_name(b.grad_dtype);
    j["states"] = dtype_name(b.state_dtype);
    j["out"] = b.params_out ? dtype_name(b.out_dtype) : "none";
    j["huge_pages"] = huge_ok;
    j["iters"] = iters;
    j["bytes_per_param"] = bpp;
    j["seconds_median"] = topt;
    j["seconds"] = t_opt;
    j["params_per_s"] = params_per_s;
    j["gbps"] = gbps;
    j["ceiling_gbps"] = ceiling;
    j["ceiling_isa"] = isa_name(ex_bw.isa);
    j["ceiling_seconds"] = t_bw;
    j["ratio"] = ratio;
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("%s step: %zu params, %d threads, isa %s, grad %s, states %s, out %s, huge pages %s\n",
                optimizer_name(cfg.kind), n, threads, isa_name(isa.value()), dtype_name(b.grad_dtype),
                dtype_name(b.state_dtype), b.params_out ? dtype_name(b.out_dtype) : "none", huge_ok ? "yes" : "no");
    std::printf("  median of %ld: %.2f ms  %.3g params/s  %.1f GB/s (%zu B/param)\n", iters, topt * 1e3,
                params_per_s, gbps, bpp);
    std::printf("  ceiling b[i] += s*c[i] on %s (%s): %.1f GB/s\n", format_bytes(nbw * 8).c_str(),
                isa_name(ex_bw.isa), ceiling);
    std::printf("  ratio to ceiling: %.3f\n", ratio);
  }
  return 0;
}

}  // namespace

void register_bench_adam(CLI::App& bench) {
  auto o = std::make_shared<AdamBenchOptions>();
  CLI::App* cmd = bench.add_subcommand("adam", "CPU optimizer step vs. memory bandwidth measured in the same run");
  cmd->add_option("--params", o->params, "Number of fp32 parameters (128M = 128*2^20)")->capture_default_str();
  cmd->add_option("--threads", o->threads, "Threads (0 = STRATA_THREADS or the CPUs this process may use)")
      ->capture_default_str();
  cmd->add_option("--grad", o->grad, "Gradient dtype: fp32|bf16|fp16")->capture_default_str();
  cmd->add_option("--states", o->states, "Moment dtype: fp32|bf16")->capture_default_str();
  cmd->add_flag("--out-bf16", o->out_bf16, "Also write the updated params as bf16 in the same pass");
  cmd->add_flag("--out-fp16", o->out_fp16, "Also write the updated params as fp16 in the same pass");
  cmd->add_option("--optimizer", o->optimizer, "adamw|adam|adagrad|lion|sgd")->capture_default_str();
  cmd->add_flag("--amsgrad", o->amsgrad, "Adam/AdamW with amsgrad");
  cmd->add_option("--isa", o->isa, "auto|scalar|avx2|avx512|neon")->capture_default_str();
  cmd->add_option("--iters", o->iters, "Timed iterations (median reported)")->capture_default_str();
  cmd->add_flag("--no-huge-pages", o->no_huge_pages, "Allocate without MADV_HUGEPAGE (for comparison)");
  cmd->add_flag("--json", o->json, "Print one JSON object");
  // A repeated option takes its last value, as in most command lines.
  for (CLI::Option* opt : cmd->get_options()) opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd->callback([o] { set_exit_code(run(*o)); });
}

}  // namespace strata::tools
