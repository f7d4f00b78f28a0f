// Small helpers shared by the `strata bench ...` commands.
#pragma once

#include <cstdint>
#include <vector>

namespace strata::tools {

// Median of the samples (mean of the middle two for an even count); 0 for none.
double median(std::vector<double> samples);

// Memory the kernel says it can give without swapping (MemAvailable from
// /proc/meminfo), or 0 when unknown.
std::uint64_t available_memory();

}  // namespace strata::tools
