#!/usr/bin/env bash
# Configures and builds Strata into ${BUILD_DIR:-build}. Extra arguments go to
# CMake (e.g. -DSTRATA_CUDA=OFF). Used by the other scripts.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"
JOBS="${JOBS:-$(nproc)}"
GEN=()
if command -v ninja >/dev/null 2>&1; then GEN=(-G Ninja); fi
# ccache (scripts/setup.sh installs it), with the build directory left out of
# the hash: trees configured with the same compile flags share objects (a
# file whose flags and headers are the same in two trees is compiled once).
# CI builds several trees in one run, and the Python package's pip build
# (python/tests/run_package_tests.sh) reuses this tree's objects.
# STRATA_CCACHE=0 builds without it.
LAUNCH=()
if [[ "${STRATA_CCACHE:-1}" != 0 ]] && command -v ccache >/dev/null 2>&1; then
  launcher="env;CCACHE_NOHASHDIR=true;ccache"
  LAUNCH=(-DCMAKE_C_COMPILER_LAUNCHER="$launcher" -DCMAKE_CXX_COMPILER_LAUNCHER="$launcher")
fi
if [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]]; then
  cmake -S "$ROOT" -B "$BUILD_DIR" "${GEN[@]}" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" "${LAUNCH[@]}" "$@"
else
  cmake -S "$ROOT" -B "$BUILD_DIR" "$@" >/dev/null
fi
cmake --build "$BUILD_DIR" -j "$JOBS"
