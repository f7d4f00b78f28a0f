#!/usr/bin/env bash
# ZeRO stage 3 across hosts whose link is the bottleneck: `strata finetune`
# with 2 ranks on 2 hosts made of network namespaces (tests/netns_lib.sh),
# each host's link limited to RATE both ways (tc tbf), Open MPI over TCP;
# the same runs with a baseline binary, interleaved, REPS times each.
#   scripts/bench_ranks_netns.sh --strata build/tools/strata --baseline OTHER/strata \
#       [--rate 1gbit] [--steps 12] [--reps 3] [--stage 3]
# Root only. Prints per binary the median step time (steps 3.., all reps),
# the bytes each rank sent per step, the acquires whose gather ran ahead per
# step and the final loss (which must be equal), then new / baseline.
# The model and data are tools/bench_model.py's (3.08M parameters, bf16
# compute, global batch 6 x 128 tokens).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
strata= baseline= rate=1gbit steps=12 reps=3 stage=3
while (($#)); do
  case $1 in
    --strata) strata=$(realpath "$2"); shift 2 ;;
    --baseline) baseline=$(realpath "$2"); shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --stage) stage=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -n $strata && -n $baseline ]] || { echo "usage: $0 --strata BIN --baseline BIN [--rate R] [--steps N] [--reps N]" >&2; exit 2; }
source "$here/../tests/netns_lib.sh"
dir=$(mktemp -d "${TMPDIR:-/tmp}/strata-bench-netns.XXXXXX")
trap 'netns_cleanup; rm -rf "$dir"' EXIT
trap 'exit 1' TERM INT HUP
netns_hosts 2 "$rate" || { echo "bench_ranks_netns: $netns_error" >&2; exit 1; }
PYTHONPATH="$here/../tools" python3 -c \
  "import sys; from bench_model import small_model_and_data; small_model_and_data(sys.argv[1], sys.argv[2])" \
  "$strata" "$dir"
echo "{\"zero_optimization\": {\"stage\": $stage}}" >"$dir/stage.json"

run() {  # BINARY OUT
  rm -rf "$2"
  timeout 900 "${netns_mpirun[@]}" --host "${netns_addr[0]},${netns_addr[1]}" -np 2 "$1" finetune \
    --model "$dir/model" --data "$dir/data.txt" --seq 128 --batch 3 --steps "$steps" --eval-batches 1 --no-export \
    --progress quiet --device cpu --bf16 --config "$dir/stage.json" --out "$2" >"$2.log" 2>&1 ||
    { echo "run of $1 failed:"; tail -20 "$2.log"; exit 1; }
}
for ((r = 0; r < reps; ++r)); do
  run "$strata" "$dir/new$r"
  run "$baseline" "$dir/base$r"
done
python3 - "$dir" "$reps" "$rate" "$stage" <<'EOF'
import json, statistics, sys
d, reps, rate, stage = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
def read(tag):
    steps, comm, ahead, losses = [], [], [], []
    for r in range(reps):
        lines = [json.loads(l) for l in open(f"{d}/{tag}{r}/metrics.jsonl") if '"train"' in l]
        steps += [l["step_s"] for l in lines[2:]]
        comm += [b["comm_bytes"] - a["comm_bytes"] for a, b in zip(lines, lines[1:])]
        ahead += [b.get("gathers_ahead", 0) - a.get("gathers_ahead", 0) for a, b in zip(lines, lines[1:])]
        losses.append(lines[-1]["loss"])
    return statistics.median(steps), statistics.median(comm), statistics.median(ahead), losses
new, base = read("new"), read("base")
print(f"2 ranks on 2 hosts (network namespaces), links limited to {rate} each way, ZeRO stage {stage}, "
      f"{reps} interleaved runs per binary")
print(f"{'binary':>9} {'step s':>8} {'sent/rank/step':>15} {'gathers ahead/step':>19}  final loss")
for name, (s, c, a, l) in (("new", new), ("baseline", base)):
    print(f"{name:>9} {s:>8.4f} {c:>15.0f} {a:>19.0f}  {l[0]}")
print(f"new / baseline step time: {new[0] / base[0]:.3f}")
if new[3] != base[3] or len(set(new[3])) != 1:
    sys.exit(f"final losses differ: new {new[3]}, baseline {base[3]}")
EOF
