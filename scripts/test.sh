#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite with ctest.
#   scripts/test.sh                 # everything (gpu tests skip without a GPU)
#   scripts/test.sh -L unit         # extra arguments go to ctest
# BUILD_DIR, BUILD_TYPE, JOBS and CMAKE_ARGS (e.g. "-DSTRATA_SANITIZE=ON") are honoured.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"
export BUILD_DIR
bash "$ROOT/scripts/setup.sh"
# shellcheck disable=SC2086
bash "$ROOT/scripts/build.sh" ${CMAKE_ARGS:-}
cd "$BUILD_DIR"
ctest --output-on-failure -j "${JOBS:-$(nproc)}" "$@"
