#!/usr/bin/env bash
# The Python package as a user gets it: `pip install` of this clone into a
# fresh virtual environment, then python/tests run against the installed
# package from outside the source tree (never the build tree).
#
#   run_package_tests.sh SOURCE_DIR WORK_DIR [gpu [CUDA_ARCHITECTURES]]
#
# The environment sees the system's site-packages (--system-site-packages),
# so torch, transformers and peft are not downloaded again. The CMake build
# goes to WORK_DIR/skbuild and is reused by later runs. The package is built
# without its CUDA modules here (STRATA_CUDA=OFF: the tests run the CPU
# path; the other builds compile the CUDA code). Exit 77 (skip) without
# torch/transformers/peft, unless STRATA_REQUIRE_REFERENCE=1 (CI).
#
# gpu (ctest python_package_gpu): the package built with its CUDA modules
# (STRATA_CUDA=ON, for CUDA_ARCHITECTURES when given, "90" or "80,86"), and
# only test_torch_gpu.py run (strata.torch on a GPU). Exit 77 (skip) before
# building when torch sees no CUDA device, a failure instead under
# STRATA_REQUIRE_GPU=1 (tools/gpu_check.sh), which the tests also honour. Where
# scikit-build-core is already importable the build uses it
# (--no-build-isolation: the GPU machine has no package registry).
#
# STRATA_PACKAGE_BUILD_TYPE, STRATA_PACKAGE_WERROR, STRATA_PACKAGE_CC and
# STRATA_PACKAGE_CXX (ctest sets them to its own tree's CMAKE_BUILD_TYPE,
# STRATA_WERROR and compilers) build the package with the compiler and flags
# of the tree that runs the test, so that ccache (with the build directory
# out of its hash, as scripts/build.sh uses it; it hashes the compiler's name
# too: pip's build would call g++ where CMake called c++) hands the pip build
# that tree's objects instead of compiling the library a second time; unset,
# the package is built as `pip install .` builds it (Release).
set -euo pipefail
SRC=$(cd "$1" && pwd)
WORK=$2
MODE=${3:-cpu}
ARCHS=${4:-}
PY=${STRATA_TEST_PYTHON:-python3}
case "$MODE" in
  cpu) NAME=python_package; PATTERN='test*.py'; CUDA=OFF ;;
  gpu) NAME=python_package_gpu; PATTERN='test_torch_gpu.py'; CUDA=ON ;;
  *) echo "usage: $0 SOURCE_DIR WORK_DIR [gpu [CUDA_ARCHITECTURES]]" >&2; exit 2 ;;
esac
if ! "$PY" -c 'import torch, transformers, peft' >/dev/null 2>&1; then
  if [[ "${STRATA_REQUIRE_REFERENCE:-0}" == "1" || ( "$MODE" == gpu && "${STRATA_REQUIRE_GPU:-0}" == "1" ) ]]; then
    echo "$NAME: FAILED: cannot import torch/transformers/peft with $PY (STRATA_REQUIRE_REFERENCE=1 or STRATA_REQUIRE_GPU=1)"
    exit 1
  fi
  echo "$NAME: skipped: cannot import torch/transformers/peft with $PY"
  exit 77
fi
if [[ "$MODE" == gpu ]] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  if [[ "${STRATA_REQUIRE_GPU:-0}" == "1" ]]; then
    echo "$NAME: FAILED: torch ($PY) sees no CUDA device, and STRATA_REQUIRE_GPU=1 says the GPU tests must run"
    exit 1
  fi
  echo "$NAME: skipped: torch ($PY) sees no CUDA device"
  exit 77
fi
PIP_ARGS=(-q --disable-pip-version-check -C build-dir="$WORK/skbuild" -C cmake.define.STRATA_CUDA=$CUDA)
[[ -n "${STRATA_PACKAGE_BUILD_TYPE:-}" ]] && PIP_ARGS+=(-C "cmake.build-type=$STRATA_PACKAGE_BUILD_TYPE")
[[ -n "${STRATA_PACKAGE_WERROR:-}" ]] && PIP_ARGS+=(-C "cmake.define.STRATA_WERROR=$STRATA_PACKAGE_WERROR")
[[ -n "${STRATA_PACKAGE_CC:-}" ]] && PIP_ARGS+=(-C "cmake.define.CMAKE_C_COMPILER=$STRATA_PACKAGE_CC")
[[ -n "${STRATA_PACKAGE_CXX:-}" ]] && PIP_ARGS+=(-C "cmake.define.CMAKE_CXX_COMPILER=$STRATA_PACKAGE_CXX")
if [[ "$MODE" == gpu ]]; then
  [[ -n "$ARCHS" ]] && PIP_ARGS+=(-C "cmake.define.CMAKE_CUDA_ARCHITECTURES=${ARCHS//,/;}")
  if "$PY" -c 'import scikit_build_core' >/dev/null 2>&1; then PIP_ARGS+=(--no-build-isolation); fi
fi
mkdir -p "$WORK"
rm -rf "$WORK/venv"
"$PY" -m venv --system-site-packages "$WORK/venv"
if command -v ccache >/dev/null 2>&1; then
  export CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache CCACHE_NOHASHDIR=true
fi
echo "$NAME: pip install $SRC (STRATA_CUDA=$CUDA${ARCHS:+, CUDA architectures $ARCHS}, build type" \
  "${STRATA_PACKAGE_BUILD_TYPE:-Release}${STRATA_PACKAGE_WERROR:+, STRATA_WERROR=$STRATA_PACKAGE_WERROR})"
"$WORK/venv/bin/pip" install "${PIP_ARGS[@]}" "$SRC"
cd "$WORK"
unset STRATA_LIBRARY PYTHONPATH
where=$("$WORK/venv/bin/python" -c 'import strata, os; print(os.path.dirname(strata.__file__))')
case "$where" in
  "$WORK/venv/"*) echo "$NAME: testing the installed package in $where ($("$WORK/venv/bin/python" -c 'import strata; print(strata.version())'))" ;;
  *) echo "$NAME: FAILED: strata imports from $where, not from the virtual environment"; exit 1 ;;
esac
if [[ "$MODE" == gpu ]]; then
  mods=$(find "$where" -name 'libstrata_cuda*.so' | sort | tr '\n' ' ')
  [[ -n "$mods" ]] || { echo "$NAME: FAILED: the installed package has no CUDA module (libstrata_cuda.so)"; exit 1; }
  echo "$NAME: CUDA modules: $mods"
fi
export TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1 PYTHONWARNINGS=ignore
"$WORK/venv/bin/python" -m unittest discover -s "$SRC/python/tests" -t "$SRC/python/tests" -p "$PATTERN" -v
