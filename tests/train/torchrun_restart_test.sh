#!/usr/bin/env bash
# `torchrun --max-restarts 1 ... strata finetune ... --resume auto`: one
# command line for every attempt of a job torchrun restarts. Rank 1 is killed
# (SIGKILL) after the first checkpoint on attempt 0; torchrun restarts both
# ranks, which continue from OUT's newest checkpoint, and the job ends with
# exactly the train metrics (step, loss, grad norm, lr) of an uninterrupted
# torchrun job. Before --resume auto no one command line could do it: without
# --resume the restart was refused (OUT holds an earlier run), with --resume
# OUT the first attempt was (no checkpoint yet).
#   torchrun_restart_test.sh STRATA_BINARY PYTHON
# Needs torch (torchrun): skips (77) without it, fails instead under
# STRATA_REQUIRE_REFERENCE=1, as CI runs it.
set -uo pipefail
strata=${1:?usage: torchrun_restart_test.sh STRATA_BINARY PYTHON}
python=${2:-python3}
if ! "$python" -c "import torch.distributed.run" 2>/dev/null; then
  if [[ "${STRATA_REQUIRE_REFERENCE:-0}" == "1" ]]; then
    echo "FAIL (STRATA_REQUIRE_REFERENCE=1): $python cannot import torch.distributed.run (pip install torch)"
    exit 1
  fi
  echo "SKIP: $python cannot import torch.distributed.run (torchrun): pip install torch"
  exit 77
fi
root=${STRATA_TEST_DIR:-/tmp}
dir=$(mktemp -d "$root/strata-torchrun-restart.XXXXXX") || exit 1
trap '[[ -n ${KEEP:-} ]] || rm -rf "$dir"' EXIT
source "$(dirname "${BASH_SOURCE[0]}")/../cli_lib.sh"
cli_small_model_and_data "$strata" "$dir" || { echo "init-model failed"; exit 1; }

base=(--model "$dir/model" --data "$dir/data.txt" --seq 32 --batch 2 --lr 1e-3 --eval-batches 1 --progress lines
  --threads 1 --no-export --comm-timeout 60)
job=("${base[@]}" --steps 24 --save-every 3 --keep 0)
port() { "$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
torchrun=("$python" -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1)
# TMPDIR: torchrun leaves a torchelastic_* log directory there.
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore TMPDIR="$dir"

# Each attempt runs this: rank 1 of attempt 0 is killed once checkpoint-3 is in OUT.
cat >"$dir/rank.sh" <<EOS
#!/usr/bin/env bash
if [[ \$RANK == 1 && \$TORCHELASTIC_RESTART_COUNT == 0 ]]; then
  ( while kill -0 \$\$ 2>/dev/null && [[ ! -e "$dir/restarted/checkpoint-3/index.json" ]]; do sleep 0.05; done
    kill -0 \$\$ 2>/dev/null && echo killed >"$dir/killed" && kill -9 \$\$ ) &
fi
exec "$strata" finetune "\$@"
EOS
chmod +x "$dir/rank.sh"

timeout 600 "${torchrun[@]}" --master-port "$(port)" --no-python "$strata" finetune "${job[@]}" --out "$dir/straight" \
  >"$dir/straight.log" 2>&1 || { echo "FAIL: the uninterrupted job: $(tail -20 "$dir/straight.log")"; exit 1; }
timeout 600 "${torchrun[@]}" --max-restarts 1 --master-port "$(port)" --no-python "$dir/rank.sh" "${job[@]}" \
  --out "$dir/restarted" --resume auto >"$dir/restarted.log" 2>&1 ||
  fail "the restarted job failed: $(grep -v '^step ' "$dir/restarted.log" | tail -20)"
[[ -e $dir/killed ]] || fail "rank 1 was never killed (the job ended before its first checkpoint?)"
grep -q '"event":"checkpoint".*"step":3[,}]' "$dir/restarted/metrics.jsonl" ||
  fail "no checkpoint-3 line in the restarted job's metrics"
train_lines() { grep '"event":"train"' "$1" | sed -E 's/.*"grad_norm":([^,]*).*"loss":([^,]*),.*"lr":([^,]*),.*"step":([0-9]+),.*/\4 \2 \1 \3/' | sort -n -k1,1 | uniq; }
a=$(train_lines "$dir/straight/metrics.jsonl")
b=$(train_lines "$dir/restarted/metrics.jsonl")
[[ $(wc -l <<<"$a") -eq 24 ]] || fail "the uninterrupted job logged $(wc -l <<<"$a") train lines, not 24"
[[ $a == "$b" ]] || fail "the restarted job's metrics differ: $(diff <(echo "$a") <(echo "$b") | head -6)"
((failures)) || echo "torchrun --max-restarts 1 with --resume auto: rank 1 killed after checkpoint-3, the restart" \
  "continued from it and ended with the uninterrupted job's 24 train lines"

# Two torchrun agents as two nodes (c10d rendezvous, one rank each); node 1's worker fails
# on attempt 0. Node 1's agent counts a restart, node 0's restarts for the membership
# change without counting one: TORCHELASTIC_RESTART_COUNT differs between the ranks, so
# it cannot name the attempt in the rendezvous key (a job whose ranks waited under
# different keys until the timeout, blaming each other). With
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 each round meets on a new MASTER_PORT: the restart
# succeeds. With torchrun's shared agent store, round 1's keys are still there: round 2
# is refused at once, naming the setting.
cat >"$dir/node.sh" <<EOS
#!/usr/bin/env bash
[[ \$GROUP_RANK == 1 && \$TORCHELASTIC_RESTART_COUNT == 0 ]] && exit 3
exec "$strata" finetune "\$@"
EOS
chmod +x "$dir/node.sh"
two_nodes() {  # OUT, then env settings; both agents' output in OUT.node{0,1}.log
  local out=$1 rdzv n pids=()
  shift
  rdzv=$(port)
  for n in 0 1; do
    env "$@" timeout 300 "$python" -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --max-restarts 1 \
      --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$rdzv" --rdzv-id "strata$$" --monitor-interval 0.5 \
      --no-python "$dir/node.sh" "${base[@]}" --steps 3 --out "$out" >"$out.node$n.log" 2>&1 &
    pids+=($!)
  done
  local rc=0
  for n in "${pids[@]}"; do wait "$n" || rc=1; done
  return $rc
}
two_nodes "$dir/nodes-own" TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 ||
  fail "two nodes, a restart with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: $(grep -h 'strata\|rror' "$dir"/nodes-own.node*.log | head -8)"
# (Which agent becomes node 0 is torchrun's choice: either log.)
cat "$dir"/nodes-own.node*.log | grep -q "^done: 3 steps" ||
  fail "two nodes: rank 0 did not finish: $(grep -h 'strata' "$dir"/nodes-own.node*.log | head -6)"
if two_nodes "$dir/nodes-shared" TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0; then
  fail "two nodes on torchrun's shared store: the restarted round met (it cannot tell the attempts apart)"
fi
cat "$dir"/nodes-shared.node*.log |
  grep -q "an earlier attempt of this torchrun job left its rendezvous in the agent's store.*TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" ||
  fail "two nodes on torchrun's shared store: rank 0 does not name the cause: $(grep -h 'strata' "$dir"/nodes-shared.node*.log | head -6)"
((failures)) || echo "two torchrun nodes, node 1 failing once: the restart meets with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1," \
  "and is refused at once naming it on torchrun's shared store"
cli_finish "torchrun restart"
