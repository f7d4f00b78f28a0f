#!/usr/bin/env bash
# `strata bench io` as a user meets it: every bad input is a clear error with
# exit status 1 and no file left behind, and Ctrl-C (SIGINT) or SIGTERM in the
# middle of a run removes the test file.
#   bench_io_cli_test.sh STRATA_BINARY
# Exit 0 pass, 1 fail, 77 skip (ctest SKIP_RETURN_CODE).
set -uo pipefail
strata=${1:?usage: bench_io_cli_test.sh STRATA_BINARY}
root=${STRATA_TEST_DIR:-/tmp}
dir=$(mktemp -d "$root/strata-bench-io-cli.XXXXXX") || exit 1
trap 'rm -rf "$dir"' EXIT
source "$(dirname "${BASH_SOURCE[0]}")/../cli_lib.sh"
cli_command "$strata" bench io
cli_clean_dir "$dir"

touch "$dir/../strata-bench-io-cli-file.$$"
plain_file="$dir/../strata-bench-io-cli-file.$$"
expect_error "--dir is required"
expect_error "$dir/missing is not an existing directory" --dir "$dir/missing"
expect_error "is not an existing directory" --dir "$plain_file"
rm -f "$plain_file"
expect_error "--size must be more than 0" --dir "$dir" --size 0
expect_error "not a multiple of --block" --dir "$dir" --size 1000
expect_error "--block 3KiB" --dir "$dir" --size 1MiB --block 3KiB
expect_error "--size" --dir "$dir" --size 12XB
expect_error "--backend spdk" --dir "$dir" --size 1MiB --backend spdk
expect_error "--qd 0" --dir "$dir" --size 1MiB --qd 0
expect_error "--qd" --dir "$dir" --size 1MiB --qd -3
expect_error "--request 2GiB" --dir "$dir" --size 1MiB --request 2GiB
# Sizes near 2^64 used to wrap the free-space check and reach fallocate.
expect_error "not enough for a 18446744073708503040 test file" --dir "$dir" --size 18446744073708503040
# Buffers for 4096 x 64 MiB in flight (~1 TiB): more memory than a test
# machine has. This used to be found by the OOM killer (exit 137, the file
# left behind). The memory check comes before the free-space check, so this
# 1 PiB file can never be created even if the memory check goes wrong.
expect_error "of buffers" --dir "$dir" --size 1PiB --block 64MiB --qd 4096 --backend posix

# A small run works and cleans up after itself.
out=$(timeout 60 "$strata" bench io --dir "$dir" --size 4MiB --backend posix --json 2>&1)
rc=$?
if [[ $rc -ne 0 ]]; then
  if [[ $out == *"refuses O_DIRECT"* ]]; then echo "SKIP: $root refuses O_DIRECT (set STRATA_TEST_DIR)"; exit 77; fi
  fail "a 4 MiB posix run exited $rc: $out"
fi
[[ $out == *'"results"'* ]] || fail "--json output has no results list: $out"
[[ -z $(ls -A "$dir") ]] || fail "a clean run left files: $(ls -A "$dir")"

# A file-size limit (ulimit -f) is an error naming the file, not a SIGXFSZ
# kill (exit 153) that leaves the file behind.
out=$(ulimit -f 1024 && timeout 60 "$strata" bench io --dir "$dir" --size 64MiB --backend posix 2>&1)
rc=$?
[[ $rc -eq 1 ]] || fail "under ulimit -f: exit status $rc, not 1: $out"
[[ $out == *"File too large"* ]] || fail "under ulimit -f: message lacks 'File too large': $out"
[[ -z $(ls -A "$dir") ]] || fail "under ulimit -f: left files: $(ls -A "$dir")"
rm -rf "${dir:?}"/*

# Interrupted runs: the signal arrives as soon as the test file exists, while
# the run has (at qd 1 and 4 KiB blocks) seconds of I/O left. With job
# control on, a background job does not ignore SIGINT.
set -m
interrupted=0
for sig in INT TERM; do
  "$strata" bench io --dir "$dir" --size 256MiB --block 4KiB --request 4KiB --qd 1 --backend posix >/dev/null 2>&1 &
  pid=$!
  for _ in $(seq 1 1000); do
    compgen -G "$dir/strata-bench-io.*" >/dev/null && break
    sleep 0.01
  done
  kill -s "$sig" "$pid" 2>/dev/null
  wait "$pid"
  rc=$?
  want=$((128 + $(kill -l "$sig")))
  if [[ $rc -eq 0 ]]; then
    echo "note: the run finished before SIG$sig arrived"
  else
    interrupted=$((interrupted + 1))
    [[ $rc -eq $want ]] || fail "SIG$sig: exit status $rc, expected $want (killed by the signal)"
  fi
  [[ -z $(ls -A "$dir") ]] || fail "SIG$sig left files: $(ls -A "$dir")"
  rm -rf "${dir:?}"/*
done
set +m

if ((failures)); then
  echo "$failures failure(s)"
  exit 1
fi
if ((interrupted == 0)); then
  echo "SKIP: no run was interrupted (the runs finished too fast to test Ctrl-C)"
  exit 77
fi
echo "all bench io command-line checks passed"
