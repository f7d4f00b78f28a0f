#!/usr/bin/env bash
# `strata init-model` and `strata plan` as a user meets them: a model written
# by init-model opens (checked by the `strata plan --model DIR` path and the
# file layout), a 70B plan fits with NVMe and refuses plainly without enough,
# bad flags exit 1 with a message.
#   model_cli_test.sh STRATA_BINARY DATA_DIR
# Exit 0 pass, 1 fail, 77 skip (ctest SKIP_RETURN_CODE).
set -uo pipefail
strata=${1:?usage: model_cli_test.sh STRATA_BINARY DATA_DIR}
data=${2:?usage: model_cli_test.sh STRATA_BINARY DATA_DIR}
root=${STRATA_TEST_DIR:-/tmp}
dir=$(mktemp -d "$root/strata-model-cli.XXXXXX") || exit 1
trap 'rm -rf "$dir"' EXIT
source "$(dirname "${BASH_SOURCE[0]}")/../cli_lib.sh"
cfg70=$data/llama-70b-config.json

# ---- init-model
cli_command "$strata" init-model
out=$("$strata" init-model --help 2>&1) || fail "init-model --help exited $?"
for flag in --layers --dim --heads --kv-heads --ffn-dim --vocab --max-seq --dtype --seed --tie-embeddings \
  --max-shard-size --force --out; do
  [[ $out == *"$flag"* ]] || fail "init-model --help does not list $flag"
done
out=$("$strata" init-model --layers 2 --dim 64 --heads 4 --kv-heads 2 --ffn-dim 96 --vocab 256 --seed 3 \
  --out "$dir/m" 2>&1) || fail "init-model exited $?: $out"
[[ -f $dir/m/config.json && -f $dir/m/model.safetensors ]] || fail "init-model wrote: $(ls "$dir/m")"
[[ $(grep -c '"num_key_value_heads": 2' "$dir/m/config.json") == 1 ]] || fail "config.json: $(cat "$dir/m/config.json")"
# Same seed, same bytes; another seed, other bytes.
"$strata" init-model --layers 2 --dim 64 --heads 4 --kv-heads 2 --ffn-dim 96 --seed 3 --out "$dir/m2" >/dev/null 2>&1
cmp -s "$dir/m/model.safetensors" "$dir/m2/model.safetensors" || fail "the same --seed gave different weights"
"$strata" init-model --layers 2 --dim 64 --heads 4 --kv-heads 2 --ffn-dim 96 --seed 4 --out "$dir/m2" --force >/dev/null 2>&1
cmp -s "$dir/m/model.safetensors" "$dir/m2/model.safetensors" && fail "--seed 3 and --seed 4 gave the same weights"
# Shards: an index and several files, no single file left from before.
"$strata" init-model --layers 2 --dim 64 --heads 4 --kv-heads 2 --ffn-dim 96 --max-shard-size 64KiB --force \
  --out "$dir/m2" >/dev/null 2>&1 || fail "init-model --max-shard-size failed"
[[ -f $dir/m2/model.safetensors.index.json && ! -e $dir/m2/model.safetensors ]] || fail "sharded layout: $(ls "$dir/m2")"
[[ $(ls "$dir/m2" | grep -c '^model-0.*safetensors$') -gt 1 ]] || fail "expected several shards: $(ls "$dir/m2")"
expect_error "is not empty; use --force" --out "$dir/m"
expect_error "--dim 66 is not divisible by --heads 4" --dim 66 --heads 4 --out "$dir/bad"
expect_error "--kv-heads" --heads 4 --kv-heads 3 --out "$dir/bad"
expect_error "--dtype" --dtype int8 --out "$dir/bad"
expect_error "--max-shard-size" --max-shard-size 12XB --out "$dir/bad"
expect_error "--layers" --layers 0 --out "$dir/bad"
expect_error "--layers" --layers abc --out "$dir/bad"
touch "$dir/file"
expect_error "is not a directory" --out "$dir/file"
# A model larger than the disk's free space (64 TiB) is refused before writing.
expect_error "(35184372237504 parameters as bf16), and $dir/bad has" --dim 64 --heads 4 --layers 1 \
  --vocab 549755813888 --tie-embeddings --out "$dir/bad"
[[ ! -e $dir/bad ]] || fail "a refused init-model left $dir/bad"
# A stop signal mid-write: exit 130, and neither the temp file nor the
# directory it made is left (a 512 MB model, stopped once its file appears).
"$strata" init-model --dim 128 --heads 4 --layers 1 --vocab 2000000 --tie-embeddings --out "$dir/big" \
  >"$dir/big.log" 2>&1 &
pid=$!
for ((i = 0; i < 600; i++)); do
  compgen -G "$dir/big/model.safetensors.tmp.*" >/dev/null && break
  sleep 0.05
done
kill -TERM $pid
wait $pid
rc=$?
[[ $rc == 130 ]] || fail "init-model stopped by SIGTERM exited $rc, not 130: $(cat "$dir/big.log")"
grep -q "interrupted (a stop signal) while writing the weights" "$dir/big.log" || fail "no stop message: $(cat "$dir/big.log")"
[[ ! -e $dir/big ]] || fail "a stopped init-model left: $(ls -A "$dir/big")"

# The model directory it wrote plans (config read from the directory).
cli_command "$strata" plan
out=$("$strata" plan --model "$dir/m" --gpu-mem 8GiB --host-mem 8GiB --no-measure 2>&1) || fail "plan of init-model output: $out"
[[ $out == *"2 layers, dim 64"* ]] || fail "plan --model DIR did not read the model: $out"
[[ $out == *"weights in $dir/m checked: 21 tensors match"* ]] || fail "plan did not check the weights: $out"
out=$("$strata" plan --model "$dir/m2" --gpu-mem 8GiB --host-mem 8GiB --no-measure 2>&1) || fail "plan of shards: $out"
[[ $out == *"weights in $dir/m2 checked: 21 tensors match"* ]] || fail "plan did not check sharded weights: $out"
# A damaged model directory is refused with what is wrong.
cp -r "$dir/m" "$dir/broken"
truncate -s -1 "$dir/broken/model.safetensors"
expect_error "run past the end of the data region" --model "$dir/broken" --gpu-mem 8GiB --no-measure
truncate -s 100 "$dir/broken/model.safetensors"
expect_error "truncated?" --model "$dir/broken" --gpu-mem 8GiB --no-measure
sed -i 's/"intermediate_size": 96/"intermediate_size": 128/' "$dir/broken/config.json"
cp "$dir/m/model.safetensors" "$dir/broken/"
expect_error "wrong shape (6)" --model "$dir/broken" --gpu-mem 8GiB --no-measure

# --nvme naming a file, or nothing: each said as it is.
out=$("$strata" plan --model "$dir/m" --gpu-mem 8GiB --no-measure --nvme "$dir/m/config.json" 2>&1) &&
  fail "plan --nvme FILE succeeded: $out"
[[ $out == *"NVMe directory $dir/m/config.json is not a directory"* ]] || fail "plan --nvme FILE: $out"
out=$("$strata" plan --model "$dir/m" --gpu-mem 8GiB --no-measure --nvme "$dir/none" 2>&1) &&
  fail "plan --nvme MISSING succeeded: $out"
[[ $out == *"NVMe directory $dir/none does not exist"* ]] || fail "plan --nvme MISSING: $out"

out=$("$strata" plan --model "$dir/m" --gpu-mem 8GiB --no-measure --world-size 2 --ranks-per-host 3 2>&1) &&
  fail "plan --ranks-per-host 3 --world-size 2 succeeded: $out"
[[ $out == *"--ranks-per-host 3 is more than the 2 rank(s) of --world-size"* ]] || fail "plan --ranks-per-host: $out"

# ---- plan: a 70B model fits on 24 GiB GPU + 64 GiB host + 2 TB NVMe...
mkdir -p "$dir/nvme"
out=$("$strata" plan --model "$cfg70" --gpu-mem 24GiB --host-mem 64GiB --nvme "$dir/nvme" --nvme-capacity 2TB \
  --no-measure 2>&1)
rc=$?
[[ $rc -eq 0 ]] || fail "70B with 2 TB NVMe exited $rc: $out"
[[ $out == *"69.0 B parameters"* ]] || fail "70B plan lacks the parameter count: $out"
[[ $out == *"Predicted:"*"tokens/s"* ]] || fail "70B plan lacks the prediction: $out"
[[ $out == *"assumed"* ]] || fail "70B plan does not say which figures are assumed: $out"
out=$("$strata" plan --model "$cfg70" --gpu-mem 24GiB --host-mem 64GiB --nvme "$dir/nvme" --nvme-capacity 2TB \
  --no-measure --json 2>&1) || fail "--json exited $?"
[[ $out == *'"fits": true'* && $out == *'"total_s"'* && $out == *'"nvme_total"'* ]] || fail "--json output: $out"
# ...measured bandwidths (a short O_DIRECT test and CPU AdamW) when not given.
out=$("$strata" plan --model "$cfg70" --gpu-mem 24GiB --host-mem 64GiB --nvme "$dir/nvme" --nvme-capacity 2TB \
  --measure-size 32MiB 2>&1) || fail "measured plan exited $?: $out"
[[ $out == *"NVMe read"*"measured"* || $out == *"NVMe not measured"* ]] || fail "NVMe read not measured: $out"
[[ $out == *"CPU optimizer"*"measured"* ]] || fail "CPU optimizer not measured: $out"
[[ -z $(ls -A "$dir/nvme") ]] || fail "the measurement left files: $(ls -A "$dir/nvme")"
# ...and refuses with too little NVMe, naming the shortfall and the fix.
expect_error "short; add a directory or use bf16 optimizer states" --model "$cfg70" --gpu-mem 24GiB --host-mem 64GiB \
  --nvme "$dir/nvme" --nvme-capacity 500GB --no-measure
expect_error "does not fit" --model "$cfg70" --gpu-mem 24GiB --host-mem 64GiB --no-measure
expect_error "--nvme DIR" --model "$cfg70" --gpu-mem 24GiB --host-mem 64GiB --no-measure

# ---- plan reserves what strata finetune holds beside the placement: its
# activations grow with batch x seq, and a run they do not leave room for is
# refused naming them.
out=$("$strata" plan --model "$cfg70" --gpu-mem 24GiB --host-mem 512GiB --nvme "$dir/nvme" --nvme-capacity 2TB \
  --no-measure --batch 1 --seq 2048 2>&1) || fail "plan at 1 x 2048 exited $?: $out"
[[ $out == *"device reserve"*"activation buffers for batch 1 x seq 2048"* ]] || fail "no reserve note: $out"
expect_error "a smaller --batch or --seq lowers it" --model "$cfg70" --gpu-mem 24GiB --host-mem 512GiB \
  --nvme "$dir/nvme" --nvme-capacity 2TB --no-measure --batch 64 --seq 8192

# ---- plan: bad flags
expect_error "--model is required" --gpu-mem 24GiB
expect_error "--gpu-mem is required" --model "$cfg70" --host-mem 64GiB
expect_error "--gpu-mem" --model "$cfg70" --gpu-mem 24XB
expect_error "--host-mem" --model "$cfg70" --gpu-mem 24GiB --host-mem lots
expect_error "$dir/missing/config.json" --model "$dir/missing/config.json" --gpu-mem 24GiB
expect_error "does not exist" --model "$cfg70" --gpu-mem 24GiB --host-mem 64GiB --nvme "$dir/missing"
expect_error "2 sizes for 1 directories" --model "$cfg70" --gpu-mem 24GiB --nvme "$dir/nvme" --nvme-capacity 1TB,2TB
expect_error "--optimizer-states" --model "$cfg70" --gpu-mem 24GiB --optimizer-states fp16
expect_error "--batch: is 0: give a positive number" --model "$cfg70" --gpu-mem 24GiB --batch 0
expect_error "--h2d-gbps: is -3: give a positive number" --model "$cfg70" --gpu-mem 24GiB --h2d-gbps -3
# An explicit 0 is no setting (it once meant "the default", silently).
for f in --world-size --grad-accum --h2d-gbps --gpu-tflops --cpu-adam-params-per-s --link-gbps; do
  expect_error "$f: is 0: give a positive number" --model "$cfg70" --gpu-mem 24GiB $f 0
done
expect_error "--device cpu --no-measure: give --gpu-tflops" --model "$cfg70" --gpu-mem 24GiB --device cpu --no-measure
expect_error "--threads must be 0 (all) or more" --model "$cfg70" --gpu-mem 24GiB --device cpu --threads -2
expect_error "--device" --model "$cfg70" --gpu-mem 24GiB --device tpu
# What strata finetune refuses is not planned: a sequence past a Mistral's sliding window
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4096); json.dump(c, open(sys.argv[2], "w"))' \
  "$cfg70" "$dir/mistral-sw.json"
expect_error '"sliding_window" is 4096, shorter than the sequence length 8192' --model "$dir/mistral-sw.json" \
  --gpu-mem 80GiB --host-mem 256GiB --no-measure --seq 8192
# A quantized checkpoint is refused by name, not planned as if its weights were bf16.
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["quantization_config"] = {"quant_method": "awq", "bits": 4}; json.dump(c, open(sys.argv[2], "w"))' \
  "$cfg70" "$dir/awq.json"
expect_error '"quantization_config" is present (quant_method "awq")' --model "$dir/awq.json" --gpu-mem 24GiB
# --json: a refusal is a JSON object on stdout too, never nothing
out=$("$strata" plan --model "$dir/missing/config.json" --gpu-mem 24GiB --json 2>/dev/null)
python3 -c 'import json, sys; j = json.loads(sys.argv[1]); assert j["fits"] is False and "config.json" in j["error"], j' "$out" ||
  fail "plan --json on a missing config printed: $out"
# ... and so is a flag the parser refuses (a misspelt flag, a bad number)
for bad in --gpu-memory --layers-typo; do
  out=$("$strata" plan --model "$cfg70" --json "$bad" 24GiB 2>/dev/null) && fail "plan --json $bad exited 0"
  python3 -c 'import json, sys; j = json.loads(sys.argv[1]); assert j["fits"] is False and sys.argv[2] in j["error"], j' \
    "$out" "$bad" || fail "plan --json with $bad printed: $out"
done
out=$("$strata" plan --model "$cfg70" --batch x1 --json 2>/dev/null) && fail "plan --batch x1 --json exited 0"
python3 -c 'import json, sys; j = json.loads(sys.argv[1]); assert j["fits"] is False and "--batch" in j["error"], j' \
  "$out" || fail "plan --json with --batch x1 printed: $out"

# ---- plan --device cpu (the host backend): copies are memcpys, measured, and
# add to the CPU's compute instead of overlapping it.
out=$("$strata" plan --model "$dir/m" --gpu-mem 4GiB --host-mem 8GiB --device cpu --gpu-tflops 0.1 --batch 2 \
  --seq 64 2>&1) || fail "plan --device cpu exited $?: $out"
[[ $out == *"measured (memcpy of 64 MiB on one thread"* ]] || fail "plan --device cpu did not measure memcpy: $out"
[[ $out == *"CPU compute"*" + host->device "*" + device->host "* ]] || fail "plan --device cpu does not add the copies: $out"
# Without --gpu-mem the "device" (RAM) gets the budget strata finetune --device cpu gives it
out=$("$strata" plan --model "$dir/m" --host-mem 8GiB --device cpu --gpu-tflops 0.1 --no-measure --batch 2 \
  --seq 64 2>&1) || fail "plan --device cpu without --gpu-mem exited $?: $out"
[[ $out == *"RAM, as strata finetune --device cpu sets it"* ]] || fail "plan --device cpu: no device budget note: $out"
[[ $out == *"take the cores that compute"* ]] || fail "plan --device cpu does not say why: $out"
# Without --gpu-tflops the CPU's rate is measured on the model's layer and head.
out=$("$strata" plan --model "$dir/m" --gpu-mem 4GiB --host-mem 8GiB --device cpu --threads 1 --batch 2 --seq 64 \
  --no-activation-checkpointing 2>&1) || fail "plan --device cpu (measured compute) exited $?: $out"
[[ $out == *"CPU (the device)"*"measured (1 thread, dim "*", batch 2 x seq 64: layer forward "*" head "* ]] ||
  fail "plan --device cpu did not measure the compute at the model's shape: $out"
out=$("$strata" plan --model "$dir/m" --gpu-mem 4GiB --host-mem 8GiB --device cpu --gpu-tflops 0.1 --no-measure \
  --json 2>&1) || fail "plan --device cpu --json exited $?: $out"
[[ $out == *'"device": "cpu"'* && $out == *'"source": "assumed"'* ]] || fail "plan --device cpu --json: $out"
# The config's DeepSpeed batch keys give the micro-batch and accumulation, as
# strata finetune takes them (--batch / --grad-accum stand for them).
printf '{"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3}' >"$dir/bs.json"
out=$("$strata" plan --model "$data/smollm-135m-config.json" --gpu-mem 24GiB --host-mem 64GiB --no-measure \
  --config "$dir/bs.json" 2>&1) || fail "plan --config with batch keys exited $?: $out"
[[ $out == *"batch 3 x seq 2048 = 6144 tokens per micro-batch, 4 micro-batch(es) per step"* ]] ||
  fail "plan --config does not take train_batch_size 12 / micro 3 as 3 x 4: $out"
expect_error "train_batch_size 12 is not --batch 5 x gradient_accumulation_steps 2 x 1 rank(s)" \
  --model "$data/smollm-135m-config.json" --gpu-mem 24GiB --host-mem 64GiB --no-measure --config "$dir/bs.json" \
  --batch 5
# LoRA: a frozen base; only the adapters are updated, downloaded and uploaded.
out=$("$strata" plan --model "$data/llama-3.1-8b-config.json" --gpu-mem 24GiB --host-mem 64GiB --no-measure \
  --lora-rank 16 2>&1) || fail "plan --lora-rank exited $?: $out"
[[ $out == *"LoRA rank 16 on q_proj,v_proj: 6.82 M trainable parameters, the base's 8.03 B frozen"* ]] ||
  fail "plan --lora-rank does not say what trains: $out"
[[ $out == *"optimizer: 6815744 elements on the CPU"* && $out == *"6 x frozen matmul weights"* ]] ||
  fail "plan --lora-rank updates or computes the frozen base: $out"
out=$("$strata" plan --model "$data/llama-3.1-8b-config.json" --gpu-mem 24GiB --host-mem 64GiB --no-measure \
  --lora-rank 8 --lora-targets all-linear --json 2>&1) || fail "plan --lora-targets all-linear exited $?: $out"
[[ $out == *'"lora_rank": 8'* && $out == *'"trainable_params": 20971520'* ]] || fail "plan --lora-targets --json: $out"
expect_error "--lora-targets: " --model "$cfg70" --gpu-mem 24GiB --lora-rank 8 --lora-targets q_proj,wq
expect_error "--lora-targets needs --lora-rank R" --model "$cfg70" --gpu-mem 24GiB --lora-targets q_proj
# Llama 3.1's llama3 RoPE is implemented: planning proceeds without a note.
out=$("$strata" plan --model "$data/llama-3.1-8b-config.json" --gpu-mem 80GB --host-mem 256GiB --no-measure 2>&1) ||
  fail "8B plan exited $?: $out"
[[ $out != *"rope_scaling is ignored"* ]] || fail "8B plan calls its llama3 RoPE unsupported: $out"
# A RoPE type Strata does not train (dynamic) does not change shapes: planning
# proceeds and says so.
sed 's/"rope_type": "llama3"/"rope_type": "dynamic"/' "$data/llama-3.1-8b-config.json" >"$dir/dynamic.json"
grep -q '"dynamic"' "$dir/dynamic.json" || fail "could not make the dynamic-RoPE config"
out=$("$strata" plan --model "$dir/dynamic.json" --gpu-mem 80GB --host-mem 256GiB --no-measure 2>&1) ||
  fail "dynamic-RoPE plan exited $?: $out"
[[ $out == *"rope_scaling is ignored for planning"* ]] || fail "dynamic-RoPE plan does not mention it: $out"
[[ $out == *"strata finetune refuses this model: "*"dynamic"* ]] || fail "dynamic-RoPE plan does not say finetune refuses it: $out"
echo '{"hidden_size": 64}' >"$dir/bad.json"
expect_error "\"intermediate_size\" is missing" --model "$dir/bad.json" --gpu-mem 24GiB
expect_error "--nope" --model "$cfg70" --nope

cli_finish "init-model/plan"
