#!/usr/bin/env bash
# Ranks on separate hosts: network namespaces joined by a bridge stand in for
# hosts, Open MPI launches one rank in each (its rsh agent enters the
# namespace) and the ranks talk TCP over the bridge, as across machines (no
# shared-memory transport between them). Runs the engine's N-rank tests
# (test_engine_mpi) across 2 and 3 "hosts", and `strata finetune` across 2
# against a 1-rank run of 2 micro-batches (cmp of the exported models).
#   tests/runtime/netns_ranks_test.sh MPIRUN build/tests/runtime/test_engine_mpi build/tools/strata
# ctest engine_mpi_netns. The hosts: tests/netns_lib.sh (root, CAP_NET_ADMIN);
# exit 77 where they cannot be made, saying why (exit 1 instead with
# STRATA_REQUIRE_NETNS=1, as CI runs it). Exit 0 pass, 1 fail. With a
# hostname per namespace (netns_lib.sh says why) 17 of 17 runs passed here,
# 8 of them with both cores busy.
set -uo pipefail
mpirun_bin=${1:?usage: netns_ranks_test.sh MPIRUN TEST_ENGINE_MPI STRATA}
engine_test=${2:?}
strata=${3:?}
root=${STRATA_TEST_DIR:-/tmp}
dir=$(mktemp -d "$root/strata-netns.XXXXXX") || exit 1
here=$(dirname "${BASH_SOURCE[0]}")
source "$here/../cli_lib.sh"
source "$here/../netns_lib.sh"
trap 'netns_cleanup; rm -rf "$dir"' EXIT
trap 'exit 1' TERM INT HUP

netns_mpirun_bin=$mpirun_bin
if ! netns_hosts 3; then
  if [[ "${STRATA_REQUIRE_NETNS:-0}" == "1" ]]; then
    echo "FAIL (STRATA_REQUIRE_NETNS=1): $netns_error"
    exit 1
  fi
  echo "SKIP: $netns_error"
  exit 77
fi
((${#netns_mpirun[@]})) || { echo "FAIL: no mpirun ($mpirun_bin)"; exit 1; }
hosts=("${netns_addr[@]}")
mpirun=("${netns_mpirun[@]}")
net=$netns_net
# mpirun across the namespaces; once more if the job printed nothing before
# the timeout (a launch that never started: Open MPI's daemons, before any
# rank runs). A guard only: since each namespace has its own hostname no run
# here needed it (0 retries in 17); a retry says so in the log. Output is
# line-buffered, so a job that started always printed something.
launch() {  # LOG TIMEOUT ARGS...
  local log=$1 t=$2 rc
  shift 2
  for attempt in 1 2; do
    timeout "$t" "${mpirun[@]}" "$@" >"$log" 2>&1
    rc=$?
    [[ $rc -eq 124 && ! -s $log ]] || return $rc
    echo "note: launch attempt $attempt printed nothing in $t s; retrying"
    pkill -9 -f "orted.*$net" 2>/dev/null
  done
  return $rc
}

for n in 2 3; do
  hl=$(IFS=,; echo "${hosts[*]:0:n}")
  launch "$dir/engine$n.log" 300 --host "$hl" -np "$n" stdbuf -oL "$engine_test"
  [[ $(grep -o "PASSED  " "$dir/engine$n.log" | wc -l) -eq $n ]] ||
    fail "test_engine_mpi across $n hosts: $(grep -E "Failure|FAILED|rror" -A3 "$dir/engine$n.log" | head -20)$(tail -5 "$dir/engine$n.log")"
  # Each rank really sits in its own namespace (host).
  launch "$dir/addr$n.log" 60 --host "$hl" -np "$n" sh -c 'ip -4 -o addr show eth0'
  # Only the "inet A.B.C.D/24" of each rank counts: Open MPI may add its own
  # lines to the job's output (a warning), which are not addresses.
  addrs=$(grep -oE 'inet [0-9.]+/' "$dir/addr$n.log" | sort -u | wc -l)
  [[ $addrs -eq $n ]] || fail "$n ranks did not land in $n namespaces ($addrs addresses): $(head -c 2000 "$dir/addr$n.log")"
done

cli_ranks_reference "$strata" "$dir"
launch "$dir/two.log" 300 --host "${hosts[0]},${hosts[1]}" -np 2 stdbuf -oL "$strata" finetune \
  "${cli_ranks_flags[@]}" --batch 2 --out "$dir/two" || fail "finetune across 2 hosts: $(tail -20 "$dir/two.log")"
cli_same_as_one_rank "$dir" two "finetune across 2 hosts"

cli_finish "ranks across network namespaces"
