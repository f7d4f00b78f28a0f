#include "bench_util.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>

namespace strata::tools {

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::uint64_t available_memory() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (!f) return 0;
  char line[256];
  std::uint64_t kib = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "MemAvailable: %" SCNu64 " kB", &kib) == 1) break;
  std::fclose(f);
  return kib * 1024;
}

}  // namespace strata::tools
