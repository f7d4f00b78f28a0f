#!/usr/bin/env bash
# `strata finetune` as a user meets it:
#   - every bad input exits 1 with a message naming what, where and why;
#   - --help lists every flag with its default;
#   - a job killed with SIGKILL after a checkpoint, resumed with --resume,
#     writes exactly the metrics (loss, grad norm, lr per step) of a job that
#     was never interrupted;
#   - SIGTERM (as Ctrl-C) finishes the step, saves a checkpoint and exits 130; resuming
#     from it finishes the job (exit 0) with the same final loss.
#   finetune_cli_test.sh STRATA_BINARY
# Exit 0 pass, 1 fail, 77 skip (ctest SKIP_RETURN_CODE).
set -uo pipefail
strata=${1:?usage: finetune_cli_test.sh STRATA_BINARY}
root=${STRATA_TEST_DIR:-/tmp}
dir=$(mktemp -d "$root/strata-finetune-cli.XXXXXX") || exit 1
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  rm -rf "$dir"
}
trap cleanup EXIT
source "$(dirname "${BASH_SOURCE[0]}")/../cli_lib.sh"
cli_command "$strata" finetune

# A small model and text data (sentences from a fixed list, ~60 KB).
cli_small_model_and_data "$strata" "$dir" || { echo "init-model failed"; exit 1; }
mkdir -p "$dir/nvme"
common=(--model "$dir/model" --data "$dir/data.txt" --seq 64 --batch 8 --lr 3e-3 --progress lines)

# ---- errors
expect_error "--model is required" --data "$dir/data.txt"
expect_error "$dir/missing-model" --model "$dir/missing-model" --data "$dir/data.txt" --out "$dir/o1"
expect_error "$dir/missing.txt" --model "$dir/model" --data "$dir/missing.txt" --out "$dir/o1"
printf 'too short' >"$dir/short.txt"
expect_error "too short" --model "$dir/model" --data "$dir/short.txt" --out "$dir/o1"
: >"$dir/empty.txt"
expect_error "is empty" --model "$dir/model" --data "$dir/empty.txt" --out "$dir/o1"
# A token file read in the wrong format trained on garbage with a normal-looking loss: the
# suffix picks the format, and a --data-format that contradicts it is refused.
python3 -c "import sys; sys.stdout.buffer.write(bytes(range(200)) * 40)" >"$dir/ids.u32"
expect_error "--data-format u16, but $dir/ids.u32's name says u32 token ids" --model "$dir/model" --seq 64 --batch 8 --data "$dir/ids.u32" \
  --data-format u16 --out "$dir/o1"
expect_error "token id" --model "$dir/model" --seq 64 --batch 8 --data "$dir/ids.u32" --out "$dir/o1"  # read as u32 (auto): ids past the vocab
# A loss mask with no target in the training part (every step would report loss 0), or none in
# the validation part (its loss over nothing).
cp "$dir/data.txt" "$dir/m.txt"
n=$(stat -c %s "$dir/m.txt")
python3 -c "import sys; n=$n; v=int(n*0.05); sys.stdout.buffer.write(bytes([0]*(n-v) + [1]*v))" >"$dir/valonly.mask"
expect_error "marks no target in the training part" --model "$dir/model" --seq 64 --batch 8 --data "$dir/m.txt" --loss-mask "$dir/valonly.mask" \
  --out "$dir/o1"
python3 -c "import sys; n=$n; v=int(n*0.05); sys.stdout.buffer.write(bytes([1]*(n-v) + [0]*v))" >"$dir/trainonly.mask"
expect_error "marks no target in the validation part" --model "$dir/model" --seq 64 --batch 8 --data "$dir/m.txt" \
  --loss-mask "$dir/trainonly.mask" --out "$dir/o1"
printf '{"zero_optimization": {"stage": 3,,}}' >"$dir/bad.json"
expect_error "$dir/bad.json: malformed JSON" "${common[@]}" --config "$dir/bad.json" --out "$dir/o1"
printf '{"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "%s/nvme"}}, "gradient_clipping": "x"}' \
  "$dir" >"$dir/badkey.json"
expect_error "gradient_clipping" "${common[@]}" --config "$dir/badkey.json" --out "$dir/o1"
expect_error "are alternatives" "${common[@]}" --config "$dir/badkey.json" --offload-params nvme:"$dir/nvme"
expect_error "NVMe directory $dir/no-such-dir" "${common[@]}" --offload-params nvme:"$dir/no-such-dir" --out "$dir/o1"
expect_error "offload target \"disk\"" "${common[@]}" --offload-optimizer disk --out "$dir/o1"
expect_error "out dir $dir/short.txt/out" "${common[@]}" --out "$dir/short.txt/out"
expect_error "schedule \"exp\"" "${common[@]}" --schedule exp --out "$dir/o1"
expect_error "warm-up" "${common[@]}" --steps 5 --warmup 9 --out "$dir/o1"
# Flags that would do nothing are refused, not ignored
expect_error "--schedule constant keeps --lr" "${common[@]}" --schedule constant --min-lr 1e-5 --out "$dir/o1"
expect_error "--eval-batches with --val-fraction 0" "${common[@]}" --val-fraction 0 --eval-batches 3 --out "$dir/o1"
expect_error "--fp16 and --bf16" "${common[@]}" --fp16 --bf16 --out "$dir/o1"
expect_error "resume: $dir/model is neither" "${common[@]}" --resume "$dir/model" --out "$dir/o1"
expect_error 'device "gpu" is not one of auto, cuda, cpu' "${common[@]}" --device gpu --out "$dir/o1"
# --device cuda where CUDA cannot run (disabled by the environment, so on every
# machine, GPU or not): exit 1 naming the reason.
cli_command env STRATA_CUDA_DISABLE=1 "$strata" finetune
expect_error "--device cuda: cannot train on the GPU" "${common[@]}" --device cuda --out "$dir/o1"
cli_command "$strata" finetune
# A full NVMe directory: a 1 MiB tmpfs cannot hold the state (root only).
mkdir -p "$dir/full"
if mount -t tmpfs -o size=1m tmpfs "$dir/full" 2>/dev/null; then
  expect_error "$dir/full" "${common[@]}" --offload-params nvme:"$dir/full" --offload-optimizer nvme:"$dir/full" \
    --out "$dir/o1"
  # An out dir on that disk once it is full: the lock file is made, but the
  # pid cannot be written in it; the run leaves neither the file nor the dirs.
  dd if=/dev/zero of="$dir/full/fill" bs=64k 2>/dev/null
  expect_error "writing $dir/full/o3/x/.strata.lock: No space left on device" "${common[@]}" --out "$dir/full/o3/x"
  [[ -z $(ls -A "$dir/full" | grep -v '^fill$') ]] || fail "a run on a full disk left: $(find "$dir/full" | head -5)"
  umount "$dir/full"
else
  echo "note: cannot mount a small tmpfs here (not root?): the full-NVMe case is not checked"
fi
# A run that never started leaves no out dir behind, also when it failed after
# creating it (the GPU refused, the NVMe directory full, a budget too small).
expect_error "the host budget is 1.0 MiB" "${common[@]}" --host-mem 1MiB --out "$dir/o1/a/b"
[[ ! -e $dir/o1 ]] || fail "runs that failed to start left their out dir: $(find "$dir/o1" | head -5)"
mkdir "$dir/o2"
expect_error "the host budget is 1.0 MiB" "${common[@]}" --host-mem 1MiB --out "$dir/o2"
[[ -d $dir/o2 ]] || fail "a failed run removed the out dir it was given (it existed before)"

# ---- DeepSpeed's batch sizes in --config: train_micro_batch_size_per_gpu and
# train_batch_size set the micro-batch and accumulation as in DeepSpeed
# (--batch / --grad-accum stand for the config's values when given); values
# that do not agree are refused naming them.
bs_run() {  # bs_run NAME CONFIG_JSON [FLAGS...]: prints the run's "steps of B x S x G tokens"
  local name=$1 cfg=$2
  shift 2
  printf '%s' "$cfg" >"$dir/$name.json"
  "$strata" finetune --model "$dir/model" --data "$dir/data.txt" --seq 64 --steps 1 --no-export --progress lines \
    --config "$dir/$name.json" --out "$dir/$name" "$@" >"$dir/$name.log" 2>&1 || {
    fail "$name: exit $?: $(cat "$dir/$name.log")"
    return
  }
  grep -o 'steps of [0-9]* x 64 x [0-9]*' "$dir/$name.log"
}
[[ $(bs_run bs1 '{"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3}') == "steps of 3 x 64 x 4" ]] ||
  fail "train_batch_size 12 / micro 3 did not give 3 x 4: $(cat "$dir/bs1.log")"
[[ $(bs_run bs2 '{"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3}' --batch 2) == "steps of 2 x 64 x 6" ]] ||
  fail "--batch 2 with train_batch_size 12 did not give 2 x 6: $(cat "$dir/bs2.log")"
[[ $(bs_run bs3 '{"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 2}') == "steps of 5 x 64 x 2" ]] ||
  fail "micro 5, accumulation 2 did not give 5 x 2: $(cat "$dir/bs3.log")"
[[ $(bs_run bs4 '{"train_batch_size": 6}') == "steps of 6 x 64 x 1" ]] ||
  fail "train_batch_size 6 alone did not give 6 x 1: $(cat "$dir/bs4.log")"
[[ $(bs_run bs5 '{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}' --batch 3) == \
  "steps of 3 x 64 x 1" ]] || fail "\"auto\" batch sizes did not leave --batch: $(cat "$dir/bs5.log")"
# optimizer.params.lr "auto" is filled from --lr (given, or its default 1e-4) as
# Hugging Face fills it from its arguments; absent it is DeepSpeed's 1e-3. A
# config without a "scheduler" section says that --schedule decides.
lr_auto='{"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}'
bs_run lr1 "$lr_auto" --lr 0.003 >/dev/null
grep -q '^lr: cosine, peak 0.003 to 0, 0 warm-up steps (--schedule; .*lr1.json has no "scheduler" section' \
  "$dir/lr1.log" || fail "lr \"auto\" with --lr 0.003: $(cat "$dir/lr1.log")"
grep -q '^precision: fp32 compute copies, fp32 masters and gradients, fp32 optimizer states$' "$dir/lr1.log" ||
  fail "no precision line: $(cat "$dir/lr1.log")"
bs_run lr2 "$lr_auto" >/dev/null
grep -q '^lr: cosine, peak 0.0001 ' "$dir/lr2.log" || fail "lr \"auto\" without --lr: $(cat "$dir/lr2.log")"
bs_run lr3 '{"optimizer": {"type": "AdamW", "params": {}}}' --schedule constant >/dev/null
grep -q '^lr: constant, peak 0.001, 0 warm-up steps (--schedule)$' "$dir/lr3.log" ||
  fail "lr absent: $(cat "$dir/lr3.log")"
printf '{"optimizer": {"params": {"lr": 0}}}' >"$dir/lr5.json"
expect_error "lr5.json: optimizer.params.lr/--min-lr/--warmup: learning rate 0 must be > 0" \
  --model "$dir/model" --data "$dir/data.txt" --seq 64 --config "$dir/lr5.json" --out "$dir/lr5"
expect_error "--lr/--min-lr/--warmup: min_lr 1e-06 must be in [0, lr = 1e-07]" \
  --model "$dir/model" --data "$dir/data.txt" --seq 64 --lr 1e-7 --min-lr 1e-6 --out "$dir/lr5"
# A bad value is named with its flag.
expect_error "--schedule: schedule \"foo\" is not one of" --model "$dir/model" --data "$dir/data.txt" --schedule foo --out "$dir/lr5"
expect_error "--data-format: data format \"foo\"" --model "$dir/model" --data "$dir/data.txt" --data-format foo --out "$dir/lr5"
expect_error "--export-dtype: unknown dtype 'int8'" --model "$dir/model" --data "$dir/data.txt" --export-dtype int8 --out "$dir/lr5"
expect_error "resume: $dir/nowhere does not exist" --model "$dir/model" --data "$dir/data.txt" --resume "$dir/nowhere" --out "$dir/lr5"
# A path that cannot be read is not called missing (a loop of links: ELOOP).
ln -s "$dir/loop-b" "$dir/loop-a" && ln -s "$dir/loop-a" "$dir/loop-b"
expect_error "resume: cannot read $dir/loop-a: Too many levels of symbolic links" \
  --model "$dir/model" --data "$dir/data.txt" --resume "$dir/loop-a" --out "$dir/lr5"
expect_error "$dir/data.txt is a file, not a model directory" --model "$dir/data.txt" --data "$dir/data.txt" --out "$dir/lr5"
expect_error "learning rate 1e+39 is past fp32's range" --model "$dir/model" --data "$dir/data.txt" --lr 1e39 --out "$dir/lr5"
# "Effectively never" failed the first collective at once (the deadline overflowed).
expect_error "--comm-timeout 1e+10 must be > 0 and at most 1e7 seconds" --model "$dir/model" --data "$dir/data.txt" \
  --comm-timeout 1e10 --out "$dir/lr5"
[[ ! -e $dir/lr5 ]] || fail "a refused --lr left its out dir"
printf '{"optimizer": "auto"}' >"$dir/lr4.json"
expect_error 'optimizer: expected an object, got "auto"' \
  --model "$dir/model" --data "$dir/data.txt" --seq 64 --config "$dir/lr4.json" --out "$dir/lr4"
printf '{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}' >"$dir/bs6.json"
expect_error "train_batch_size 10 is not train_micro_batch_size_per_gpu 3 x gradient_accumulation_steps 2 x 1 rank(s)" \
  --model "$dir/model" --data "$dir/data.txt" --seq 64 --config "$dir/bs6.json" --out "$dir/bs6"
expect_error "train_batch_size 10 is not --batch 5 x --grad-accum 3 x 1 rank(s)" \
  --model "$dir/model" --data "$dir/data.txt" --seq 64 --config "$dir/bs6.json" --batch 5 --grad-accum 3 --out "$dir/bs6"
expect_error "--batch must be at least 1" \
  --model "$dir/model" --data "$dir/data.txt" --seq 64 --config "$dir/bs6.json" --batch 0 --out "$dir/bs6"
printf '{"train_micro_batch_size_per_gpu": 0}' >"$dir/bs7.json"
expect_error "train_micro_batch_size_per_gpu" \
  --model "$dir/model" --data "$dir/data.txt" --seq 64 --config "$dir/bs7.json" --out "$dir/bs7"

# --metrics / --trace never replace a file Strata did not write, nor open a FIFO (which would block).
cp "$dir/data.txt" "$dir/data.copy"
expect_error "metrics file $dir/data.copy exists and is not a file Strata wrote" "${common[@]}" --steps 1 \
  --metrics "$dir/data.copy" --out "$dir/mt1"
cmp -s "$dir/data.txt" "$dir/data.copy" || fail "--metrics over the data changed it"
[[ ! -e $dir/mt1 ]] || fail "a refused --metrics left its out dir"
mkfifo "$dir/fifo"
out=$(timeout 60 "$strata" finetune "${common[@]}" --steps 1 --trace "$dir/fifo" --out "$dir/mt2" 2>&1)
rc=$?
((rc == 1)) && [[ $out == *"trace file $dir/fifo exists and is not a regular file"* ]] ||
  fail "--trace FIFO: exit $rc: $out"
out=$(timeout 60 "$strata" finetune "${common[@]}" --steps 1 --metrics "$dir/fifo" --out "$dir/mt3" 2>&1)
rc=$?
((rc == 1)) && [[ $out == *"metrics file $dir/fifo exists and is not a regular file"* ]] ||
  fail "--metrics FIFO: exit $rc: $out"

# A micro-batch whose activations cannot fit in RAM is refused up front, by the flags that size it
# (not met by the OOM killer), and leaves no out dir.
expect_error "lower --batch or --seq" --model "$dir/model" --data "$dir/data.txt" --seq 64 --batch 50000000 \
  --device cpu --out "$dir/huge"
[[ ! -e $dir/huge ]] || fail "a refused --batch left its out dir"

help=$("$strata" finetune --help)
for flag in --model --data --config --offload-params --offload-optimizer --steps --batch --seq --lr --warmup \
  --schedule --grad-accum --save-every --out --resume --trace --device; do
  [[ $help == *"$flag"* ]] || fail "--help does not list $flag"
done
[[ $help == *"--steps INT=100"* ]] || fail "--help does not show the default of --steps"

# ---- kill -9 after a checkpoint, resume, compare with an uninterrupted run
job=("${common[@]}" --warmup 2 --steps 30 --save-every 5 --keep 0 --grad-accum 2 --no-export
  --offload-params nvme:"$dir/nvme" --offload-optimizer nvme:"$dir/nvme")
# Per step: "step loss grad_norm lr" exactly as the metrics file has them.
train_lines() { grep '"event":"train"' "$1" | sed -E 's/.*"grad_norm":([^,]*).*"loss":([^,]*),.*"lr":([^,]*),.*"step":([0-9]+),.*/\4 \2 \1 \3/' | sort -n -k1,1 | uniq; }

"$strata" finetune "${job[@]}" --out "$dir/straight" >"$dir/straight.log" 2>&1 || fail "uninterrupted run failed: $(cat "$dir/straight.log")"
"$strata" finetune "${job[@]}" --out "$dir/killed" >"$dir/killed.log" 2>&1 &
pid=$!
pids+=("$pid")
for ((i = 0; i < 600; i++)); do
  [[ -e $dir/killed/checkpoint-10/index.json ]] && break
  sleep 0.05
done
kill -9 "$pid" 2>/dev/null
wait "$pid" 2>/dev/null
rc=$?
if [[ $rc -ne 137 ]]; then
  fail "the job was not killed mid-run (exit $rc): make it slower"
else
  "$strata" finetune "${job[@]}" --out "$dir/killed" --resume "$dir/killed" >"$dir/resumed.log" 2>&1 ||
    fail "resume failed: $(cat "$dir/resumed.log")"
  grep -q "resuming at step" "$dir/resumed.log" || fail "resume did not say where it resumed: $(cat "$dir/resumed.log")"
  a=$(train_lines "$dir/straight/metrics.jsonl")
  b=$(train_lines "$dir/killed/metrics.jsonl")
  [[ $(wc -l <<<"$a") -eq 30 ]] || fail "the uninterrupted run logged $(wc -l <<<"$a") steps, not 30"
  [[ -n $a && $a == "$b" ]] || fail "the resumed run differs from the uninterrupted one: $(diff <(echo "$a") <(echo "$b") | head -5)"
  # The resumed run's metrics file reads as if it had never stopped: the
  # lines the killed job wrote after its checkpoint are gone, none twice.
  n=$(grep -c '"event":"train"' "$dir/killed/metrics.jsonl")
  [[ $n -eq 30 ]] || fail "the resumed run's metrics hold $n train lines, not 30"
fi

# signal_after_checkpoint OUT SIGNAL...: runs the job into OUT (log OUT.log), sends each
# signal 0.1 s apart once checkpoint-5 is saved; the job's exit status.
signal_after_checkpoint() {
  local out=$1 sig pid i
  shift
  "$strata" finetune "${job[@]}" --out "$out" >"$out.log" 2>&1 &
  pid=$!
  pids+=("$pid")
  for ((i = 0; i < 600; i++)); do
    [[ -e $out/checkpoint-5/index.json ]] && break
    sleep 0.05
  done
  for sig in "$@"; do
    kill -"$sig" "$pid" 2>/dev/null
    sleep 0.1
  done
  wait "$pid"
}

# ---- Ctrl-C / SIGTERM: finish the step, save, exit 130; resume to the end.
# (SIGTERM here: a non-interactive shell starts background jobs with SIGINT
# ignored, and a signal ignored at start stays ignored. Both go through the
# same handler.)
signal_after_checkpoint "$dir/sigint" TERM
rc=$?
if [[ $rc -eq 0 ]]; then
  fail "the job finished before SIGTERM arrived: make it slower"
else
  [[ $rc -eq 130 ]] || fail "SIGTERM: exit $rc, not 130: $(tail -5 "$dir/sigint.log")"
  grep -q "interrupted at step" "$dir/sigint.log" || fail "SIGTERM: no 'interrupted' line: $(tail -5 "$dir/sigint.log")"
  "$strata" finetune "${job[@]}" --out "$dir/sigint" --resume "$dir/sigint" >"$dir/sigint2.log" 2>&1 ||
    fail "resume after SIGTERM failed: $(cat "$dir/sigint2.log")"
  a=$(train_lines "$dir/straight/metrics.jsonl")
  b=$(train_lines "$dir/sigint/metrics.jsonl")
  [[ $a == "$b" ]] || fail "the run stopped by SIGTERM and resumed differs: $(diff <(echo "$a") <(echo "$b") | head -5)"
fi
# No swap files left behind by the clean exits.
left=$(find "$dir/nvme" -type f | head -3)
[[ -z $left ]] || echo "note: files left in the NVMe dir (from the killed job): $left"

# A reader that went away (`strata finetune | tee log`, Ctrl-C ending tee too; here a
# reader that reads nothing): the writes fail, the run still finishes and exports, it is
# not killed by SIGPIPE (exit 141, nothing saved).
"$strata" finetune "${common[@]}" --steps 2 --log-every 1 --out "$dir/pipe" 2>&1 | true
rc=${PIPESTATUS[0]}
[[ $rc -eq 0 && -e $dir/pipe/model/config.json ]] || fail "finetune writing into a closed pipe: exit $rc (141: SIGPIPE)"

# A soft CPU-time limit (`ulimit -S -t`; batch systems' CPU limits) sends SIGXCPU, and again
# each CPU second until the hard limit: it stops like SIGTERM (a checkpoint, exit 130), and
# its repeats do not abort the save.
signal_after_checkpoint "$dir/xcpu" XCPU XCPU
rc=$?
if [[ $rc -eq 0 ]]; then
  fail "the job finished before SIGXCPU arrived: make it slower"
else
  [[ $rc -eq 130 ]] || fail "SIGXCPU: exit $rc, not 130: $(tail -5 "$dir/xcpu.log")"
  grep -q "soft CPU time limit (ulimit -S -t) is reached" "$dir/xcpu.log" ||
    fail "SIGXCPU: not named: $(tail -5 "$dir/xcpu.log")"
  grep -q "interrupted at step" "$dir/xcpu.log" || fail "SIGXCPU: no 'interrupted' line: $(tail -5 "$dir/xcpu.log")"
fi

# Standard descriptors closed by the caller: what Strata opens never takes their numbers
# (progress text would land in the out dir's lock record).
"$strata" finetune "${common[@]}" --steps 2 --log-every 1 --no-export --out "$dir/closed" <&- >&- 2>&-
rc=$?
[[ $rc -eq 0 ]] || fail "finetune with stdin, stdout and stderr closed: exit $rc"
lock=$(cat "$dir/closed/.strata.lock" 2>/dev/null)
[[ $lock == "pid "* && $(wc -l <"$dir/closed/.strata.lock") -le 1 ]] ||
  fail "with stdout closed the lock record holds other text: $(head -c 200 "$dir/closed/.strata.lock")"

# --resume auto (one command line for every attempt of a restarted job): a new run where
# OUT holds no checkpoint, the newest checkpoint where it holds one; an earlier run
# without a checkpoint is refused as without --resume (replaced with --overwrite); a
# restart under torchrun that forgot it is told about it.
auto=("${common[@]}" --save-every 2 --keep 0 --no-export --resume auto)
# (A resume mid-run: torchrun_restart_test.sh. Here the same command again after the run
# ended: it resumes at the end, trains nothing, and keeps the metrics.)
"$strata" finetune "${auto[@]}" --steps 4 --out "$dir/auto" >"$dir/auto1.log" 2>&1 ||
  fail "--resume auto into a new out dir: $(tail -3 "$dir/auto1.log")"
"$strata" finetune "${auto[@]}" --steps 4 --out "$dir/auto" >"$dir/auto2.log" 2>&1 ||
  fail "--resume auto after the run ended: $(tail -3 "$dir/auto2.log")"
n=$(grep -c '"event":"train"' "$dir/auto/metrics.jsonl")
[[ $n -eq 4 ]] || fail "--resume auto: $n train lines after 4 steps and a resume at the end, not 4"
grep -q '^done: 4 steps' "$dir/auto2.log" || fail "--resume auto at the end: $(tail -2 "$dir/auto2.log")"
"$strata" finetune "${common[@]}" --steps 2 --no-export --out "$dir/auto-nock" >/dev/null 2>&1 ||
  fail "a run without checkpoints failed"
expect_error "--resume auto: out dir $dir/auto-nock holds an earlier run (metrics.jsonl, run.json, run " \
  "${auto[@]}" --steps 3 --out "$dir/auto-nock"
expect_error "but no checkpoint to continue from: start over with --overwrite" "${auto[@]}" --steps 3 --out "$dir/auto-nock"
# Without --resume auto the same: no checkpoint, so no advice to --resume it.
expect_error "$dir/auto-nock holds an earlier run (metrics.jsonl, run.json, run " "${common[@]}" --steps 3 --no-export \
  --out "$dir/auto-nock"
out=$("$strata" finetune "${common[@]}" --steps 3 --no-export --out "$dir/auto-nock" 2>&1)
[[ $out == *"but no checkpoint to continue from"* && $out != *"--resume"* ]] ||
  fail "an out dir without checkpoints: the refusal should not advise --resume: $out"
# A damaged checkpoint is an error, never a start over (not even with --overwrite, which
# would remove it).
cp -r "$dir/auto" "$dir/auto-bad"
for c in "$dir"/auto-bad/checkpoint-*; do printf 'garbage' >"$c/index.json"; done
expect_error "--resume auto: resume: $dir/auto-bad holds no usable checkpoint" "${auto[@]}" --steps 4 --out "$dir/auto-bad"
expect_error "never starts over where OUT holds checkpoints, even with --overwrite" "${auto[@]}" --steps 4 --overwrite \
  --out "$dir/auto-bad"
[[ -e $dir/auto-bad/checkpoint-4/index.json ]] || fail "--resume auto --overwrite removed a damaged checkpoint"
"$strata" finetune "${auto[@]}" --steps 3 --overwrite --out "$dir/auto-nock" >"$dir/auto3.log" 2>&1 ||
  fail "--resume auto --overwrite over a run without checkpoints: $(tail -3 "$dir/auto3.log")"
out=$(TORCHELASTIC_RESTART_COUNT=1 "$strata" finetune "${common[@]}" --steps 3 --out "$dir/auto-nock" 2>&1)
[[ $out == *"torchrun restarted this job, TORCHELASTIC_RESTART_COUNT=1: --resume auto continues from OUT's newest checkpoint"* ]] ||
  fail "a torchrun restart without --resume auto is not told about it: $out"

# A metrics file whose disk fills up mid-run (a 4 KiB tmpfs, in a mount namespace of
# its own): the run saves a checkpoint, fails naming the file and the checkpoint, and
# resuming (the file moved to where there is room) finishes with the straight run's
# losses (the train line of the step that failed is lost).
if unshare -m true 2>/dev/null; then
  mkdir -p "$dir/tiny"
  out=$(unshare -m bash -c 'mount -t tmpfs -o size=4k tmpfs "$1" && shift && "$@"' _ "$dir/tiny" \
    "$strata" finetune "${job[@]}" --metrics "$dir/tiny/metrics.jsonl" --out "$dir/mfull" 2>&1; echo "rc=$?")
  [[ $out == *"metrics file $dir/tiny/metrics.jsonl: cannot write the train line at step "*": No space left on device; the trained state is saved in $dir/mfull/checkpoint-"*": resume with --resume $dir/mfull once the metrics file can be written"*"rc=1" ]] ||
    fail "metrics on a full disk: $out"
  # (The tmpfs went with its namespace: the lines it held are gone; none is needed.)
  "$strata" finetune "${job[@]}" --out "$dir/mfull" --resume "$dir/mfull" >"$dir/mfull.log" 2>&1 ||
    fail "resume after the metrics disk filled up failed: $(tail -5 "$dir/mfull.log")"
  a=$(train_lines "$dir/straight/metrics.jsonl" | tail -3)
  b=$(train_lines "$dir/mfull/metrics.jsonl" | tail -3)
  [[ $a == "$b" ]] || fail "the run stopped by a full metrics disk and resumed differs: $(diff <(echo "$a") <(echo "$b") | head -5)"
elif [[ "${STRATA_REQUIRE_NETNS:-0}" == "1" ]]; then
  fail "unshare -m failed (STRATA_REQUIRE_NETNS=1: namespaces are required)"
else
  echo "note: no mount namespace (unshare -m needs root): the full-metrics-disk check is skipped"
fi

# A tiny stack limit: refused with a message (a SIGSEGV in Eigen's GEMM once);
# a soft limit the hard one lets it raise is raised.
out=$( (ulimit -s 128; "$strata" finetune "${common[@]}" --steps 1 --out "$dir/stack1" 2>&1); echo "rc=$?")
[[ $out == *"stack size limit (ulimit -s) is 128 KiB"*"rc=1" ]] || fail "ulimit -s 128: $out"
out=$( (ulimit -S -s 128; "$strata" finetune "${common[@]}" --steps 1 --out "$dir/stack2" 2>&1); echo "rc=$?")
[[ $out == *"rc=0" ]] || fail "ulimit -S -s 128 (hard limit higher): $out"

cli_finish "finetune CLI"
