#!/usr/bin/env bash
# `strata bench adam` as a user meets it: every bad input is a clear error
# with exit status 1, never a crash or an out-of-memory kill.
#   bench_adam_cli_test.sh STRATA_BINARY
set -uo pipefail
strata=${1:?usage: bench_adam_cli_test.sh STRATA_BINARY}
source "$(dirname "${BASH_SOURCE[0]}")/../cli_lib.sh"
cli_command "$strata" bench adam

expect_error "--params must be > 0" --params 0
expect_error "--params '-5'" --params -5
expect_error "--params 'abc'" --params abc
expect_error "--threads '-1'" --params 1K --threads -1
expect_error "--threads '5000'" --params 1K --threads 5000
expect_error "--iters '0'" --params 1K --iters 0
expect_error "--grad" --params 1K --grad fp64
expect_error "--states 'fp16'" --params 1K --states fp16
expect_error "--optimizer" --params 1K --optimizer rmsprop
expect_error "exclusive" --params 1K --out-bf16 --out-fp16
expect_error "--isa" --params 1K --isa sse
# 2^62+1 parameters: the byte sizes used to wrap to a few bytes, and the step
# then ran off the end of them (a segmentation fault).
expect_error "at most 1T" --params 4611686018427387905
# More than this machine holds: refused before anything is touched, not an
# out-of-memory kill halfway.
expect_error "of memory" --params 1T

out=$(timeout 120 "$strata" bench adam --params 64K --threads 1 --iters 2 --json 2>&1)
rc=$?
[[ $rc -eq 0 ]] || fail "a small run exited $rc: $out"
for k in params_per_s gbps ceiling_gbps ratio; do
  [[ $out == *"\"$k\""* ]] || fail "--json lacks $k: $out"
done

cli_finish "bench adam command-line"
