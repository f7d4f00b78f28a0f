#!/usr/bin/env bash
# Interleaved A/B of two strata binaries on the CPU and disk benchmarks, for a
# change that must not change speed: ROUNDS rounds, each running A then B.
#   scripts/bench_ab.sh BIN_A BIN_B SCRATCH_DIR [OUT_DIR]
# Writes one JSON file per run into OUT_DIR (default ./bench-ab) and prints the
# medians of the figures BENCHMARKS.md quotes.
set -euo pipefail
a=${1:?usage: bench_ab.sh BIN_A BIN_B SCRATCH_DIR [OUT_DIR]} b=${2:?} scratch=${3:?} out=${4:-bench-ab}
rounds=${ROUNDS:-3}
mkdir -p "$out" "$scratch"
for ((r = 1; r <= rounds; r++)); do
  for v in a b; do
    bin=$a
    [[ $v == b ]] && bin=$b
    "$bin" bench adam --params 64M --threads 2 --iters 5 --json >"$out/adam.$v.$r.json"
    "$bin" bench io --dir "$scratch" --size 1GiB --json >"$out/io.$v.$r.json"
    "$bin" bench step --params 256M --dir "$scratch" --reps 1 --json >"$out/step.$v.$r.json"
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics as st, sys
d, n = sys.argv[1], int(sys.argv[2])
load = lambda b, v, r: json.load(open(f"{d}/{b}.{v}.{r}.json"))
for v in ("a", "b"):
    adam = [load("adam", v, r) for r in range(1, n + 1)]
    io = [load("io", v, r) for r in range(1, n + 1)]
    step = [load("step", v, r) for r in range(1, n + 1)]
    g = lambda x, op: [q["gbps"] for q in x["results"] if q["backend"] == "uring" and q["op"] == op][0]
    print(f"{v}: adam ratio {st.median(a['ratio'] for a in adam):.3f} | uring write "
          f"{st.median(g(x, 'write') for x in io):.2f} read {st.median(g(x, 'read') for x in io):.2f} GB/s | "
          f"step wall {st.median(s['wall_s'] for s in step):.2f} s, efficiency "
          f"{st.median(s['efficiency'] for s in step):.3f}")
PY
