#!/usr/bin/env bash
# The Python package as a user gets it: `pip install` of this clone into a
# fresh virtual environment, then python/tests run against the installed
# package from outside the source tree (never the build tree).
#
#   run_package_tests.sh SOURCE_DIR WORK_DIR
#
# The environment sees the system's site-packages (--system-site-packages),
# so torch, transformers and peft are not downloaded again. The CMake build
# goes to WORK_DIR/skbuild and is reused by later runs. The package is built
# without its CUDA modules here (STRATA_CUDA=OFF: the tests run the CPU
# path; the other builds compile the CUDA code). Exit 77 (skip) without
# torch/transformers/peft, unless STRATA_REQUIRE_REFERENCE=1 (CI).
set -euo pipefail
SRC=$(cd "$1" && pwd)
WORK=$2
PY=${STRATA_TEST_PYTHON:-python3}
if ! "$PY" -c 'import torch, transformers, peft' >/dev/null 2>&1; then
  if [[ "${STRATA_REQUIRE_REFERENCE:-0}" == "1" ]]; then
    echo "python_package: FAILED: cannot import torch/transformers/peft with $PY (STRATA_REQUIRE_REFERENCE=1)"
    exit 1
  fi
  echo "python_package: skipped: cannot import torch/transformers/peft with $PY"
  exit 77
fi
mkdir -p "$WORK"
rm -rf "$WORK/venv"
"$PY" -m venv --system-site-packages "$WORK/venv"
if command -v ccache >/dev/null 2>&1; then export CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache; fi
echo "python_package: pip install $SRC"
"$WORK/venv/bin/pip" install -q --disable-pip-version-check \
  -C build-dir="$WORK/skbuild" -C cmake.define.STRATA_CUDA=OFF "$SRC"
cd "$WORK"
unset STRATA_LIBRARY PYTHONPATH
where=$("$WORK/venv/bin/python" -c 'import strata, os; print(os.path.dirname(strata.__file__))')
case "$where" in
  "$WORK/venv/"*) echo "python_package: testing the installed package in $where ($("$WORK/venv/bin/python" -c 'import strata; print(strata.version())'))" ;;
  *) echo "python_package: FAILED: strata imports from $where, not from the virtual environment"; exit 1 ;;
esac
export TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1 PYTHONWARNINGS=ignore
"$WORK/venv/bin/python" -m unittest discover -s "$SRC/python/tests" -t "$SRC/python/tests" -v
