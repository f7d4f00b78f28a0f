#include "common/tunables.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace strata {
namespace {

Tunables g_tunables;
std::once_flag g_once;

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

// Logging is not usable yet while tunables are parsed (it reads the level from
// here), so report malformed values straight to stderr.
void bad_value(const char* name, const char* value, const char* expected) {
  std::fprintf(stderr, "strata warn: ignoring %s=%s (expected %s)\n", name, value, expected);
}

bool parse_bool(const char* name, bool fallback) {
  const char* v = env(name);
  if (!v) return fallback;
  if (!std::strcmp(v, "1") || !std::strcmp(v, "true") || !std::strcmp(v, "on") || !std::strcmp(v, "yes")) return true;
  if (!std::strcmp(v, "0") || !std::strcmp(v, "false") || !std::strcmp(v, "off") || !std::strcmp(v, "no")) return false;
  bad_value(name, v, "0|1");
  return fallback;
}

void parse() {
  Tunables t;
  if (const char* v = env("STRATA_LOG_LEVEL")) {
    if (auto level = find_enum<LogLevel>(v)) t.log_level = *level;
    else bad_value("STRATA_LOG_LEVEL", v, enum_name_list<LogLevel>("|").c_str());
  }
  if (const char* v = env("STRATA_IO_BACKEND")) {
    if (!std::strcmp(v, "uring") || !std::strcmp(v, "aio") || !std::strcmp(v, "posix")) t.io_backend = v;
    else bad_value("STRATA_IO_BACKEND", v, "uring|aio|posix");
  }
  if (const char* v = env("STRATA_CPU_ISA")) {
    if (!std::strcmp(v, "avx512") || !std::strcmp(v, "avx2") || !std::strcmp(v, "neon") || !std::strcmp(v, "scalar"))
      t.cpu_isa = v;
    else bad_value("STRATA_CPU_ISA", v, "avx512|avx2|neon|scalar");
  }
  if (const char* v = env("STRATA_THREADS")) {
    char* end = nullptr;
    long n = std::strtol(v, &end, 10);
    if (end && *end == '\0' && n >= 0 && n <= 4096) t.threads = static_cast<int>(n);
    else bad_value("STRATA_THREADS", v, "an integer 0..4096");
  }
  t.io_uring_disable = parse_bool("STRATA_IO_URING_DISABLE", false);
  if (const char* v = env("STRATA_IO_QUEUE_DEPTH")) {
    char* end = nullptr;
    long n = std::strtol(v, &end, 10);
    if (end && *end == '\0' && n >= 1 && n <= 4096) t.io_queue_depth = static_cast<unsigned>(n);
    else bad_value("STRATA_IO_QUEUE_DEPTH", v, "an integer 1..4096");
  }
  if (const char* v = env("STRATA_IO_BLOCK_BYTES")) {
    char* end = nullptr;
    unsigned long long n = std::strtoull(v, &end, 10);
    if (end && *end == '\0' && n >= 4096 && n % 4096 == 0 && n <= (64ull << 20)) t.io_block_bytes = n;
    else bad_value("STRATA_IO_BLOCK_BYTES", v, "a multiple of 4096 up to 67108864");
  }
  t.io_sqpoll = parse_bool("STRATA_IO_SQPOLL", false);
  t.cuda_disable = parse_bool("STRATA_CUDA_DISABLE", false);
  if (const char* v = env("STRATA_CUDA_MODULE")) t.cuda_module = v;
  t.require_gpu = parse_bool("STRATA_REQUIRE_GPU", false);
  g_tunables = t;
}

}  // namespace

const Tunables& tunables() {
  std::call_once(g_once, parse);
  return g_tunables;
}

void reload_tunables() {
  std::call_once(g_once, [] {});
  parse();
}

}  // namespace strata
