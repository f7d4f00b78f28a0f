#!/usr/bin/env bash
# Crash campaign (RELIABILITY.md): kills `strata finetune` with SIGKILL at
# random moments (during steps, checkpoint saves and the export) N times,
# resuming after each kill, then lets it finish, and checks that
#   - the per-step metrics (step, loss, grad norm, lr) equal those of a run
#     that was never interrupted, every step exactly once;
#   - the exported model is bit-identical to the uninterrupted run's;
#   - nothing is left behind: no checkpoint staging or replaced directories,
#     no export temp files, no swap directories of dead processes.
#
#   scripts/crash_campaign.sh [--kills N] [--strata BIN] [--dir DIR] [--seed S]
#
# Prints one line per kill (when, in which phase) and a summary line
# "crash campaign: N kills (S in saves, E in exports), ... passed|FAILED";
# exits 0 when every check passed.
set -uo pipefail
kills=10 strata="" root=${TMPDIR:-/tmp} seed=$RANDOM
while (($#)); do
  case $1 in
    --kills) kills=$2; shift 2 ;;
    --strata) strata=$2; shift 2 ;;
    --dir) root=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    *) echo "usage: $0 [--kills N] [--strata BIN] [--dir DIR] [--seed S]"; exit 2 ;;
  esac
done
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
strata=${strata:-$here/build/tools/strata}
[[ -x $strata ]] || { echo "crash campaign: no strata binary at $strata (build first, or --strata BIN)"; exit 2; }
dir=$(mktemp -d "$root/strata-crash.XXXXXX") || exit 2
pid=""
cleanup() {
  [[ -n $pid ]] && kill -9 "$pid" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
RANDOM=$seed
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

"$strata" init-model --layers 3 --dim 64 --heads 4 --kv-heads 2 --ffn-dim 160 --vocab 256 --dtype fp32 --seed 11 \
  --out "$dir/model" >/dev/null || { echo "init-model failed"; exit 2; }
for ((i = 0; i < 1500; i++)); do
  echo "crash campaign line $i: the $((i % 7)) owls and $((i * 3 % 11)) foxes meet at dawn."
done >"$dir/data.txt"
mkdir -p "$dir/nvme-straight" "$dir/nvme"
# job OUT NVME [extra flags]: runs strata itself (exec), so that a background
# job's $! is strata's pid and kill -9 reaches it, not a wrapping subshell.
job() {
  local out=$1 nvme=$2
  shift 2
  exec "$strata" finetune --model "$dir/model" --data "$dir/data.txt" --seq 64 --batch 4 --grad-accum 2 --steps 24 \
    --save-every 2 --keep 2 --eval-every 8 --eval-batches 2 --lr 2e-3 --warmup 2 --progress lines --log-every 1 \
    --offload-params nvme:"$nvme" --offload-optimizer nvme:"$nvme" --out "$out" "$@"
}
train_lines() {
  grep '"event":"train"' "$1" |
    sed -E 's/.*"grad_norm":([^,]*).*"loss":([^,]*),.*"lr":([^,]*),.*"step":([0-9]+),.*/\4 \2 \1 \3/'
}

# The reference: one uninterrupted run, timed.
t0=$(date +%s%N)
(job "$dir/straight" "$dir/nvme-straight") >"$dir/straight.log" 2>&1 || { echo "the uninterrupted run failed:"; cat "$dir/straight.log"; exit 2; }
run_ms=$((($(date +%s%N) - t0) / 1000000))
echo "crash campaign: seed $seed, $kills kills; an uninterrupted run takes ${run_ms} ms"

in_save=0 in_export=0 killed=0 attempts=0
while ((killed < kills && attempts < 20 * kills)); do
  attempts=$((attempts + 1))
  if compgen -G "$dir/out/checkpoint-*/index.json" >/dev/null; then
    (job "$dir/out" "$dir/nvme" --resume "$dir/out") >"$dir/job.log" 2>&1 &
  else
    (job "$dir/out" "$dir/nvme" --overwrite) >"$dir/job.log" 2>&1 &
  fi
  pid=$!
  # A random moment within a run's length (setup, steps, saves, export).
  delay_ms=$((RANDOM % (run_ms + 1)))
  sleep "$(printf '%d.%03d' $((delay_ms / 1000)) $((delay_ms % 1000)))"
  phase=step
  compgen -G "$dir/out/checkpoint-*.tmp-*" >/dev/null && phase=save
  compgen -G "$dir/out/model/*.tmp.*" >/dev/null && phase=export
  if kill -9 "$pid" 2>/dev/null; then
    wait "$pid" 2>/dev/null
    killed=$((killed + 1))
    [[ $phase == save ]] && in_save=$((in_save + 1))
    [[ $phase == export ]] && in_export=$((in_export + 1))
    last=$(grep -oE 'step +[0-9]+' "$dir/job.log" | tail -n 1 | grep -oE '[0-9]+')
    echo "kill $killed after ${delay_ms} ms: during $phase (last step logged: ${last:-none})"
  else
    wait "$pid"
    rc=$?
    pid=""
    if ((rc != 0)); then fail "a run ended with exit $rc before its kill: $(tail -n 3 "$dir/job.log")"; break; fi
    # It finished before the kill: start over so later kills still land.
    rm -rf "$dir/out"
  fi
  pid=""
done

# Let the last one finish.
if compgen -G "$dir/out/checkpoint-*/index.json" >/dev/null; then
  (job "$dir/out" "$dir/nvme" --resume "$dir/out") >"$dir/job.log" 2>&1 || fail "the final resume failed: $(tail -n 5 "$dir/job.log")"
else
  (job "$dir/out" "$dir/nvme" --overwrite) >"$dir/job.log" 2>&1 || fail "the final run failed: $(tail -n 5 "$dir/job.log")"
fi

a=$(train_lines "$dir/straight/metrics.jsonl")
b=$(train_lines "$dir/out/metrics.jsonl")
[[ $(wc -l <<<"$a") -eq 24 ]] || fail "the uninterrupted run logged $(wc -l <<<"$a") steps, not 24"
[[ $a == "$b" ]] || fail "metrics differ from the uninterrupted run: $(diff <(echo "$a") <(echo "$b") | head -n 6)"
cmp -s "$dir/straight/model/model.safetensors" "$dir/out/model/model.safetensors" ||
  fail "the exported model differs from the uninterrupted run's"
left=$(find "$dir/out" \( -name '*.tmp-*' -o -name '*.old-*' -o -name '*.tmp.*' \) -print | head -n 5)
[[ -z $left ]] || fail "leftovers in the out dir: $left"
swap=$(find "$dir/nvme" -mindepth 1 -maxdepth 1 -name 'strata-run-*' -print | head -n 5)
[[ -z $swap ]] || fail "swap directories left in the NVMe dir: $swap"

status=passed
((failures)) && status=FAILED
echo "crash campaign: $killed kills ($in_save in saves, $in_export in exports), seed $seed: $status"
((failures == 0))
