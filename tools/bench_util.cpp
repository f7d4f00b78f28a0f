#include "bench_util.h"

#include "common/host_memory.h"

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

std::uint64_t available_memory() { return host_memory_available(); }

}  // namespace strata::tools
