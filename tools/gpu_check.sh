#!/usr/bin/env bash
# The one-call GPU check (see shared/guide/device.md). Runs on the lent GPU
# machine from the repository root, with .deps (Debian .deb files fetched by
# `tools/gpu_check.sh --fetch-deps` on a dev machine) carried along.
#   1. unpack the .debs into /tmp/deps, configure with CUDA ON for sm_90, build;
#   2. run the gpu-labelled tests (device backend, CUDA model ops against the
#      CPU ops: test_train_cuda_ops), then strata.torch on the GPU
#      (python/tests/test_torch_gpu.py against this build's library with
#      STRATA_REQUIRE_GPU=1, and bench_torch.py --device cuda), then
#      `strata demo`, then the CPU tests (not the `package` ones: pip needs a
#      registry to build the CPU package, and the GPU machine has none);
#   3. run the GPU benchmarks with --json;
#   4. while the check is under GPU_CHECK_DEADLINE_S seconds (default 450)
#      less 3 minutes, ctest python_package_gpu: the PyTorch package as users
#      get it (pip install with the CUDA modules: a second build of the
#      library, minutes), then test_torch_gpu.py again, with a timeout that
#      ends it by the deadline;
#   5. end with one line, "GPU CHECK SUMMARY: ..." (tests run / passed per
#      step, the demo's and the copy bench's figures), also appended to
#      bench.err, and leave logs and JSON under $OUT (at most 8 files come back; 8 today:
#      build.log version.txt ctest-gpu.log torch-gpu.log demo.log
#      ctest-cpu.log bench.json bench.err).
# The full build includes the CUDA modules (libstrata_cuda.so,
# libstrata_cuda_train.so and, with NCCL, libstrata_nccl.so, next to
# build-gpu/tools/strata) for sm_90; the gpu tests include test_comm_nccl
# (every collective through NCCL with one rank).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ "${1:-}" == "--fetch-deps" ]]; then
  grep -qx '/.deps/' "$ROOT/.git/info/exclude" 2>/dev/null || echo /.deps/ >> "$ROOT/.git/info/exclude"
  mkdir -p "$ROOT/.deps" && cd "$ROOT/.deps" && apt-get download liburing2 liburing-dev libaio1 libaio-dev \
    libtbb12 libtbbmalloc2 libtbbbind-2-5 libtbb-dev libeigen3-dev libgtest-dev libgmock-dev libbenchmark-dev \
    libbenchmark1debian nlohmann-json3-dev libcli11-dev libfmt9 libfmt-dev
  exit $?
fi

OUT="${OUT:-$ROOT/gpu-check-out}"
mkdir -p "$OUT"
cd "$ROOT"
{
  echo "== $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  for f in .deps/*.deb; do dpkg -x "$f" /tmp/deps; done
  export CMAKE_PREFIX_PATH=/tmp/deps/usr LD_LIBRARY_PATH=/tmp/deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
  export PKG_CONFIG_PATH=/tmp/deps/usr/lib/x86_64-linux-gnu/pkgconfig:/tmp/deps/usr/share/pkgconfig
  # NCCL: the machine has it as the nvidia-nccl wheel (no unversioned .so, not
  # where CMake looks): point CMake at it, and the loader at its lib/.
  nccl_args=()
  nccl_dir=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null)
  if [[ -n "$nccl_dir" && -f "$nccl_dir/include/nccl.h" ]]; then
    nccl_lib=$(ls "$nccl_dir"/lib/libnccl.so* 2>/dev/null | head -1)
    nccl_args=(-DNCCL_INCLUDE_DIR="$nccl_dir/include" -DNCCL_LIBRARY="$nccl_lib")
    echo "NCCL from the wheel: $nccl_dir ($nccl_lib)"
    export LD_LIBRARY_PATH="$nccl_dir/lib:$LD_LIBRARY_PATH"
  fi
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DSTRATA_BUILD_BENCHMARKS=OFF "${nccl_args[@]}" && cmake --build build-gpu -j "$(nproc)"
} > "$OUT/build.log" 2>&1
echo "build rc=$?" | tee -a "$OUT/build.log"
tail -5 "$OUT/build.log"

build-gpu/tools/strata --version > "$OUT/version.txt" 2>&1
cat "$OUT/version.txt"
ls -l build-gpu/tools/libstrata_cuda*.so >> "$OUT/version.txt" 2>&1
# STRATA_REQUIRE_GPU=1: a gpu test that would skip fails (with the loader's
# dlerror text when a module exists but does not load).
(cd build-gpu && STRATA_REQUIRE_GPU=1 ctest -L gpu -LE package --output-on-failure) > "$OUT/ctest-gpu.log" 2>&1
tail -15 "$OUT/ctest-gpu.log"
# strata.torch on the GPU against this build's library (no install: seconds).
# STRATA_REQUIRE_GPU=1: a test that would skip fails.
{
  echo "== test_torch_gpu.py against build-gpu/src/libstrata.so ($(python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1))"
  STRATA_REQUIRE_GPU=1 STRATA_LIBRARY="$ROOT/build-gpu/src/libstrata.so" \
    STRATA_CUDA_MODULE="$ROOT/build-gpu/tools/libstrata_cuda.so" PYTHONPATH="$ROOT/python" \
    TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1 PYTHONWARNINGS=ignore \
    timeout 240 python3 -m unittest discover -s python/tests -t python/tests -p test_torch_gpu.py -v
  echo "test_torch_gpu rc=$?"
  echo "== bench_torch.py --device cuda --json"
  STRATA_LIBRARY="$ROOT/build-gpu/src/libstrata.so" STRATA_CUDA_MODULE="$ROOT/build-gpu/tools/libstrata_cuda.so" \
    PYTHONPATH="$ROOT/python" PYTHONWARNINGS=ignore \
    timeout 120 python3 python/benchmarks/bench_torch.py --dir /tmp --device cuda --json
  echo "bench_torch rc=$?"
} > "$OUT/torch-gpu.log" 2>&1
grep -E "^(Ran|OK|FAILED|FAIL:|ERROR:)|rc=|tokens_per_s|\"ratio\"" "$OUT/torch-gpu.log"
# The fine-tune demo, end to end (JSON when the command offers it).
{
  if build-gpu/tools/strata demo --help > /tmp/demo-help.txt 2>&1; then
    # --device cuda: the GPU or exit 1 with the reason (never the CPU).
    if grep -q -- '--json' /tmp/demo-help.txt; then
      STRATA_REQUIRE_GPU=1 timeout 300 build-gpu/tools/strata demo --device cuda --json
    else
      STRATA_REQUIRE_GPU=1 timeout 300 build-gpu/tools/strata demo --device cuda
    fi
    echo "demo rc=$?"
  else
    echo "strata demo is not available in this build:"; cat /tmp/demo-help.txt
  fi
} > "$OUT/demo.log" 2>&1
tail -8 "$OUT/demo.log"
(cd build-gpu && ctest -LE 'gpu|package' -j 8 --output-on-failure) > "$OUT/ctest-cpu.log" 2>&1
tail -5 "$OUT/ctest-cpu.log"
{
  build-gpu/tools/strata bench copy --mib 1024 --iters 10 --json
} > "$OUT/bench.json" 2> "$OUT/bench.err"
cat "$OUT/bench.json" "$OUT/bench.err"
# The PyTorch package as users get it, if the check has time left for a
# second build of the library (pip, STRATA_CUDA=ON for sm_90): ctest
# python_package_gpu (run_package_tests.sh gpu), appended to torch-gpu.log.
DEADLINE=${GPU_CHECK_DEADLINE_S:-450}
LEFT=$((DEADLINE - SECONDS))
{
  if (( LEFT >= 180 )); then
    echo "== ctest python_package_gpu (${SECONDS}s into the check, ${LEFT}s left)"
    (cd build-gpu && STRATA_REQUIRE_GPU=1 timeout "$LEFT" ctest -R '^python_package_gpu$' --output-on-failure)
    echo "python_package_gpu rc=$?"
  else
    echo "== ctest python_package_gpu not run: ${SECONDS}s into the check, ${LEFT}s before the ${DEADLINE}s deadline (needs 180)"
  fi
} >> "$OUT/torch-gpu.log" 2>&1
tail -4 "$OUT/torch-gpu.log"

# One line: what ran, what passed, what failed, the figures.
ctest_counts() {  # "P/N" from a ctest log's summary line, or "none"
  local line
  line=$(grep -E "tests passed, [0-9]+ tests failed out of [0-9]+" "$1" | tail -1)
  [[ -z "$line" ]] && { echo "none"; return; }
  echo "$line" | sed -E 's/.* ([0-9]+) tests failed out of ([0-9]+).*/\2 \1/' | awk '{print ($1-$2) "/" $1}'
}
torch_line=$(grep -E "^(OK|FAILED)" "$OUT/torch-gpu.log" | head -1)
torch_ran=$(grep -E "^Ran [0-9]+ tests" "$OUT/torch-gpu.log" | head -1)
demo_line=$(grep -E "tokens/s" "$OUT/demo.log" | tail -1)
copy_fig=$(grep -oE '"h2d_gbps": *[0-9.]+|"d2h_gbps": *[0-9.]+' "$OUT/bench.json" | tr '\n' ' ')
echo "GPU CHECK SUMMARY: gpu ctest $(ctest_counts "$OUT/ctest-gpu.log") passed; torch-gpu ${torch_ran:-not run} ${torch_line:-}; cpu ctest $(ctest_counts "$OUT/ctest-cpu.log") passed; demo: ${demo_line:-no result}; copy: ${copy_fig:-no result}" | tee -a "$OUT/bench.err"
