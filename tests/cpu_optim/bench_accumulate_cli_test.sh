#!/usr/bin/env bash
# `strata bench accumulate` as a user meets it: bad inputs are clear errors
# with exit status 1, a small run prints its figures.
#   bench_accumulate_cli_test.sh STRATA_BINARY
set -uo pipefail
strata=${1:?usage: bench_accumulate_cli_test.sh STRATA_BINARY}
source "$(dirname "${BASH_SOURCE[0]}")/../cli_lib.sh"
cli_command "$strata" bench accumulate

expect_error "--elements '0'" --elements 0
expect_error "--elements 'abc'" --elements abc
expect_error "--elements '-5'" --elements -5
expect_error "--threads" --elements 1K --threads -1
expect_error "--iters" --elements 1K --iters 0
expect_error "--grad" --elements 1K --grad fp64
expect_error "of memory" --elements 60G

out=$(timeout 120 "$strata" bench accumulate --elements 100K --threads 1 --iters 2 --json 2>&1)
rc=$?
[[ $rc -eq 0 ]] || fail "a small run exited $rc: $out"
for k in gbps old_loop_gbps ceiling_gbps ratio speedup_vs_old_loop; do
  [[ $out == *"\"$k\""* ]] || fail "--json lacks $k: $out"
done

cli_finish "bench accumulate command-line"
