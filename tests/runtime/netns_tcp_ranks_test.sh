#!/usr/bin/env bash
# Torchrun-style ranks on separate hosts over the TCP communicator: network
# namespaces joined by a bridge stand in for hosts (tests/netns_lib.sh), one
# rank in each, launched the way torchrun's agents launch them on each node
# (RANK, WORLD_SIZE, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, MASTER_ADDR = host 0's
# address, MASTER_PORT). Nothing is shared between the ranks but the bridge:
# the rendezvous, the address table rank 0 hands out and every pair's
# connection cross it, as between machines (on one host, a loopback test
# cannot tell a wrong address in that table from a right one).
#   tests/runtime/netns_tcp_ranks_test.sh build/tests/comm/test_comm_tcp build/tools/strata
# Runs the communicator's collectives (test_comm_tcp) across 2 and 3 hosts
# and with 4 ranks on 2 hosts, a rank killed mid-collective across 3, and `strata finetune` across 2
# against a 1-rank run of 2 micro-batches (cmp of the exported models). Where
# the hosts have IPv6 (netns_addr6), the collectives across 3 hosts again
# with MASTER_ADDR host 0's IPv6 address, and with one rank naming it by IPv4
# and another by IPv6 (the table then holds both families).
# ctest tcp_ranks_netns; exit 77 where namespaces cannot be made, saying why
# (exit 1 instead with STRATA_REQUIRE_NETNS=1, as CI runs it).
set -uo pipefail
comm_test=${1:?usage: netns_tcp_ranks_test.sh TEST_COMM_TCP STRATA}
strata=${2:?}
root=${STRATA_TEST_DIR:-/tmp}
dir=$(mktemp -d "$root/strata-netns-tcp.XXXXXX") || exit 1
here=$(dirname "${BASH_SOURCE[0]}")
source "$here/../cli_lib.sh"
source "$here/../netns_lib.sh"
pids=()
# A failed check leaves no rank behind (each is also under timeout).
trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done; netns_cleanup; rm -rf "$dir"' EXIT
trap 'exit 1' TERM INT HUP

if ! netns_hosts 3; then
  if [[ "${STRATA_REQUIRE_NETNS:-0}" == "1" ]]; then
    echo "FAIL (STRATA_REQUIRE_NETNS=1): $netns_error"
    exit 1
  fi
  echo "SKIP: $netns_error"
  exit 77
fi

# Each job gets its own port: a port of the job before may still be in
# TIME_WAIT on host 0. No other process listens inside the namespaces.
port=29400
# ranks N K NAME T CMD...: rank r of N runs CMD on host r/K (K ranks per
# host, as torchrun's agent on each of N/K nodes starts them) with torchrun's
# environment (MASTER_ADDR: ${rank_master[r]}, by default host 0's IPv4
# address), output in $dir/NAME.r.log, at most T seconds; sets rcs.
rank_master=()
ranks() {
  local n=$1 k=$2 name=$3 t=$4 r
  shift 4
  port=$((port + 1))
  pids=()
  for ((r = 0; r < n; ++r)); do
    ip netns exec "${netns_ns[r / k]}" env RANK=$r WORLD_SIZE=$n LOCAL_RANK=$((r % k)) LOCAL_WORLD_SIZE=$k \
      GROUP_RANK=$((r / k)) MASTER_ADDR="${rank_master[r]:-${netns_addr[0]}}" MASTER_PORT=$port timeout -s KILL "$t" "$@" \
      >"$dir/$name.$r.log" 2>&1 &
    pids+=($!)
  done
  rcs=()
  for ((r = 0; r < n; ++r)); do
    wait "${pids[r]}"
    rcs+=($?)
  done
  pids=()
}
logs() {  # NAME N: the tail of each rank's log
  local r
  for ((r = 0; r < $2; ++r)); do
    echo "--- rank $r:"
    tail -n 15 "$dir/$1.$r.log"
  done
}

# The collectives across 2 and 3 hosts, one rank each, and 4 ranks on 2
# hosts, two each (ranks 0 and 1 share host 0: rank 1 reaches rank 0 at
# MASTER_ADDR, not over loopback, and ranks 2, 3 reach rank 1 there too).
# The silent-rank test runs in tcp_comm_timeout_np3: its timing does not
# depend on where the ranks are.
for layout in "2 1" "3 1" "4 2"; do
  read -r n k <<<"$layout"
  name=comm$n
  ranks "$n" "$k" "$name" 300 "$comm_test" --gtest_filter=-RanksTimeout.*:RanksDeath.*:RanksGiveUp.*
  for ((r = 0; r < n; ++r)); do
    ((rcs[r] == 0)) || fail "test_comm_tcp, $n ranks on $((n / k)) hosts: rank $r exited ${rcs[r]}: $(logs "$name" "$n")"
    # Each rank's tests passed with world size n, talking across the bridge.
    grep -q "PASSED" "$dir/$name.$r.log" || fail "test_comm_tcp, $n ranks on $((n / k)) hosts: rank $r printed no PASSED"
  done
done

# Over IPv6 across 3 hosts: every rank names host 0 by its IPv6 address, then
# rank 1 by IPv4 and rank 2 by IPv6 (rank 0's dual-stack listener takes
# both; rank 2 reaches rank 1 at the IPv4 address the table gives), then
# every rank by its link-local address with the interface ("fe80::5:2%eth0":
# the table then holds link-local addresses, reached through each host's
# own eth0).
if ((${#netns_addr6[@]} == 0)); then
  [[ "${STRATA_REQUIRE_IPV6:-0}" != "1" ]] || fail "no IPv6 across the hosts (STRATA_REQUIRE_IPV6=1): $netns_error6"
  echo "note: no IPv6 across the hosts, its checks not run: $netns_error6"
else
  layouts=("${netns_addr6[0]} ${netns_addr6[0]} ${netns_addr6[0]}" "${netns_addr6[0]} ${netns_addr[0]} ${netns_addr6[0]}")
  if ((${#netns_ll6[@]} == 3)); then
    layouts+=("${netns_ll6[0]}%eth0 ${netns_ll6[0]}%eth0 ${netns_ll6[0]}%eth0")
  else
    [[ "${STRATA_REQUIRE_IPV6:-0}" != "1" ]] || fail "no link-local IPv6 addresses on the hosts (STRATA_REQUIRE_IPV6=1)"
    echo "note: no link-local IPv6 addresses on the hosts, their check not run"
  fi
  for masters in "${layouts[@]}"; do
    read -r -a rank_master <<<"$masters"
    ranks 3 1 comm3v6 300 "$comm_test" --gtest_filter=-RanksTimeout.*:RanksDeath.*:RanksGiveUp.*
    for ((r = 0; r < 3; ++r)); do
      ((rcs[r] == 0)) || fail "test_comm_tcp, 3 hosts, MASTER_ADDR $masters: rank $r exited ${rcs[r]}: $(logs comm3v6 3)"
      grep -q "PASSED" "$dir/comm3v6.$r.log" || fail "test_comm_tcp, 3 hosts, MASTER_ADDR $masters: rank $r printed no PASSED"
    done
  done
  rank_master=()
fi

# A rank that dies mid-collective on another host: the others fail naming it,
# long before any timeout (a FIN across the bridge, as across machines).
ranks 3 1 death 120 "$comm_test" --gtest_filter=RanksDeath.*
for r in 0 1; do
  ((rcs[r] == 0)) || fail "a dead rank across hosts: rank $r exited ${rcs[r]}: $(logs death 3)"
done

# strata finetune across 2 hosts: the same model as one rank with 2 micro-batches.
cli_ranks_reference "$strata" "$dir"
ranks 2 1 two 300 "$strata" finetune "${cli_ranks_flags[@]}" --batch 2 --out "$dir/two"
((rcs[0] == 0 && rcs[1] == 0)) || fail "finetune across 2 hosts: exit ${rcs[*]}: $(logs two 2)"
grep -q "over TCP" "$dir/two.0.log" || fail "finetune across 2 hosts did not say it runs over TCP: $(logs two 2)"
cli_same_as_one_rank "$dir" two "finetune across 2 hosts"

cli_finish "torchrun-style ranks across network namespaces (TCP communicator)"
