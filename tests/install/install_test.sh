#!/usr/bin/env bash
# `cmake --install` into a temporary prefix, then what a user of the library
# does: a C program built against the installed Strata with find_package(Strata)
# and with pkg-config, a C++ one through <strata/strata.hpp>, each run; and the
# installed command line runs and finds its CUDA module under <prefix>/lib/strata.
#   install_test.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/strata-install-test-XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "install_test: FAILED: $*"; exit 1; }
prefix="$work/prefix"
cmake --install "$build" --prefix "$prefix" >"$work/install.log" || { cat "$work/install.log"; fail "cmake --install"; }
for f in lib/libstrata.so include/strata/strata.h include/strata/strata.hpp bin/strata \
         lib/cmake/Strata/StrataConfig.cmake lib/cmake/Strata/StrataConfigVersion.cmake lib/pkgconfig/strata.pc; do
  [[ -e "$prefix/$f" ]] || fail "$f is not installed"
done

mkdir -p "$work/app"
cat >"$work/app/app.c" <<'C'
#include <stdio.h>
#include <string.h>
#include <strata/strata.h>
/* One AdamW step on four numbers through the installed library. */
int main(void) {
  strata_optimizer_config_t cfg;
  strata_cpu_optimizer_t opt = NULL;
  float w[4] = {1, 2, 3, 4}, g[4] = {0.5f, -0.5f, 0.25f, 0}, m[4] = {0}, v[4] = {0};
  if (strata_optimizer_config_init(STRATA_OPTIMIZER_ADAMW, &cfg) != STRATA_OK) return 2;
  if (strata_cpu_optimizer_create(STRATA_ISA_AUTO, 1, &opt) != STRATA_OK) return 3;
  strata_optimizer_buffers_t b;
  memset(&b, 0, sizeof b);
  b.struct_size = sizeof b;
  b.params = w;
  b.grads = g;
  b.grad_dtype = STRATA_DTYPE_F32;
  b.state[0] = m;
  b.state[1] = v;
  b.state_dtype = STRATA_DTYPE_F32;
  strata_status_t st = strata_cpu_optimizer_step(opt, &cfg, 1, &b, 4);
  strata_cpu_optimizer_destroy(opt);
  if (st != STRATA_OK) return 4;
  printf("strata %s api %d: w0 %.6f\n", strata_version(), strata_api_version(), w[0]);
  return w[0] < 1.0f ? 0 : 5;
}
C
cat >"$work/app/app.cpp" <<'CPP'
#include <cstdio>
#include <strata/strata.hpp>
int main() {
  std::printf("strata %s from C++\n", strata_version());
  return 0;
}
CPP
cat >"$work/app/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.20)
project(strata_user C CXX)
find_package(Strata 0.1 REQUIRED)
add_executable(app_c app.c)
target_link_libraries(app_c PRIVATE Strata::strata)
add_executable(app_cpp app.cpp)
set_target_properties(app_cpp PROPERTIES CXX_STANDARD 17)
target_link_libraries(app_cpp PRIVATE Strata::strata)
CM
cmake -S "$work/app" -B "$work/app/build" -DCMAKE_PREFIX_PATH="$prefix" >"$work/cfg.log" 2>&1 ||
  { cat "$work/cfg.log"; fail "find_package(Strata) project does not configure"; }
cmake --build "$work/app/build" >"$work/build.log" 2>&1 || { cat "$work/build.log"; fail "find_package(Strata) project does not build"; }
out=$("$work/app/build/app_c") || fail "the find_package C program failed: $out"
echo "find_package: $out"
out=$("$work/app/build/app_cpp") || fail "the C++ program failed: $out"
echo "find_package C++: $out"

cflags=$(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --cflags --libs strata) || fail "pkg-config strata"
# shellcheck disable=SC2086
cc "$work/app/app.c" $cflags -o "$work/app_pc" || fail "cc with pkg-config flags ($cflags)"
out=$(LD_LIBRARY_PATH="$prefix/lib" "$work/app_pc") || fail "the pkg-config program failed: $out"
echo "pkg-config: $out"

ver=$("$prefix/bin/strata" --version) || fail "installed strata --version"
echo "$ver" | head -n 1
if [[ -e "$prefix/lib/strata/libstrata_cuda.so" ]]; then
  # No GPU here: the backend still names the installed module it loaded.
  [[ "$ver" == *"$prefix/lib/strata/libstrata_cuda.so"* || "$ver" == *"device backend       cuda"* ]] ||
    fail "the installed CLI did not use the installed CUDA module: $ver"
fi
echo "install_test: ok"
