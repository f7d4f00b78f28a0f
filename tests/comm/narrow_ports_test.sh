#!/usr/bin/env bash
# tcp_comm_narrow_ports_np3: 3 torchrun-style ranks (launch_ranks) meet and
# run a few collectives in a network namespace of their own whose ephemeral
# port range is 8 ports, so that a rank's listener made by bind(0) would land
# on MASTER_PORT (launch_ranks' pick from the same range) in most runs, and
# a rendezvous connect would often reach itself. Before the fix, a rank's
# listener there took rank 0's connection to MASTER_PORT and answered
# nothing: every rank waited out its timeout (tcp_comm_death_np3 hung so in
# CI once; here 3 runs of 3 hung). Three jobs, each in a fresh namespace.
#   narrow_ports_test.sh LAUNCH_RANKS TEST_COMM_TCP
# Needs root (unshare -n) and ip (iproute2); skips (77) saying why without
# them, fails instead under STRATA_REQUIRE_NETNS=1, as CI runs it.
set -uo pipefail
launch=$1 prog=$2
if ! why=$(unshare -n true 2>&1) || ! command -v ip >/dev/null; then
  why="no network namespace: ${why:-no ip (iproute2)}"
  if [[ "${STRATA_REQUIRE_NETNS:-0}" == "1" ]]; then
    echo "FAIL (STRATA_REQUIRE_NETNS=1): $why"
    exit 1
  fi
  echo "SKIP: $why"
  exit 77
fi
# A namespace per job: sockets of the last one that linger (TIME_WAIT) would
# leave the next too few ports.
for job in 1 2 3; do
  unshare -n bash -c '
    set -e
    ip link set lo up
    echo "40000 40007" > /proc/sys/net/ipv4/ip_local_port_range
    echo "job $2: ephemeral ports $(cat /proc/sys/net/ipv4/ip_local_port_range)"
    exec "$0" --timeout 110 3 "$1" --gtest_brief=1 \
      --gtest_filter=Ranks.AllReduceIsTheRankOrderSumBitForBit:Ranks.BroadcastFromEveryRoot:Ranks.AllGatherOddSizes
  ' "$launch" "$prog" "$job" || exit 1
done
