// Small helpers shared by the `strata bench ...` commands.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace strata::tools {

// Median of the samples (mean of the middle two for an even count); 0 for none.
double median(std::vector<double> samples);

// Memory the kernel says it can give without swapping (MemAvailable from
// /proc/meminfo), or 0 when unknown.
std::uint64_t available_memory();

// The device's sequential O_DIRECT ceiling in `dir`, as `strata bench io`
// measures it (io_uring, 1 MiB blocks, 8 MiB requests, queue depth 32,
// verified): a `bytes` file written, synced, read back, removed
// (tools/bench_io.cpp). bytes: a multiple of 8 MiB.
struct IoCeiling {
  double write_gbps = 0, read_gbps = 0;
};
Result<IoCeiling> measure_read_ceiling(const std::string& dir, std::uint64_t bytes);

}  // namespace strata::tools
