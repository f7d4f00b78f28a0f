// The reference tests' Python (torch, transformers, safetensors, peft from
// PyPI) and the rule for when it is missing: on a developer's machine the
// test skips and says why; where STRATA_REQUIRE_REFERENCE=1 (CI, which
// installs them) a missing reference is a failure, so a reference test can
// never pass by skipping there.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace strata::testing {

inline bool reference_required() {
  const char* v = std::getenv("STRATA_REQUIRE_REFERENCE");
  return v && std::strcmp(v, "1") == 0;
}

// The first of `configured` (a CMake cache path, may be empty),
// /tmp/torchvenv/bin/python and python3 that imports every module of
// `modules` ("torch, transformers"); "" if none does.
inline std::string find_reference_python(const std::string& configured, const std::string& modules) {
  std::vector<std::string> candidates;
  if (!configured.empty()) candidates.push_back(configured);
  candidates.push_back("/tmp/torchvenv/bin/python");
  candidates.push_back("python3");
  for (const auto& py : candidates) {
    const std::string cmd = py + " -c 'import " + modules + "' >/dev/null 2>&1";
    if (std::system(cmd.c_str()) == 0) return py;
  }
  return "";
}

// Runs `cmd` (stderr folded in); returns its exit status and output.
inline int run_capture(const std::string& cmd, std::string* out) {
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p)) *out += buf;
  return ::pclose(p);
}

}  // namespace strata::testing

// Skips (fails under STRATA_REQUIRE_REFERENCE=1) when the reference is missing.
#define STRATA_REFERENCE_MISSING(why)                                                    \
  do {                                                                                   \
    if (::strata::testing::reference_required())                                         \
      GTEST_FAIL() << (why) << " (STRATA_REQUIRE_REFERENCE=1: the reference must run)"; \
    GTEST_SKIP() << (why);                                                               \
  } while (0)
