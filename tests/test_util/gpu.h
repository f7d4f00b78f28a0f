// GPU tests that cannot run here. Without a GPU they skip; under
// STRATA_REQUIRE_GPU=1 (tools/gpu_check.sh on the GPU machine) they fail with
// the reason (e.g. the dlerror() text of a CUDA module that exists but does
// not load), so a GPU check can never pass by skipping.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>

namespace strata::test {

inline bool gpu_required() {
  const char* v = std::getenv("STRATA_REQUIRE_GPU");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

}  // namespace strata::test

// Use where a GPU test would GTEST_SKIP() for want of a GPU: `why` is
// streamed (STRATA_SKIP_WITHOUT_GPU("no device: " << status.message())).
#define STRATA_SKIP_WITHOUT_GPU(why)                                                   \
  do {                                                                                 \
    std::ostringstream strata_gpu_why_;                                                \
    strata_gpu_why_ << why;                                                            \
    if (::strata::test::gpu_required()) FAIL() << "STRATA_REQUIRE_GPU=1: " << strata_gpu_why_.str(); \
    GTEST_SKIP() << strata_gpu_why_.str();                                            \
  } while (0)
