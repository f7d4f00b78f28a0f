#!/usr/bin/env bash
# Builds Strata's libFuzzer targets (clang, ASan+UBSan) and runs each one.
#   scripts/fuzz.sh                         # every target, FUZZ_SECONDS (15) each
#   FUZZ_SECONDS=3600 scripts/fuzz.sh ds_config   # a long campaign of one target
#   FUZZ_TIMEOUT=60 ...                            # per-input limit (default 10 s)
# Each run starts from the seeds in tests/fuzz/corpus/<name> plus what earlier runs
# found (kept in $BUILD_DIR/corpus/<name>; the seed folder is never written).
# Crashing inputs land in $BUILD_DIR/crashes/<name>/: once fixed, copy the input
# into tests/fuzz/corpus/<name>/ so every ctest run replays it.
# Prints one line per target (runs, coverage, corpus, crashes) and exits 1 if any
# target crashed, leaked, timed out or ran out of memory.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build-fuzz}"
SECS="${FUZZ_SECONDS:-15}"
# Seconds one input may take. Long campaigns that share the cores with other
# work (nice -n 19) need more: a starved run is not a hang (replay it to tell).
TIMEOUT="${FUZZ_TIMEOUT:-10}"
TARGETS=("$@")
if ((${#TARGETS[@]} == 0)); then
  TARGETS=()
  for f in "$ROOT"/tests/fuzz/fuzz_*.cpp; do n=$(basename "$f" .cpp); TARGETS+=("${n#fuzz_}"); done
fi
bash "$ROOT/scripts/setup.sh" >/dev/null
if [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]]; then
  CC=clang CXX=clang++ cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DSTRATA_FUZZ=ON -DSTRATA_SANITIZE=ON -DSTRATA_CUDA=OFF -DSTRATA_BUILD_BENCHMARKS=OFF \
    -DSTRATA_NEON_CHECK=OFF >/dev/null
fi
cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" --target "${TARGETS[@]/#/fuzz_}"

failed=0
for t in "${TARGETS[@]}"; do
  corpus="$BUILD_DIR/corpus/$t" crashes="$BUILD_DIR/crashes/$t"
  mkdir -p "$corpus" "$crashes"
  log="$BUILD_DIR/fuzz_$t.log"
  # -rss_limit_mb/-malloc_limit_mb: a small input that makes Strata allocate
  # without bound is a finding, as is one that runs for more than -timeout s.
  if ASAN_OPTIONS=detect_leaks=1 "$BUILD_DIR/tests/fuzz/fuzz_$t" "$corpus" "$ROOT/tests/fuzz/corpus/$t" \
      -max_total_time="$SECS" -rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout="$TIMEOUT" -max_len=65536 \
      -artifact_prefix="$crashes/" -print_final_stats=1 >"$log" 2>&1; then
    status=ok
  else
    status=FAILED failed=1
  fi
  runs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -Eo '[0-9]+$' || echo 0)
  cov=$(grep -Eo 'cov: [0-9]+' "$log" | tail -n 1 | grep -Eo '[0-9]+' || echo 0)
  found=$(find "$crashes" -type f | wc -l)
  printf 'fuzz %-12s %s: %s runs in %s s, coverage %s edges, corpus %s inputs, %s crashing inputs in %s\n' \
    "$t" "$status" "$runs" "$SECS" "$cov" "$(find "$corpus" -type f | wc -l)" "$found" "$crashes"
  if [[ $status != ok ]]; then grep -E 'ERROR|SUMMARY|==[0-9]+==|Test unit written' "$log" | head -n 20 || true; fi
done
exit $failed
