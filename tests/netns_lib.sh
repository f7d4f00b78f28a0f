# Hosts made of network namespaces on this machine, for jobs whose ranks talk
# TCP as across machines. Sourced by tests/runtime/netns_ranks_test.sh (Open
# MPI), tests/runtime/netns_tcp_ranks_test.sh (torchrun-style ranks over the
# TCP communicator) and scripts/bench_ranks_netns.sh:
#   source tests/netns_lib.sh
#   netns_mpirun_bin=/usr/bin/mpirun                           # optional (default: mpirun)
#   netns_hosts 3 [RATE] || { echo "$netns_error"; exit 77; }   # root only
#   ((${#netns_addr6[@]})) || echo "no IPv6: $netns_error6"    # host i's IPv6 address
#   "${netns_mpirun[@]}" --host "${netns_addr[0]},${netns_addr[1]}" -np 2 CMD...
#   ip netns exec "${netns_ns[0]}" CMD...                      # CMD on host 0
# netns_hosts makes a bridge and N namespaces on it, each with its own UTS
# namespace whose hostname is its address (Open MPI tells its daemons apart
# by hostname: with the machine's one hostname in every namespace its launch
# hung in about half the runs, a daemon that never reported). RATE (a tc rate
# such as 1gbit) limits each host's link both ways with a token bucket.
# netns_mpirun is mpirun with an rsh agent that enters a host's namespaces,
# TCP only (no shared memory between hosts), on the bridge's subnet.
# Everything is removed at exit (netns_cleanup, an EXIT trap the caller keeps);
# namespaces of an earlier run that was killed are removed first.
# Needs: ip and tc (iproute2), nsenter and unshare (util-linux); mpirun for
# netns_mpirun, which stays empty where there is none.

netns_error=
netns_net=        # the bridge's /24, as 10.x.y
netns_addr=()      # host i's address on the bridge
netns_addr6=()     # host i's IPv6 address on the bridge (fd10:x:y::i+1); empty where IPv6 is off
netns_ll6=()       # host i's link-local IPv6 address on the bridge (fe80::5:i+1; its interface: eth0 on every host)
netns_error6=      # why netns_addr6 is empty
netns_ns=()        # host i's network namespace (for ip netns exec)
netns_mpirun=()
_netns_made=()
_netns_tag=$$
_netns_br=sbr$$
_netns_dir=

netns_cleanup() {
  local ns
  for ns in "${_netns_made[@]}"; do ip netns del "$ns" 2>/dev/null; done
  ip link del "$_netns_br" 2>/dev/null
  [[ -n $_netns_dir ]] && rm -rf "$_netns_dir"
  _netns_made=()
}

# Namespaces and bridges named after a process that no longer exists.
_netns_remove_stale() {
  local ns b p
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^strata_ns[0-9]*_[0-9]*$'); do
    p=${ns#strata_ns}
    p=${p%_*}
    kill -0 "$p" 2>/dev/null || ip netns del "$ns" 2>/dev/null
  done
  for b in $(ip -o link show type bridge 2>/dev/null | awk -F': ' '{print $2}' | grep '^sbr[0-9]*$'); do
    kill -0 "${b#sbr}" 2>/dev/null || ip link del "$b" 2>/dev/null
  done
}

netns_hosts() {  # N [RATE]; sets netns_addr, netns_mpirun; 1 with netns_error on failure
  local n=$1 rate=${2:-} i ns net= cand tool out
  for tool in ip tc nsenter unshare; do
    command -v "$tool" >/dev/null || { netns_error="no $tool here"; return 1; }
  done
  _netns_remove_stale
  # A /24 that no route of this machine touches (the namespaces have no
  # route out: their traffic stays on this machine).
  for _ in $(seq 1 20); do
    cand=10.$((100 + RANDOM % 100)).$((RANDOM % 250))
    [[ -z $(ip -4 route show to match "$cand.1" | grep -v '^default') ]] && { net=$cand; break; }
  done
  [[ -n $net ]] || { netns_error="no free 10.x.y.0/24 for the bridge"; return 1; }
  netns_net=$net
  _netns_dir=$(mktemp -d "${TMPDIR:-/tmp}/strata-netns-lib.XXXXXX") || { netns_error="mktemp failed"; return 1; }
  if ! ip link add "$_netns_br" type bridge 2>"$_netns_dir/err"; then
    netns_error="cannot make network namespaces here: $(cat "$_netns_dir/err")"
    return 1
  fi
  ip addr add "$net.1/24" dev "$_netns_br" && ip link set "$_netns_br" up ||
    { netns_error="bridge setup failed"; return 1; }
  netns_addr=()
  netns_addr6=()
  netns_ll6=()
  netns_error6=
  netns_ns=()
  for ((i = 1; i <= n; ++i)); do
    ns=strata_ns${_netns_tag}_$i
    ip netns add "$ns" || { netns_error="ip netns add $ns failed"; return 1; }
    _netns_made+=("$ns")
    ip link add "sv${_netns_tag}_$i" type veth peer name eth0 netns "$ns" &&
      ip link set "sv${_netns_tag}_$i" master "$_netns_br" up &&
      ip -n "$ns" addr add "$net.$((i + 1))/24" dev eth0 &&
      ip -n "$ns" link set eth0 up && ip -n "$ns" link set lo up || { netns_error="veth setup failed"; return 1; }
    if [[ -n $rate ]]; then
      # Both directions: towards the host (bridge side) and out of it.
      tc qdisc add dev "sv${_netns_tag}_$i" root tbf rate "$rate" burst 256kb latency 50ms &&
        ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 50ms ||
        { netns_error="tc tbf rate $rate failed"; return 1; }
    fi
    netns_addr+=("$net.$((i + 1))")
    netns_ns+=("$ns")
    # IPv6 too where the kernel has it (nodad: usable at once), on a /64
    # named after the IPv4 /24; optional, so no failure.
    if [[ -z $netns_error6 ]]; then
      if out=$(ip -n "$ns" -6 addr add "fd${net//./:}::$((i + 1))/64" dev eth0 nodad 2>&1); then
        netns_addr6+=("fd${net//./:}::$((i + 1))")
        # A link-local address of its own (the kernel's, from the MAC, is
        # tentative for a while): where it cannot be added, netns_ll6 stays
        # short and the link-local checks say so.
        ip -n "$ns" -6 addr add "fe80::5:$((i + 1))/64" dev eth0 nodad 2>/dev/null && netns_ll6+=("fe80::5:$((i + 1))")
      else
        netns_error6="cannot add an IPv6 address in $ns: ${out:-ip -6 addr add failed}"
      fi
    fi
  done
  [[ -z $netns_error6 ]] || { netns_addr6=(); netns_ll6=(); }
  netns_mpirun=()
  command -v "${netns_mpirun_bin:-mpirun}" >/dev/null || return 0
  # Open MPI's rsh agent: "agent [options] HOST CMD..." runs CMD on HOST.
  {
    echo '#!/bin/bash'
    echo 'while [[ $1 == -* ]]; do shift; done'
    echo 'host=$1; shift'
    echo 'case $host in'
    for ((i = 1; i <= n; ++i)); do echo "  ${netns_addr[i - 1]}) ns=strata_ns${_netns_tag}_$i ;;"; done
    echo '  *) echo "agent: unknown host $host" >&2; exit 1 ;;'
    echo 'esac'
    echo 'exec nsenter --net=/run/netns/"$ns" unshare --uts /bin/sh -c "hostname $host && exec /bin/sh -c \"\$0\"" "$*"'
  } >"$_netns_dir/agent.sh"
  chmod +x "$_netns_dir/agent.sh"
  netns_mpirun=("${netns_mpirun_bin:-mpirun}" --allow-run-as-root --oversubscribe --mca plm_rsh_agent "$_netns_dir/agent.sh"
    --mca plm_rsh_no_tree_spawn 1 --mca oob_tcp_if_include "$net.0/24" --mca btl_tcp_if_include "$net.0/24"
    --mca btl tcp,self)
  export OMPI_MCA_rmaps_base_oversubscribe=1
  return 0
}
