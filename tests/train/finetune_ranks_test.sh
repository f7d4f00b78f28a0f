#!/usr/bin/env bash
# N ranks of `strata finetune` as a user meets them (trainer.h, "Ranks"),
# launched by mpirun (the MPI communicator) or torchrun-style (the TCP one;
# launch_ranks sets torchrun's variables):
#   - 2 and 3 ranks with batch b export exactly (cmp) the model of a 1-rank
#     run with batch b and N x the accumulation, with the same losses per
#     step, on host RAM and with parameters and optimizer on NVMe;
#   - a checkpoint reshards 2 -> 3 -> 1 ranks on one global batch;
#   - SIGTERM to one rank stops every rank after the same step with a
#     checkpoint (exit 130); --resume finishes the job with the same model as
#     a run never stopped;
#   - SIGTERM to a rank still waiting for the others (tcp) ends it at once
#     (exit 130), not at the rendezvous timeout;
#   - a rank that stops answering (SIGSTOP) makes the other fail within
#     --comm-timeout naming it; a rank killed with SIGKILL ends the job
#     (mpirun ends the others; over TCP the others see its connections close
#     and fail at once, naming it);
#   - ZeRO stages 2 and 1 (parameters whole on every rank; stage 1 reduces
#     each rank's summed gradient once per step) give the same model;
#   - the validation loss of N ranks of batch b is 1 rank's of batch N x b;
#     LoRA dropout masks follow the sequences (N ranks = 1 rank again);
#   - what N ranks cannot do is refused by name (GPU ranks where no GPU or
#     no NCCL, parameters on NVMe with stage 2, ranks with different
#     settings, flags or weights: the first difference named); a rank
#     that fails before the ranks meet is named by the other at once, and
#     a second job given a running job's MASTER_PORT fails at once (TCP).
#   finetune_ranks_test.sh mpi MPIRUN STRATA_BINARY
#   finetune_ranks_test.sh tcp LAUNCH_RANKS STRATA_BINARY
# Exit 0 pass, 1 fail.
set -uo pipefail
usage="usage: finetune_ranks_test.sh mpi|tcp LAUNCHER STRATA_BINARY"
kind=${1:?$usage}
launcher_bin=${2:?$usage}
strata=${3:?$usage}
root=${STRATA_TEST_DIR:-/tmp}
dir=$(mktemp -d "$root/strata-finetune-$kind.XXXXXX") || exit 1
cleanup() {
  pkill -9 -f -- "--out $dir/" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
source "$(dirname "${BASH_SOURCE[0]}")/../cli_lib.sh"
# "${launch[@]}" N PROGRAM ARGS...: N ranks; a rank that fails makes the
# launcher stop the others (mpirun; launch_ranks as torchrun does).
# "${launch_alone[@]}": the ranks left alone (launch_ranks --keep-going), to
# test how the others end by themselves.
case $kind in
  mpi)
    export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1
    launch=("$launcher_bin" --oversubscribe --allow-run-as-root -np)
    launch_alone=("${launch[@]}") ;;
  tcp)
    launch=("$launcher_bin")
    launch_alone=("$launcher_bin" --keep-going) ;;
  *) echo "$usage"; exit 1 ;;
esac

cli_small_model_and_data "$strata" "$dir" || { echo "init-model failed"; exit 1; }
common=(--model "$dir/model" --data "$dir/data.txt" --seq 64 --lr 3e-3 --progress lines --eval-batches 2
  --threads 1)

# Waits (up to 60 s) until OUT's metrics show step N; prints nothing.
wait_step() {
  for ((i = 0; i < 600; i++)); do
    grep -q "\"step\":$2" "$1/metrics.jsonl" 2>/dev/null && return 0
    sleep 0.1
  done
}
# The pid of one rank (not the launcher) of the job writing to OUT.
rank_pid() {
  pgrep -f -- "--out $1" | while read -r p; do
    [[ $(tr '\0' ' ' </proc/"$p"/cmdline 2>/dev/null) == "$strata finetune"* ]] && echo "$p"
  done | tail -1
}
# Losses and lrs per step from a metrics file, one line each.
losses() { grep '"event":"train"' "$1" | grep -o '"\(loss\|lr\|step\)":[^,}]*' | tr '\n' ' '; }
same_run() {  # what, 1-rank out, N-rank out
  cmp -s "$2/model/model.safetensors" "$3/model/model.safetensors" || fail "$1: the exported models differ"
  [[ "$(losses "$2/metrics.jsonl")" == "$(losses "$3/metrics.jsonl")" ]] ||
    fail "$1: losses differ: $(losses "$2/metrics.jsonl") vs $(losses "$3/metrics.jsonl")"
  [[ $(grep -c '"event":"train"' "$3/metrics.jsonl") -ge 4 ]] || fail "$1: no metrics from rank 0"
}

# ---- N ranks equal one rank with N x the accumulation
"$strata" finetune "${common[@]}" --steps 5 --batch 2 --grad-accum 2 --out "$dir/one2" >"$dir/one2.log" 2>&1 ||
  { cat "$dir/one2.log"; fail "1-rank run (accumulation 2)"; }
timeout 300 "${launch[@]}" 2 "$strata" finetune "${common[@]}" --steps 5 --batch 2 --out "$dir/two" \
  >"$dir/two.log" 2>&1 || { cat "$dir/two.log"; fail "2 ranks ($kind): finetune"; }
same_run "2 ranks, RAM" "$dir/one2" "$dir/two"
grep -q "x 2 ranks" "$dir/two.log" || fail "2 ranks: the header does not say so: $(head -3 "$dir/two.log")"
[[ $(grep -c '^done:' "$dir/two.log") -eq 1 ]] || fail "2 ranks: more than rank 0 printed the summary"
# The validation loss of 2 ranks of batch 2 is that of 1 rank of batch 4 (global batches
# of 4 windows, each rank evaluating its 2)
"$strata" finetune "${common[@]}" --steps 0 --batch 4 --no-export --out "$dir/one4" >"$dir/one4.log" 2>&1 ||
  { cat "$dir/one4.log"; fail "1-rank evaluation (batch 4)"; }
python3 - "$dir/one4/metrics.jsonl" "$dir/two/metrics.jsonl" <<'PY' || fail "2 ranks: the validation loss is not 1 rank's of the global batch"
import json, sys
a, b = ([json.loads(l)["val_loss"] for l in open(f) if '"eval"' in l] for f in sys.argv[1:3])
assert abs(a[0] - b[0]) <= 1e-6 * a[0], (a, b)
PY

# LoRA dropout: the masks follow the sequences, so 2 ranks still equal 1 rank with accumulation 2
lora=(--lora-rank 4 --lora-dropout 0.3)
"$strata" finetune "${common[@]}" "${lora[@]}" --steps 4 --batch 2 --grad-accum 2 --lora-merge --out "$dir/onel" \
  >"$dir/onel.log" 2>&1 || { cat "$dir/onel.log"; fail "1-rank LoRA run with dropout"; }
timeout 300 "${launch[@]}" 2 "$strata" finetune "${common[@]}" "${lora[@]}" --steps 4 --batch 2 --lora-merge \
  --out "$dir/twol" >"$dir/twol.log" 2>&1 || { cat "$dir/twol.log"; fail "2 ranks ($kind): LoRA with dropout"; }
same_run "2 ranks, LoRA dropout" "$dir/onel" "$dir/twol"

# ZeRO stage 2 (parameters whole on every rank, optimizer on NVMe): the same model
mkdir -p "$dir/nv1" "$dir/nv2" "$dir/nv3"
printf '{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "%s"}}}' \
  "$dir/nv2" >"$dir/stage2.json"
printf '{"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "%s"}}}' \
  "$dir/nv2" >"$dir/stage2-params-nvme.json"
# 2 ranks with config file CONFIG (stage S) equal one rank with accumulation 2
# and the same file (a --config run takes its defaults from the config, not
# the CLI's: the 1-rank reference runs with the same file).
same_as_one_rank() {  # S CONFIG
  "$strata" finetune "${common[@]}" --steps 5 --batch 2 --grad-accum 2 --out "$dir/one${1}c" --config "$2" \
    >"$dir/one${1}c.log" 2>&1 || { cat "$dir/one${1}c.log"; fail "1-rank run (accumulation 2, stage-$1 config)"; }
  timeout 300 "${launch[@]}" 2 "$strata" finetune "${common[@]}" --steps 5 --batch 2 --out "$dir/two$1" \
    --config "$2" >"$dir/two$1.log" 2>&1 || { cat "$dir/two$1.log"; fail "2 ranks ($kind): finetune (stage $1)"; }
  same_run "2 ranks, stage $1" "$dir/one${1}c" "$dir/two$1"
}
same_as_one_rank 2 "$dir/stage2.json"
# ZeRO stage 1 (each rank's gradient summed on its device, reduced once per
# step; one micro-batch per rank: the same sums as one rank's accumulation)
printf '{"zero_optimization": {"stage": 1}}' >"$dir/stage1.json"
same_as_one_rank 1 "$dir/stage1.json"

"$strata" finetune "${common[@]}" --steps 5 --batch 2 --grad-accum 3 --out "$dir/one3" \
  --offload-params nvme:"$dir/nv1" --offload-optimizer nvme:"$dir/nv1" >"$dir/one3.log" 2>&1 ||
  { cat "$dir/one3.log"; fail "1-rank run (accumulation 3, NVMe)"; }
timeout 300 "${launch[@]}" 3 "$strata" finetune "${common[@]}" --steps 5 --batch 2 --out "$dir/three" \
  --offload-params nvme:"$dir/nv3" --offload-optimizer nvme:"$dir/nv3" --save-every 2 >"$dir/three.log" 2>&1 ||
  { cat "$dir/three.log"; fail "3 ranks ($kind): finetune (NVMe)"; }
same_run "3 ranks, NVMe" "$dir/one3" "$dir/three"
[[ -f "$dir/three/checkpoint-4/manifest.rank2.json" ]] || fail "3 ranks: checkpoint-4 lacks rank 2's shard"
[[ -z "$(ls -A "$dir/nv3" | grep -v '^\.strata-scratch$')" ]] || fail "3 ranks: swap files left in $dir/nv3"

# ---- 2 -> 3 -> 1 ranks on one global batch of 6: each resume reshards the checkpoint
# (engine_mpi_test checks the state bit for bit); the continued losses follow the
# uninterrupted 2-rank run (micro-batches of 3, 2, 6 sequences round differently)
timeout 300 "${launch[@]}" 2 "$strata" finetune "${common[@]}" --steps 6 --batch 3 --save-every 2 --keep 0 \
  --out "$dir/rs" >"$dir/rs2.log" 2>&1 || { cat "$dir/rs2.log"; fail "reshard: the 2-rank run"; }
cp "$dir/rs/metrics.jsonl" "$dir/rs2.metrics"
timeout 300 "${launch[@]}" 3 "$strata" finetune "${common[@]}" --steps 6 --batch 2 --save-every 2 --keep 0 \
  --out "$dir/rs" --resume "$dir/rs/checkpoint-2" >"$dir/rs3.log" 2>&1 ||
  { cat "$dir/rs3.log"; fail "reshard: 3 ranks resuming the 2-rank checkpoint-2"; }
grep -q "resuming at step 2" "$dir/rs3.log" || fail "reshard 2 -> 3: not resumed at step 2: $(head -3 "$dir/rs3.log")"
"$strata" finetune "${common[@]}" --steps 6 --batch 6 --out "$dir/rs" --resume "$dir/rs/checkpoint-4" \
  >"$dir/rs1.log" 2>&1 || { cat "$dir/rs1.log"; fail "reshard: 1 rank resuming the 3-rank checkpoint-4"; }
python3 - "$dir/rs2.metrics" "$dir/rs/metrics.jsonl" <<'PY' || fail "reshard 2 -> 3 -> 1: the losses drift from the 2-rank run's"
import json, sys
a, b = ([json.loads(l) for l in open(f) if '"train"' in l] for f in sys.argv[1:3])
assert [x["step"] for x in a] == [x["step"] for x in b] == [1, 2, 3, 4, 5, 6], (a, b)
for x, y in zip(a, b):
    assert abs(x["loss"] - y["loss"]) <= 1e-4 * abs(x["loss"]), (x["step"], x["loss"], y["loss"])
PY
expect_resume_error() {
  out=$("$strata" finetune "${common[@]}" --steps 6 --batch 4 --out "$dir/rs" --resume "$dir/rs/checkpoint-4" 2>&1)
  [[ $? -eq 1 && $out == *"batch = 6, this run has 4"* ]] || fail "resume with another global batch: $out"
}
expect_resume_error

# ---- SIGTERM to one rank: every rank stops after the same step, saved; --resume finishes identically
timeout 300 "${launch[@]}" 2 "$strata" finetune "${common[@]}" --steps 40 --batch 2 --out "$dir/full" \
  >"$dir/full.log" 2>&1 || { cat "$dir/full.log"; fail "uninterrupted 40-step run"; }
"${launch[@]}" 2 "$strata" finetune "${common[@]}" --steps 40 --batch 2 --out "$dir/sig" >"$dir/sig.log" 2>&1 &
job=$!
wait_step "$dir/sig" 3
victim=$(rank_pid "$dir/sig")
[[ -n $victim ]] && kill -TERM "$victim"
wait "$job"
rc=$?
if [[ $rc -eq 0 ]]; then
  echo "note: the run ended before the signal; the stop agreement was not exercised"
else
  grep -q "interrupted at step" "$dir/sig.log" || fail "SIGTERM: no 'interrupted at step' line: $(tail -5 "$dir/sig.log")"
  timeout 300 "${launch[@]}" 2 "$strata" finetune "${common[@]}" --steps 40 --batch 2 --out "$dir/sig" \
    --resume "$dir/sig" >"$dir/resume.log" 2>&1 || { cat "$dir/resume.log"; fail "--resume after SIGTERM"; }
  cmp -s "$dir/full/model/model.safetensors" "$dir/sig/model/model.safetensors" ||
    fail "SIGTERM + --resume: the model differs from the uninterrupted run's"
fi

# ---- a stop signal while a rank waits for the others (here: a peer that
# never comes): it ends at once, exit 130, instead of at the 300 s timeout
if [[ $kind == tcp ]]; then
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$strata" finetune "${common[@]}" --steps 4 --batch 2 --out "$dir/alone" >"$dir/alone.log" 2>&1 &
  alone=$!
  for ((i = 0; i < 300; i++)); do  # until its SIGTERM handler is in place (bit 15 of SigCgt)
    mask=$(awk '/^SigCgt/ {print $2}' "/proc/$alone/status" 2>/dev/null) || break
    [[ -n $mask ]] && (((16#$mask >> 14) & 1)) && break
    sleep 0.1
  done
  t0=$SECONDS
  kill -TERM "$alone"
  wait "$alone"
  rc=$?
  ((rc == 130)) || fail "SIGTERM while waiting for the ranks: exit $rc, expected 130: $(tail -3 "$dir/alone.log")"
  ((SECONDS - t0 < 30)) || fail "SIGTERM while waiting for the ranks: $((SECONDS - t0)) s to end"
  grep -q "interrupted (a stop signal) while waiting" "$dir/alone.log" ||
    fail "SIGTERM while waiting for the ranks: no 'interrupted' error: $(tail -3 "$dir/alone.log")"
  [[ ! -e $dir/alone ]] || fail "the rank stopped while waiting left its out dir: $(ls -A "$dir/alone")"
fi

# ---- two jobs given one MASTER_PORT: job A's rank 0 holds the port for its
# run, so job B fails at once on both ranks, each saying why (before, B's
# rank 1 could meet A's rank 0 while A's ranks met)
if [[ $kind == tcp ]]; then
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  as_rank() {  # RANK OUT: one rank of 2 on $port (job A runs until killed; job B is refused)
    RANK=$1 WORLD_SIZE=2 LOCAL_RANK=$1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$strata" finetune "${common[@]}" --steps 100000 --batch 2 --comm-timeout 60 --out "$2"
  }
  as_rank 0 "$dir/jobA" >"$dir/jobA0.log" 2>&1 &
  a0=$!
  as_rank 1 "$dir/jobA" >"$dir/jobA1.log" 2>&1 &
  a1=$!
  wait_step "$dir/jobA" 2
  t0=$SECONDS
  out1=$(timeout 60 bash -c "$(declare -f as_rank); $(declare -p common port strata); as_rank 1 '$dir/jobB'" 2>&1)
  rc1=$?
  out0=$(timeout 60 bash -c "$(declare -f as_rank); $(declare -p common port strata); as_rank 0 '$dir/jobB'" 2>&1)
  rc0=$?
  elapsed=$((SECONDS - t0))
  running=$(jobs -rp | grep -cE "^($a0|$a1)$")
  kill -TERM "$a0" "$a1" 2>/dev/null
  wait "$a0" "$a1"
  ((running == 2)) || fail "job A ended before job B was tried: $(tail -n 3 "$dir/jobA0.log")"
  ((rc1 != 0 && rc0 != 0)) || fail "a second job on the same port: exits $rc0 $rc1"
  [[ $out1 == *"have already met and left it"*"another job given the same MASTER_ADDR:MASTER_PORT"* ]] ||
    fail "a second job's rank 1 on the same port: $out1"
  [[ $out0 == *"another rank 0 already leads this rendezvous"* ]] || fail "a second job's rank 0 on the same port: $out0"
  ((elapsed < 30)) || fail "a second job on the same port took $elapsed s to fail"
  [[ ! -e $dir/jobB ]] || fail "the refused job left its out dir: $(ls -A "$dir/jobB")"
fi

# A 400-step job of 2 ranks into OUT NAME (extra flags after); once step 2
# is done, one rank gets signal SIG; the job must end within 60 s, not 0.
# Sets `elapsed` and `rc`.
signal_a_rank() {
  local name=$1 sig=$2 how=("${launch[@]}")
  shift 2
  # A killed rank: do the others end by themselves? A stopped one never
  # ends: the launcher stops it once the other failed.
  [[ $sig == KILL ]] && how=("${launch_alone[@]}")
  "${how[@]}" 2 "$strata" finetune "${common[@]}" --steps 400 --batch 2 --out "$dir/$name" "$@" \
    >"$dir/$name.log" 2>&1 &
  local job=$!
  wait_step "$dir/$name" 2
  local victim t0=$SECONDS
  victim=$(rank_pid "$dir/$name")
  kill "-$sig" "$victim"
  # The guard's sleep must not outlive it: holding the test's stdout, a
  # sleep left behind kept ctest waiting 90 s after the test had ended.
  (
    exec >/dev/null 2>&1
    sleep 90 &
    s=$!
    trap 'kill $s; exit 0' TERM
    wait $s
    kill -9 "$job" "$victim"
  ) &
  local guard=$!
  wait "$job"
  rc=$?
  elapsed=$((SECONDS - t0))
  kill "$guard" 2>/dev/null
  kill -9 "$victim" 2>/dev/null
  ((rc != 0)) || fail "SIG$sig to a rank: the job exited 0"
  ((elapsed < 60)) || fail "SIG$sig to a rank: the job took $elapsed s to end"
}

# ---- a rank that stops answering: the other fails within --comm-timeout, naming it
signal_a_rank hang STOP --comm-timeout 3
grep -q "timed out after 3 s waiting for rank" "$dir/hang.log" ||
  fail "a stopped rank: no timeout error naming the rank: $(tail -8 "$dir/hang.log")"

# ---- a rank killed: the job ends, nothing hangs (mpirun ends the others; over
# TCP the other sees the connection close and fails at once, naming the rank,
# long before --comm-timeout)
signal_a_rank kill KILL --comm-timeout 30
[[ -z $(pgrep -f -- "--out $dir/kill") ]] || fail "a killed rank: ranks still running"
if [[ $kind == tcp ]]; then
  grep -q "rank [01] closed its connection" "$dir/kill.log" ||
    fail "a killed rank: the other's error does not name it: $(tail -8 "$dir/kill.log")"
  ((elapsed < 25)) || fail "a killed rank: the other took $elapsed s to fail (the timeout, not the closed connection)"
fi

# ---- a rank that fails before the ranks meet (its data file missing): the
# other fails at once naming it and why, not after --comm-timeout (TCP: under
# mpirun, mpirun ends the job)
if [[ $kind == tcp ]]; then
  [[ ${common[2]} == --data ]] || fail "the test's common flags moved: ${common[*]}"
  t0=$SECONDS
  out=$(timeout 120 "${launch_alone[@]}" 2 bash -c 'a=("${@:2}"); [[ $RANK == 1 ]] && a[3]=$1/missing.txt
    exec "$0" finetune "${a[@]}"' "$strata" "$dir" "${common[@]}" --steps 2 --batch 2 --comm-timeout 90 \
    --out "$dir/e9" 2>&1)
  rc=$?
  elapsed=$((SECONDS - t0))
  ((rc != 0)) || fail "a rank without its data: exit 0"
  [[ $out == *"rank 0 of 2"*"rank 1 failed before the ranks met:"*"missing.txt"* ]] ||
    fail "a rank without its data: rank 0 does not name it: $out"
  ((elapsed < 45)) || fail "a rank without its data: the job took $elapsed s to end (rank 0 waited for it)"
  [[ ! -e $dir/e9 ]] || fail "a refused start left its out dir: $(ls -A "$dir/e9")"
fi

# ---- refused by name
cli_command "${launch[@]}" 2 "$strata" finetune
# (GPU ranks over NCCL: here no GPU, or a build without CUDA/NCCL, says why)
expect_error "GPU ranks" "${common[@]}" --steps 2 --batch 2 --out "$dir/e1" --device cuda
expect_error "use stage 3" "${common[@]}" --steps 2 --batch 2 --out "$dir/e2" --config "$dir/stage2-params-nvme.json"
if [[ $kind == mpi ]]; then
  out=$(timeout 120 "${launch[@]}" 1 "$strata" finetune "${common[@]}" --steps 2 --batch 2 --out "$dir/e4" : \
    -np 1 "$strata" finetune "${common[@]}" --steps 2 --batch 4 --out "$dir/e4" 2>&1)
else
  out=$(timeout 120 "${launch[@]}" 2 bash -c '"$0" finetune "$@" --batch $((RANK ? 4 : 2))' "$strata" \
    "${common[@]}" --steps 2 --out "$dir/e4" 2>&1)
fi
rc=$?
((rc != 0)) || fail "ranks with different --batch: exit 0"
[[ $out == *"settings differ from rank 0's"*"batch = 8 here, 4 on rank 0 (the global batch: --batch x the number of ranks)"* ]] ||
  fail "ranks with different --batch: message lacks the reason: $out"
[[ $kind == mpi || $out == *"rank(s) 1 run with settings other than rank 0's"* ]] ||
  fail "ranks with different --batch: rank 0 does not name rank 1: $out"
# Another flag every rank must share (evaluating at other steps would leave the others waiting)
if [[ $kind == mpi ]]; then
  out=$(timeout 120 "${launch[@]}" 1 "$strata" finetune "${common[@]}" --steps 2 --batch 2 --out "$dir/e5" : \
    -np 1 "$strata" finetune "${common[@]}" --steps 2 --batch 2 --eval-every 1 --out "$dir/e5" 2>&1)
else
  out=$(timeout 120 "${launch[@]}" 2 bash -c '"$0" finetune "$@" --eval-every $((RANK ? 1 : 0))' "$strata" \
    "${common[@]}" --steps 2 --batch 2 --out "$dir/e5" 2>&1)
fi
[[ $out == *"ranks.eval_every = 1 here, 0 on rank 0"* ]] || fail "ranks with different --eval-every: $out"
# Another --seq on one rank: named as seq, not as the data shape it implies
[[ ${common[4]} == --seq ]] || fail "the test's common flags moved: ${common[*]}"
seq32=("${common[@]}")
seq32[5]=32
if [[ $kind == mpi ]]; then
  out=$(timeout 120 "${launch[@]}" 1 "$strata" finetune "${common[@]}" --steps 2 --batch 2 --out "$dir/e5s" : \
    -np 1 "$strata" finetune "${seq32[@]}" --steps 2 --batch 2 --out "$dir/e5s" 2>&1)
else
  out=$(timeout 120 "${launch[@]}" 2 bash -c 'n=$1; shift; a=("${@:1:n}"); [[ $RANK == 1 ]] && a=("${@:n+1:n}")
    exec "$0" finetune "${a[@]}" "${@:2*n+1}"' "$strata" "${#common[@]}" "${common[@]}" "${seq32[@]}" \
    --steps 2 --batch 2 --out "$dir/e5s" 2>&1)
fi
[[ $out == *"settings differ from rank 0's"*"seq = 32 here, 64 on rank 0"* ]] || fail "ranks with different --seq: $out"
# Another model of the same shapes on one rank (DDP would start every rank from rank 0's)
"$strata" init-model --layers 2 --dim 64 --heads 4 --kv-heads 2 --ffn-dim 160 --vocab 256 --dtype fp32 \
  --tie-embeddings --seed 6 --out "$dir/model6" >/dev/null || fail "init-model (seed 6)"
mine=("${common[@]}")
mine[1]=$dir/model6
if [[ $kind == mpi ]]; then
  out=$(timeout 120 "${launch[@]}" 1 "$strata" finetune "${common[@]}" --steps 2 --batch 2 --out "$dir/e6" : \
    -np 1 "$strata" finetune "${mine[@]}" --steps 2 --batch 2 --out "$dir/e6" 2>&1)
else
  out=$(timeout 120 "${launch[@]}" 2 bash -c '"$0" finetune --model "$([[ $RANK == 1 ]] && echo "$1" || echo "$2")" "${@:5}"' \
    "$strata" "$dir/model6" "$dir/model" "${common[@]}" --steps 2 --batch 2 --out "$dir/e6" 2>&1)
fi
rc=$?
((rc != 0)) || fail "a rank with another model: exit 0"
[[ $out == *"weights loaded by rank 1 differ from rank 0's"* ]] || fail "a rank with another model: $out"
[[ ! -e $dir/e6 ]] || fail "a refused start left its out dir: $(ls -A "$dir/e6")"
# Another out dir on one rank (its checkpoint shards would go elsewhere): refused at the start
if [[ $kind == mpi ]]; then
  out=$(timeout 120 "${launch[@]}" 1 "$strata" finetune "${common[@]}" --steps 2 --batch 2 --out "$dir/e7" : \
    -np 1 "$strata" finetune "${common[@]}" --steps 2 --batch 2 --out "$dir/e7b" 2>&1)
else
  out=$(timeout 120 "${launch[@]}" 2 bash -c '"$0" finetune "${@:2}" --out "$1/e7$([[ $RANK == 1 ]] && echo b)"' \
    "$strata" "$dir" "${common[@]}" --steps 2 --batch 2 2>&1)
fi
[[ $out == *"--out $dir/e7b is not rank 0's out dir"* ]] || fail "a rank with another --out: $out"
[[ ! -e $dir/e7 && ! -e $dir/e7b ]] || fail "a refused start left an out dir: $(ls -d "$dir"/e7*)"

# An export rank 0 cannot write (OUT/model is a file here) loses no training: every rank
# learns it, the ranks save the last step together, and --resume exports it. (Under mpirun
# the first rank to exit ends the others: only rank 0's words are sure to be printed.)
timeout 300 "${launch[@]}" 2 "$strata" finetune "${common[@]}" --steps 4 --save-every 3 --batch 2 --no-export \
  --out "$dir/xf" >"$dir/xf.log" 2>&1 || fail "2 ranks, 4 steps: $(tail -5 "$dir/xf.log")"
rm -rf "$dir/xf/checkpoint-4"
echo "not a directory" >"$dir/xf/model"
timeout 300 "${launch[@]}" 2 "$strata" finetune "${common[@]}" --steps 4 --batch 2 --out "$dir/xf" --resume "$dir/xf" \
  >"$dir/xf.log" 2>&1 && fail "an export into a file succeeded: $(tail -5 "$dir/xf.log")"
[[ -f $dir/xf/checkpoint-4/index.json ]] || fail "a failed export of 2 ranks saved no checkpoint: $(tail -5 "$dir/xf.log")"
grep -q "the trained state is saved in $dir/xf/checkpoint-4" "$dir/xf.log" ||
  fail "the failed export did not name the saved state: $(tail -5 "$dir/xf.log")"
if [[ $kind == tcp ]]; then
  grep -q "rank 0 could not write the export to $dir/xf/model" "$dir/xf.log" ||
    fail "rank 1 was not told of rank 0's failed export: $(tail -5 "$dir/xf.log")"
fi
rm "$dir/xf/model"
timeout 300 "${launch[@]}" 2 "$strata" finetune "${common[@]}" --steps 4 --batch 2 --out "$dir/xf" --resume "$dir/xf" \
  >"$dir/xf.log" 2>&1 || fail "the resume that exports: $(tail -5 "$dir/xf.log")"
[[ -f $dir/xf/model/config.json ]] || fail "the resume exported no model"

cli_finish "finetune over $kind ranks"
