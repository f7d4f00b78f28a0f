#!/usr/bin/env python3
"""The rendezvous (src/comm/rendezvous.h) against torch's own TCPStore.

  torchrun_rendezvous_test.py RENDEZVOUS_PROBE

- Under torchrun (torch.distributed.run, 3 ranks on this host): torchrun's
  agent already serves a TCPStore on MASTER_PORT, so rank 0 cannot listen
  there; every rank must get rank 0's blob through that store, in each of 2
  rounds (two communicators of one job), and no round may see another's.
- Beside a store that torch.distributed's rank 0 serves (torch.distributed.
  TCPStore(is_master=True), libuv and legacy backends): the same.
- Against that store, a rank launched with another WORLD_SIZE: every rank
  fails, and the message says which rank and which sizes; a rank that never
  comes is named on every rank that came, also on one that started first.
- Against that store, a rank 0 that says more ranks than come, and two
  processes given one RANK: every process fails at once (not at its
  timeout), naming the cause.
- Without any store (rank 0 serves each exchange itself, or holds the first
  one's store for the later ones): 5 exchanges in a row.
- Over IPv6 (skipped, saying why, where ::1 is not available): torchrun with
  --master-addr "[::1]" (it exports MASTER_ADDR=::1) and a store torch.
  distributed serves at ::1.

Exit 0: every case passed; 1: a case failed; 77: torch missing (a failure
instead when STRATA_REQUIRE_REFERENCE=1, as in CI).
"""
import datetime
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

try:
    import torch  # noqa: F401
    import torch.distributed as dist
except ImportError as e:  # pragma: no cover - depends on the machine
    msg = f"torchrun_rendezvous_test: skipped: cannot import torch ({e})"
    if os.environ.get("STRATA_REQUIRE_REFERENCE") == "1":
        print(msg.replace("skipped", "FAILED") + " (STRATA_REQUIRE_REFERENCE=1)")
        sys.exit(1)
    print(msg)
    sys.exit(77)

PROBE = sys.argv[1]
failures = []
LINE = re.compile(r"^rank (\d+) round (\d+) blob ([0-9a-f]*)$")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_blobs(case, out, world, rounds):
    got = {}
    for line in out.splitlines():
        m = LINE.match(line.strip())
        if m:
            got[(int(m.group(1)), int(m.group(2)))] = bytes.fromhex(m.group(3)).decode()
    want = {(r, k) for r in range(world) for k in range(rounds)}
    if set(got) != want:
        failures.append(f"{case}: lines for {sorted(set(want) - set(got))} missing:\n{out[-3000:]}")
        return
    for k in range(rounds):
        blobs = {got[(r, k)] for r in range(world)}
        if len(blobs) != 1 or not next(iter(blobs)).endswith(f" round {k}"):
            failures.append(f"{case}: round {k}: the ranks got {sorted(blobs)}")
    print(f"{case}: {world} ranks x {rounds} rounds got rank 0's blob: {got[(0, 0)]!r}, {got[(0, rounds - 1)]!r}")


def env_for(rank, world, port, addr="127.0.0.1"):
    e = dict(os.environ)
    e.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR=addr,
             MASTER_PORT=str(port))
    return e


def ipv6_loopback_missing():
    """"" when ::1 can be bound, else why not (tests/test_util/ipv6.h)."""
    try:
        with open("/proc/sys/net/ipv6/conf/lo/disable_ipv6") as f:
            if f.read().strip() == "1":
                return "IPv6 is disabled on lo"
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as e:
        return f"cannot bind [::1]: {e}"
    return ""


no_ipv6 = ipv6_loopback_missing()
if no_ipv6 and os.environ.get("STRATA_REQUIRE_IPV6") == "1":
    sys.exit(f"FAIL (STRATA_REQUIRE_IPV6=1): {no_ipv6}")

# ---- under torchrun: its agent's store on MASTER_PORT (over IPv6 too:
# torchrun takes "[::1]" and exports MASTER_ADDR=::1)
for master in ("127.0.0.1", "[::1]"):
    if master != "127.0.0.1" and no_ipv6:
        print(f"torchrun --master-addr {master}: skipped: {no_ipv6}")
        continue
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="strata-torchrun-")  # torchrun leaves its torchelastic_* log dirs in TMPDIR
    try:
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--no-python", "--nproc-per-node", "3",
                              "--master-addr", master, "--master-port", str(port), PROBE, "2", "60"],
                             capture_output=True, text=True, timeout=240, env=dict(os.environ, TMPDIR=tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if run.returncode != 0:
        failures.append(f"torchrun --master-addr {master}: exit {run.returncode}:\n{run.stdout[-2000:]}\n"
                        f"{run.stderr[-3000:]}")
    else:
        check_blobs(f"torchrun --master-addr {master} (agent store)", run.stdout, 3, 2)

# ---- beside a store torch.distributed's rank 0 serves (and one at ::1)
for libuv, addr in ((True, "127.0.0.1"), (False, "127.0.0.1"), (True, "::1")):
    if addr == "::1" and no_ipv6:
        print(f"torch.distributed.TCPStore at {addr}: skipped: {no_ipv6}")
        continue
    port = free_port()
    store = dist.TCPStore(addr, port, None, True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False, use_libuv=libuv)
    procs = [subprocess.Popen([PROBE, "2", "60"], env=env_for(r, 3, port, addr), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    case = f"torch.distributed.TCPStore at {addr} (use_libuv={libuv})"
    if any(p.returncode != 0 for p in procs):
        failures.append(f"{case}: exits {[p.returncode for p in procs]}: {[o[1][-500:] for o in outs]}")
    else:
        check_blobs(case, "".join(o[0] for o in outs), 3, 2)
    del store

# ---- a rank with another world size, against torch's store: every rank fails, saying why
port = free_port()
store = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=60),
                      wait_for_workers=False)
worlds = [3, 3, 4]
procs = [subprocess.Popen([PROBE, "1", "20"], env=env_for(r, worlds[r], port), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) for r in range(3)]
outs = [p.communicate(timeout=120) for p in procs]
want = ["rank 2 says world size 4, rank 0 has 3", "rank 0 refused the rendezvous", "rank 2 says world size 4, rank 0 has 3"]
for r in range(3):
    if procs[r].returncode == 0 or want[r] not in outs[r][1]:
        failures.append(f"world mismatch: rank {r} exit {procs[r].returncode}, said: {outs[r][1][-500:]!r}")
if not any(f.startswith("world mismatch") for f in failures):
    print("world mismatch: every rank failed, naming rank 2's world size 4 against rank 0's 3")
del store

def fail_at_once(case, ranks_worlds, want):
    """Probes (rank, WORLD_SIZE) against a torch TCPStore, timeout 60 s:
    every one must fail with `want` in its error, all well before 60 s."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    t0 = time.monotonic()
    procs = [subprocess.Popen([PROBE, "1", "60"], env=env_for(r, w, port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r, w in ranks_worlds]
    outs = [p.communicate(timeout=120) for p in procs]
    took = time.monotonic() - t0
    bad = [f"{case}: process {i} (rank {ranks_worlds[i][0]}) exit {p.returncode}, said: {outs[i][1][-500:]!r}"
           for i, p in enumerate(procs) if p.returncode == 0 or want not in outs[i][1]]
    if took > 30:
        bad.append(f"{case}: the processes took {took:.1f} s to fail (their timeout is 60 s)")
    failures.extend(bad)
    if not bad:
        print(f"{case}: all {len(procs)} processes failed in {took:.1f} s, naming {want!r}")
    del store


# ---- rank 0 says 3 ranks, the only other one 2, against torch's store: the
# refusal ends rank 0's wait at once (not at its 60 s timeout)
fail_at_once("early refusal", ((0, 3), (1, 2)), "rank 1 says world size 2, rank 0 has 3")
# ---- two processes given RANK=1, against torch's store: every process
# fails at once, naming rank 1 (the count is the store's atomic ADD)
fail_at_once("duplicate rank", ((0, 3), (1, 3), (1, 3)), "2 processes joined as rank 1")

# ---- a rank that never comes, against torch's store: rank 1 starts before
# rank 0 (its own deadline passes first) and still gets rank 0's verdict,
# which names rank 2
port = free_port()
store = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=60),
                      wait_for_workers=False)
p1 = subprocess.Popen([PROBE, "1", "3"], env=env_for(1, 3, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True)
time.sleep(0.5)
p0 = subprocess.Popen([PROBE, "1", "3"], env=env_for(0, 3, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True)
o0, o1 = p0.communicate(timeout=60), p1.communicate(timeout=60)
for r, p, o, want in ((0, p0, o0, "never came: rank 2"), (1, p1, o1, "rank 0 refused the rendezvous")):
    if p.returncode == 0 or want not in o[1] or "never came: rank 2" not in o[1]:
        failures.append(f"missing rank: rank {r} exit {p.returncode}, said: {o[1][-500:]!r}")
if not any(f.startswith("missing rank") for f in failures):
    print("missing rank: ranks 0 and 1 failed, both naming rank 2")
del store

# ---- no store at all (a launcher that only sets the variables): rank 0
# serves one per exchange, 5 exchanges in a row (a later exchange's rank may
# reach the previous exchange's server as it closes); and with rank 0
# holding the first exchange's store, as a communicator does (the later
# exchanges meet through it)
for hold in ([], ["hold"]):
    port = free_port()
    procs = [subprocess.Popen([PROBE, "5", "60"] + hold, env=env_for(r, 3, port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (2, 1, 0)]
    outs = [p.communicate(timeout=120) for p in procs]
    case = "no store (rank 0 serves" + (", and holds the first store)" if hold else " each)")
    if any(p.returncode != 0 for p in procs):
        failures.append(f"{case}: exits {[p.returncode for p in procs]}: {[o[1][-500:] for o in outs]}")
    else:
        check_blobs(case, "".join(o[0] for o in outs), 3, 5)

for f in failures:
    print("FAIL:", f)
print(f"{'all' if not failures else len(failures)} torchrun rendezvous checks {'passed' if not failures else 'failed'}")
sys.exit(1 if failures else 0)
