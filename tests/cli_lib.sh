# Shared helpers for the command-line tests (sourced, not run):
#   source "$(dirname "$0")/../cli_lib.sh"
#   cli_command "$strata" bench adam        # what expect_error runs
#   cli_clean_dir "$dir"                    # optional: expect_error checks it stays empty
#   expect_error "text the message must contain" args...
#   fail "what went wrong"
#   cli_finish "name of the checks"         # exit 1 on failures, 0 otherwise
#   cli_small_model_and_data "$strata" DIR  # DIR/model (2 layers, tied) and DIR/data.txt (~60 KB)
#   cli_ranks_reference "$strata" DIR       # the 1-rank run 2-rank finetunes are checked against
#   cli_same_as_one_rank DIR NAME WHAT      # DIR/NAME's exported model is DIR/one's
# Exit status convention: 0 pass, 1 fail, 77 skip (ctest SKIP_RETURN_CODE).

failures=0
cli_cmd=()
cli_dir=""
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
cli_command() { cli_cmd=("$@"); }
cli_clean_dir() { cli_dir=$1; }

# A bad input must exit with status 1 (not a crash, not a signal) and say
# what is wrong; with cli_clean_dir set, it must also leave nothing behind.
expect_error() {
  local want=$1
  shift
  local out rc
  out=$(timeout 60 "${cli_cmd[@]}" "$@" 2>&1)
  rc=$?
  local what="${cli_cmd[*]:1} $*"
  if [[ $rc -ne 1 ]]; then fail "$what exited $rc, not 1: $out"; return; fi
  [[ $out == *"$want"* ]] || fail "$what: message lacks '$want': $out"
  if [[ -n $cli_dir && -n $(ls -A "$cli_dir") ]]; then
    fail "$what left files: $(ls -A "$cli_dir")"
    rm -rf "${cli_dir:?}"/*
  fi
}

cli_finish() {
  if ((failures)); then
    echo "$failures failure(s)"
    exit 1
  fi
  echo "all $1 checks passed"
  exit 0
}

# A small model (2 layers, dim 64, tied embeddings, fp32) and text data
# (sentences from a fixed list, ~60 KB): DIR/model, DIR/data.txt.
cli_small_model_and_data() {
  local strata=$1 d=$2 i
  "$strata" init-model --layers 2 --dim 64 --heads 4 --kv-heads 2 --ffn-dim 160 --vocab 256 --dtype fp32 \
    --tie-embeddings --seed 5 --out "$d/model" >/dev/null || return 1
  local words=(cat dog bird fox owl fish)
  for ((i = 0; i < 2000; i++)); do
    echo "the ${words[i % 6]} sees the ${words[(i * 7 + i / 6) % 6]} . $((i % 10)) plus $((i / 10 % 10)) is $((i % 10 + i / 10 % 10)) ."
  done >"$d/data.txt"
}

# The multi-host finetune tests' reference: the small model and data in DIR,
# cli_ranks_flags (the finetune flags both runs share; 2 ranks add --batch 2)
# and DIR/one, one rank with --batch 2 --grad-accum 2, the micro-batches 2
# ranks of --batch 2 take. Exits 1 when the model cannot be made.
cli_ranks_reference() {
  local strata=$1 d=$2
  cli_small_model_and_data "$strata" "$d" || { echo "init-model failed"; exit 1; }
  cli_ranks_flags=(--model "$d/model" --data "$d/data.txt" --seq 64 --lr 3e-3 --progress quiet --eval-batches 2
    --threads 1 --steps 4)
  "$strata" finetune "${cli_ranks_flags[@]}" --batch 2 --grad-accum 2 --out "$d/one" >"$d/one.log" 2>&1 ||
    fail "1-rank run: $(tail -5 "$d/one.log")"
}

# DIR/NAME's exported model equals cli_ranks_reference's, byte for byte.
cli_same_as_one_rank() {
  cmp -s "$1/one/model/model.safetensors" "$1/$2/model/model.safetensors" ||
    fail "$3: the model differs from the 1-rank run's"
}
