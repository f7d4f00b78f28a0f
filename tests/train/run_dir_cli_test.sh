#!/usr/bin/env bash
# The out dir of `strata finetune` as an unlucky user meets it (issue 10):
#   - a fresh run into an out dir holding another run is refused (--overwrite
#     starts over); --resume continues only its own run's checkpoints;
#   - a resumed run with another lr/steps/model config/windows is refused,
#     naming the setting;
#   - two jobs on one out dir: the second fails at once, naming the first's pid;
#   - what a dead job left (checkpoint staging, export temp files) is removed
#     at start; odd names in the out dir do not crash it;
#   - counts that make no sense are refused by name before any work;
#   - a run whose every step is skipped (non-finite gradients) fails, not "done".
#   run_dir_cli_test.sh STRATA_BINARY
# Exit 0 pass, 1 fail.
set -uo pipefail
strata=${1:?usage: run_dir_cli_test.sh STRATA_BINARY}
root=${STRATA_TEST_DIR:-/tmp}
dir=$(mktemp -d "$root/strata-run-dir-cli.XXXXXX") || exit 1
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  rm -rf "$dir"
}
trap cleanup EXIT
source "$(dirname "${BASH_SOURCE[0]}")/../cli_lib.sh"
cli_command "$strata" finetune

"$strata" init-model --layers 2 --dim 32 --heads 2 --kv-heads 1 --ffn-dim 64 --vocab 256 --dtype fp32 \
  --seed 3 --out "$dir/model" >/dev/null || { echo "init-model failed"; exit 1; }
for ((i = 0; i < 800; i++)); do echo "line $i of the run-dir test: $((i * 7 % 13)) apples and $((i % 5)) pears."; done >"$dir/data.txt"
common=(--model "$dir/model" --data "$dir/data.txt" --seq 32 --batch 4 --progress quiet --no-export)
run() { "$strata" finetune "${common[@]}" "$@" >"$dir/last.log" 2>&1; }

# ---- another run's out dir
run --steps 8 --save-every 4 --lr 1e-3 --out "$dir/a" || fail "run A failed: $(cat "$dir/last.log")"
[[ -f $dir/a/run.json ]] || fail "run A wrote no run.json"
expect_error "holds an earlier run" "${common[@]}" --steps 8 --lr 2e-3 --out "$dir/a"
[[ -d $dir/a/checkpoint-8 ]] || fail "the refused run touched run A's checkpoints"
# --resume continues the same run only: another lr or step count is another run.
expect_error "schedule.lr = 0.001, this run has 0.002" "${common[@]}" --steps 8 --lr 2e-3 --out "$dir/a" --resume "$dir/a"
expect_error "schedule.total = 8, this run has 12" "${common[@]}" --steps 12 --lr 1e-3 --out "$dir/a" --resume "$dir/a"
# The batch a checkpoint holds is the global one (--batch x ranks): the message says so.
batch2=("${common[@]}")
[[ ${batch2[6]} == --batch ]] && batch2[7]=2
expect_error "batch = 4, this run has 2 (the global batch: --batch 2 x 1 rank(s))" "${batch2[@]}" --steps 8 \
  --lr 1e-3 --out "$dir/a" --resume "$dir/a"
# Another model of the same shapes (its RoPE base changed) is another run too, and so is
# cutting the windows by document where the run packed them.
cp -r "$dir/model" "$dir/model-theta"
python3 -c 'import json, sys; p = sys.argv[1]; c = json.load(open(p)); c["rope_theta"] = 500000.0; json.dump(c, open(p, "w"))' \
  "$dir/model-theta/config.json"
expect_error 'model.rope = "default theta=10000' "${common[@]/$dir\/model/$dir/model-theta}" --steps 8 --lr 1e-3 \
  --out "$dir/a" --resume "$dir/a"
python3 -c 'import os, struct, sys; n = os.path.getsize(sys.argv[1]); open(sys.argv[2], "wb").write(struct.pack("<2Q", 0, n - 200))' \
  "$dir/data.txt" "$dir/one.docs"
expect_error 'windows = "packed", this run has "by document"' "${common[@]}" --steps 8 --lr 1e-3 \
  --documents "$dir/one.docs" --out "$dir/a" --resume "$dir/a"
# Other data of the same size at the same path (the file reversed) is another run; the same file
# reached by another path is the same data (no warning).
cp "$dir/data.txt" "$dir/data.keep"
python3 -c 'import sys; p = sys.argv[1]; b = open(p, "rb").read(); open(p, "wb").write(b[::-1])' "$dir/data.txt"
expect_error "data_shape.crc32c = " "${common[@]}" --steps 8 --lr 1e-3 --out "$dir/a" --resume "$dir/a"
cp "$dir/data.keep" "$dir/data.txt"
(cd "$dir" && "$strata" finetune "${common[@]/$dir\/data.txt/data.txt}" --steps 8 --lr 1e-3 --out "$dir/a" \
  --resume "$dir/a" >"$dir/last.log" 2>&1) || fail "resume through a relative data path failed: $(cat "$dir/last.log")"
grep -q "trained on data" "$dir/last.log" && fail "the same data by another path warned: $(cat "$dir/last.log")"
# --overwrite starts over; then --resume of A's dir takes B's checkpoints, never A's.
id_a=$(sed -nE 's/.*"run_id": "([0-9a-f]+)".*/\1/p' "$dir/a/run.json")
cp -r "$dir/a/checkpoint-8" "$dir/a-checkpoint-8"
run --steps 4 --save-every 4 --lr 2e-3 --out "$dir/a" --overwrite || fail "--overwrite failed: $(cat "$dir/last.log")"
id_b=$(sed -nE 's/.*"run_id": "([0-9a-f]+)".*/\1/p' "$dir/a/run.json")
[[ -n $id_b && $id_a != "$id_b" ]] || fail "--overwrite kept the run id ($id_a -> $id_b)"
[[ ! -e $dir/a/checkpoint-8 ]] || fail "--overwrite left run A's checkpoint-8"
mv "$dir/a-checkpoint-8" "$dir/a/checkpoint-8"  # another run's checkpoint, newer than B's
run --steps 4 --save-every 4 --lr 2e-3 --out "$dir/a" --resume "$dir/a" || fail "resume of B failed: $(cat "$dir/last.log")"
grep -q "skipped checkpoint-8" "$dir/last.log" || fail "resume did not say it skipped run A's checkpoint-8: $(cat "$dir/last.log")"
# And a resume into a dir of another run, from a checkpoint of A: refused.
expect_error "the checkpoint belongs to run $id_a" "${common[@]}" --steps 8 --lr 1e-3 --out "$dir/a" \
  --resume "$dir/a/checkpoint-8"

# ---- what a run that failed before its first step left (run.json, its metrics' plan line
# and step-0 evaluation: an I/O error or kill -9 in step 1) is no earlier run: the same
# command starts over there. One trained step in the metrics makes it one, and so does a
# line Strata does not write there (a blank one, an "event" that is not a string).
mkdir -p "$dir/early"
cp "$dir/a/run.json" "$dir/early/"
{
  grep -m1 '"event":"plan"' "$dir/a/metrics.jsonl"
  echo '{"batches":2,"event":"eval","seconds":0.01,"step":0,"tokens":256,"val_loss":5.5}'
} >"$dir/early/metrics.jsonl"
cp -r "$dir/early" "$dir/late"
grep -m1 '"event":"train"' "$dir/a/metrics.jsonl" >>"$dir/late/metrics.jsonl"
expect_error "out dir $dir/late holds an earlier run (metrics.jsonl, run.json, run $id_b)" "${common[@]}" \
  --steps 2 --out "$dir/late"
for odd in '' '{"event":null}' '{"event":"eval","step":"0"}'; do
  cp -r "$dir/early" "$dir/odd"
  echo "$odd" >>"$dir/odd/metrics.jsonl"
  expect_error "out dir $dir/odd holds an earlier run (metrics.jsonl, run.json, run $id_b)" "${common[@]}" \
    --steps 2 --out "$dir/odd"
  rm -rf "$dir/odd"
done
run --steps 2 --out "$dir/early" || fail "a run into what a run failed before step 1 left failed: $(cat "$dir/last.log")"
id_e=$(sed -nE 's/.*"run_id": "([0-9a-f]+)".*/\1/p' "$dir/early/run.json")
[[ -n $id_e && $id_e != "$id_b" ]] || fail "the run into an early-ended run's out dir kept its run id ($id_b -> $id_e)"
[[ $(grep -c '"event":"plan"' "$dir/early/metrics.jsonl") == 1 && $(grep -c '"event":"train"' "$dir/early/metrics.jsonl") == 2 ]] ||
  fail "the new run's metrics are not its own: $(cut -c1-80 "$dir/early/metrics.jsonl")"

# A new OUT whose run fails before its first step (here its first metrics line, on a full
# disk) is removed, as when the start fails: nothing trained, nothing saved.
if [[ -c /dev/full ]]; then
  expect_error "cannot write the plan line at step 0" "${common[@]}" --steps 2 --metrics /dev/full --out "$dir/new/full"
  [[ ! -e $dir/new ]] || fail "a run that failed before its first step left its new out dir: $(ls -AR "$dir/new")"
fi

# ---- --overwrite never removes an input of the run: continuing from one's own export
# (--model OUT/model --out OUT --overwrite) deleted the model before reading it.
"$strata" finetune --model "$dir/model" --data "$dir/data.txt" --seq 32 --batch 4 --progress quiet --steps 2 \
  --out "$dir/own" >"$dir/last.log" 2>&1 || fail "run own failed: $(cat "$dir/last.log")"
[[ -f $dir/own/model/config.json ]] || fail "run own exported no model"
sum_before=$(cat "$dir/own/model/"* | cksum)
expect_error "--overwrite would remove $dir/own/model, which holds --model $dir/own/model" \
  "${common[@]/$dir\/model/$dir/own/model}" --steps 2 --out "$dir/own" --overwrite
[[ $(cat "$dir/own/model/"* | cksum) == "$sum_before" ]] || fail "the refused --overwrite changed the model it reads"
echo '{}' >"$dir/own/model/ds.json"
expect_error "--overwrite would remove $dir/own/model, which holds --config $dir/own/model/ds.json" "${common[@]}" \
  --steps 2 --config "$dir/own/model/ds.json" --out "$dir/own" --overwrite
[[ -f $dir/own/model/ds.json ]] || fail "--overwrite removed the --config file it read"
# An earlier LoRA run's adapter/ is an earlier run's output too: refused, and removed by --overwrite.
run --steps 2 --lora-rank 2 --out "$dir/ad" || fail "LoRA run failed: $(cat "$dir/last.log")"
[[ -f $dir/ad/adapter/adapter_config.json ]] || fail "the LoRA run wrote no adapter"
rm -f "$dir/ad/run.json" "$dir/ad/metrics.jsonl"
expect_error "holds an earlier run (adapter" "${common[@]}" --steps 2 --out "$dir/ad"
run --steps 2 --out "$dir/ad" --overwrite || fail "--overwrite over an adapter failed: $(cat "$dir/last.log")"
[[ ! -e $dir/ad/adapter ]] || fail "--overwrite left the earlier run's adapter/"
# A user's own adapter/ (nothing a LoRA export writes) is neither an earlier run nor removed.
mkdir -p "$dir/ad2/adapter" && echo mine >"$dir/ad2/adapter/notes.txt"
run --steps 2 --out "$dir/ad2" --overwrite || fail "a run beside a user's adapter/ failed: $(cat "$dir/last.log")"
[[ -f $dir/ad2/adapter/notes.txt ]] || fail "--overwrite removed a user's adapter/ directory"

# ---- a run resumed where it ended: its metrics read as one run (one evaluation of the last
# step, not a second one appended), the validation loss printed once at the end as at the start.
run --steps 4 --save-every 4 --out "$dir/fin" || fail "run fin failed: $(cat "$dir/last.log")"
evals() { python3 -c 'import json, sys; print(sum(1 for l in open(sys.argv[1]) if json.loads(l).get("event") == "eval" and json.loads(l)["step"] == 4))' "$dir/fin/metrics.jsonl"; }
[[ $(evals) == 1 ]] || fail "the finished run wrote $(evals) evaluations of step 4"
cp "$dir/fin/metrics.jsonl" "$dir/fin.metrics"
run --steps 4 --save-every 4 --out "$dir/fin" --resume "$dir/fin" || fail "resume of fin failed: $(cat "$dir/last.log")"
cmp -s "$dir/fin/metrics.jsonl" "$dir/fin.metrics" || fail "resuming a finished run changed its metrics: $(diff "$dir/fin.metrics" "$dir/fin/metrics.jsonl")"
# Its evaluation lost (a run stopped after its last checkpoint skips it): the resume writes it.
grep -v '"event":"eval","step":4' "$dir/fin.metrics" >"$dir/fin/metrics.jsonl"
run --steps 4 --save-every 4 --out "$dir/fin" --resume "$dir/fin" || fail "resume of fin failed: $(cat "$dir/last.log")"
[[ $(evals) == 1 ]] || fail "a resume at the end wrote $(evals) evaluations of step 4 where the file had none"

# ---- a damaged newest checkpoint: the error names the older one that is intact
run --steps 8 --save-every 4 --keep 0 --lr 1e-3 --out "$dir/dmg" || fail "run dmg failed: $(cat "$dir/last.log")"
victim=$(find "$dir/dmg/checkpoint-8" -type f ! -name '*.json' | head -n 1)
printf 'XXXX' | dd of="$victim" bs=1 seek=16 conv=notrunc status=none
expect_error "$dir/dmg/checkpoint-4 is intact" "${common[@]}" --steps 8 --lr 1e-3 --out "$dir/dmg" --resume "$dir/dmg"
echo garbage >"$dir/dmg/checkpoint-8/manifest.rank0.json"
expect_error "the newest checkpoint is damaged" "${common[@]}" --steps 8 --lr 1e-3 --out "$dir/dmg" --resume "$dir/dmg"
expect_error "$dir/dmg/checkpoint-4 is intact" "${common[@]}" --steps 8 --lr 1e-3 --out "$dir/dmg" --resume "$dir/dmg"
# A newest checkpoint that lost its manifest, or its index, is damaged too (a save puts a
# checkpoint in place whole), never skipped as if a save had stopped midway.
mv "$dir/dmg/checkpoint-8/manifest.rank0.json" "$dir/manifest.keep"
expect_error "$dir/dmg/checkpoint-4 is intact" "${common[@]}" --steps 8 --lr 1e-3 --out "$dir/dmg" --resume "$dir/dmg"
rm "$dir/dmg/checkpoint-8/index.json"
expect_error "$dir/dmg/checkpoint-4 is intact" "${common[@]}" --steps 8 --lr 1e-3 --out "$dir/dmg" --resume "$dir/dmg"
# Every checkpoint damaged: the error names each and why.
echo garbage >"$dir/dmg/checkpoint-4/manifest.rank0.json"
expect_error "holds no usable checkpoint of its run" "${common[@]}" --steps 8 --lr 1e-3 --out "$dir/dmg" --resume "$dir/dmg"
expect_error "rejected: checkpoint-8 (damaged: " "${common[@]}" --steps 8 --lr 1e-3 --out "$dir/dmg" --resume "$dir/dmg"
expect_error "; checkpoint-4 (damaged: " "${common[@]}" --steps 8 --lr 1e-3 --out "$dir/dmg" --resume "$dir/dmg"

# ---- two jobs, one out dir: the second fails at once, naming the first.
"$strata" finetune "${common[@]}" --steps 100000 --out "$dir/busy" >"$dir/busy.log" 2>&1 &
pid=$!
pids+=("$pid")
for ((i = 0; i < 600; i++)); do
  grep -q "pid $pid" "$dir/busy/.strata.lock" 2>/dev/null && break
  sleep 0.05
done
expect_error "is in use by another strata job (pid $pid" "${common[@]}" --steps 4 --out "$dir/busy" --overwrite
kill -9 "$pid" 2>/dev/null
wait "$pid" 2>/dev/null
# The lock died with the job: the next one gets the dir.
run --steps 2 --out "$dir/busy" --overwrite || fail "the out dir stayed locked after kill -9: $(cat "$dir/last.log")"

# ---- leftovers of a dead job, odd names
mkdir -p "$dir/a/checkpoint-4.tmp-deadbeef/junk" "$dir/a/model" "$dir/a/checkpoint-99999999999999999999"
echo x >"$dir/a/checkpoint-4.tmp-deadbeef/junk/file"
echo x >"$dir/a/model/model.safetensors.tmp.999999999"
run --steps 4 --save-every 4 --lr 2e-3 --out "$dir/a" --resume "$dir/a" || fail "resume with leftovers failed: $(cat "$dir/last.log")"
[[ ! -e $dir/a/checkpoint-4.tmp-deadbeef ]] || fail "the dead save's staging dir was not removed"
[[ ! -e $dir/a/model/model.safetensors.tmp.999999999 ]] || fail "the dead export's temp file was not removed"

# ---- counts that make no sense: refused by name, before any work
for bad in "--save-every -1" "--eval-every -3" "--log-every -3" "--grad-accum 4294967295" \
  "--eval-batches 4294967295" "--threads -2"; do
  read -r flag value <<<"$bad"
  expect_error "$flag $value is outside" "${common[@]}" "$flag" "$value" --out "$dir/o-bad"
done
expect_error "--weight-decay nan must be finite" "${common[@]}" --weight-decay nan --out "$dir/o-bad"
cli_command env STRATA_CPU_ISA=neon "$strata" finetune
[[ $(uname -m) == aarch64 ]] || expect_error "STRATA_CPU_ISA" "${common[@]}" --out "$dir/o-bad"
cli_command "$strata" finetune

# ---- a NaN in the weights: refused at load, naming the tensor and the element
cp -r "$dir/model" "$dir/nan-model"
hl=$(od -An -t u8 -N8 "$dir/nan-model/model.safetensors" | tr -d ' ')
printf '\x00\x00\xc0\x7f' | dd of="$dir/nan-model/model.safetensors" bs=1 seek=$((8 + hl + 4 * 5)) conv=notrunc status=none
expect_error "holds a non-finite value (nan) at element" --model "$dir/nan-model" --data "$dir/data.txt" --seq 32 \
  --batch 4 --out "$dir/o-nan"

# ---- config.json ties the embeddings, but the file's lm_head.weight differs:
# refused (transformers 5 would untie them, 4.x use the embedding)
cp -r "$dir/model" "$dir/tied-model"
sed -i 's/"tie_word_embeddings": false/"tie_word_embeddings": true/' "$dir/tied-model/config.json"
expect_error "lm_head.weight differs from model.embed_tokens.weight (element 0:" --model "$dir/tied-model" \
  --data "$dir/data.txt" --seq 32 --batch 4 --out "$dir/o-tied"

# ---- a weight of 1e6 (element 5 of the embedding, the file's first tensor):
# fp16 compute copies cannot hold it (refused at load); an fp16 export of it
# fails naming it, and the run's last step is saved so the export can be redone
cp -r "$dir/model" "$dir/big-model"
printf '\x00\x24\x74\x49' | dd of="$dir/big-model/model.safetensors" bs=1 seek=$((8 + hl + 4 * 5)) conv=notrunc status=none
expect_error "holds 1000000 at element 5 of 8192, beyond fp16's range" --model "$dir/big-model" --data "$dir/data.txt" \
  --seq 32 --batch 4 --fp16 --out "$dir/o-big"
big=(--model "$dir/big-model" --data "$dir/data.txt" --seq 32 --batch 4 --lr 1e-4 --steps 2 --save-every 0
  --progress quiet --out "$dir/o-big")
expect_error "beyond fp16's range: it would be written as inf; export in bf16 or fp32 (--export-dtype); the trained \
state is saved in $dir/o-big/checkpoint-2: export it again with --resume $dir/o-big --steps 2" "${big[@]}" --export-dtype fp16
[[ ! -e $dir/o-big/model ]] || fail "a failed export left $dir/o-big/model: $(ls -A "$dir/o-big/model")"
"$strata" finetune "${big[@]}" --export-dtype bf16 --resume "$dir/o-big" >"$dir/last.log" 2>&1 ||
  fail "exporting again from the saved step failed: $(cat "$dir/last.log")"
[[ -s $dir/o-big/model/model.safetensors && -e $dir/o-big/model/config.json ]] || fail "no export after the resume"

# ---- FIFOs where files belong: refused at once, never waited on
mkdir -p "$dir/fifo-model" "$dir/fifo-weights"
mkfifo "$dir/fifo-model/config.json" "$dir/fifo.json"
cp "$dir/model/model.safetensors" "$dir/fifo-model/"
cp "$dir/model/config.json" "$dir/fifo-weights/"
mkfifo "$dir/fifo-weights/model.safetensors"
expect_error "config.json is not a regular file" --model "$dir/fifo-model" --data "$dir/data.txt" --out "$dir/o-fifo"
expect_error "model.safetensors is not a regular file" --model "$dir/fifo-weights" --data "$dir/data.txt" --out "$dir/o-fifo"
expect_error "config file $dir/fifo.json is not a regular file" "${common[@]}" --config "$dir/fifo.json" --out "$dir/o-fifo"

# ---- every step skipped: an error naming why, not a NaN model and exit 0
expect_error "steps in a row were skipped" "${common[@]}" --steps 30 --lr 1e30 --warmup 0 --schedule constant \
  --max-skipped-steps 3 --clip 0 --out "$dir/nan"

# ---- a demo killed with SIGKILL: its temp dir is reclaimed by the next demo
# --keep removes only this run's own checkpoints that hold nothing else: another run's checkpoint,
# a directory that only looks like a checkpoint and a checkpoint holding a user's file stay.
run --steps 1 --save-every 1 --lr 1e-3 --out "$dir/k0" || fail "run k0 failed: $(cat "$dir/last.log")"
run --steps 8 --save-every 1 --keep 0 --lr 1e-3 --out "$dir/k" || fail "run k failed: $(cat "$dir/last.log")"
mv "$dir/k0/checkpoint-1" "$dir/k/checkpoint-0"
rm -rf "$dir/k/checkpoint-1" && mkdir "$dir/k/checkpoint-1" && echo notes >"$dir/k/checkpoint-1/notes.txt"
echo "my eval" >"$dir/k/checkpoint-2/eval_results.json"
run --steps 8 --save-every 1 --keep 1 --lr 1e-3 --out "$dir/k" --resume "$dir/k/checkpoint-4" ||
  fail "resume k with --keep 1 failed: $(cat "$dir/last.log")"
[[ -d $dir/k/checkpoint-0 ]] || fail "--keep removed another run's checkpoint"
[[ -f $dir/k/checkpoint-1/notes.txt ]] || fail "--keep removed a directory that is not a checkpoint"
[[ -f $dir/k/checkpoint-2/eval_results.json ]] || fail "--keep removed a checkpoint holding a user's file"
[[ $(ls "$dir/k" | grep -c '^checkpoint-') == 4 && -d $dir/k/checkpoint-8 ]] ||
  fail "--keep 1 did not remove the run's own older checkpoints: $(ls "$dir/k")"
grep -q "leaving $dir/k/checkpoint-2 in place: it holds eval_results.json" "$dir/last.log" ||
  fail "--keep did not say what it left: $(cat "$dir/last.log")"
grep -q "leaving $dir/k/checkpoint-0 in place: it belongs to another run" "$dir/last.log" ||
  fail "--keep did not say it left another run's checkpoint: $(cat "$dir/last.log")"

mkdir -p "$dir/demos"
"$strata" demo --dir "$dir/demos" --quiet --steps 100000 >/dev/null 2>&1 &
pid=$!
pids+=("$pid")
for ((i = 0; i < 600; i++)); do
  compgen -G "$dir/demos/strata-demo-*/.strata-demo-owner" >/dev/null && break
  sleep 0.05
done
kill -9 "$pid" 2>/dev/null
wait "$pid" 2>/dev/null
dead=$(ls "$dir/demos")
# One step (kept short for the sanitizer builds): the demo then reports that
# the loss did not fall (exit 2); what matters here is what it reclaimed.
"$strata" demo --dir "$dir/demos" --quiet --steps 1 >"$dir/demo.log" 2>&1
rc=$?
((rc == 0 || rc == 2)) || fail "demo exited $rc: $(tail -3 "$dir/demo.log")"
[[ -z $(ls "$dir/demos") ]] || fail "the killed demo's directory $dead was not reclaimed: $(ls "$dir/demos")"
grep -q "left by a demo that died" "$dir/demo.log" || fail "the demo did not say what it reclaimed: $(head -3 "$dir/demo.log")"
# A thread count no machine has is refused before anything is made (100000 crashed the demo).
for t in 100000 -1; do
  "$strata" demo --dir "$dir/demos" --quiet --steps 1 --threads $t >"$dir/demo.log" 2>&1
  rc=$?
  ((rc == 1)) && grep -q -- "--threads $t is outside \[0, 65536\]" "$dir/demo.log" ||
    fail "demo --threads $t: exit $rc: $(tail -3 "$dir/demo.log")"
  [[ -z $(ls "$dir/demos") ]] || fail "demo --threads $t left $(ls "$dir/demos")"
done

cli_finish "run dir"
