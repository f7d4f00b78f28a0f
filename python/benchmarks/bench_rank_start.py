"""How long N ranks take to agree on the initial weights: strata.torch.initialize
when every rank built the same weights (a checksum per parameter is compared,
nothing else is sent) and when rank 1's differ (the differing parameters are
broadcast from rank 0, here all of them), against the peer every PyTorch
trainer pays, DistributedDataParallel's construction (it broadcasts rank 0's
parameters and buffers over gloo), in one run on the same model.

    python python/benchmarks/bench_rank_start.py --dir /tmp/sb [--mib 256] [--ranks 2] [--reps 3]

Starts `torchrun --nproc-per-node RANKS` on itself. The model: Linear(1024,
1024) layers up to MIB MiB of fp32 weights; optimizer state in RAM. Each rank
times each call (after a barrier); the figure is rank 0's, the median of REPS.
Prints seconds, GB/s of weights, and the ratios to DDP's construction.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch


def model(mib, seed):
    torch.manual_seed(seed)
    layers = max(1, mib * 2 ** 20 // (4 * (1024 * 1024 + 1024)))
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(layers)])


def worker(args):
    import torch.distributed as dist
    import strata.torch as st
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                 "offload_optimizer": {"device": "cpu"}}}
    times = {"strata, same weights": [], "strata, rank 1's differ": [], "DDP construction": []}
    sent = {}
    nbytes = 0
    for _ in range(args.reps):
        for what in times:
            m = model(args.mib, 0 if (rank == 0 or what != "strata, rank 1's differ") else 1)
            nbytes = sum(p.numel() * 4 for p in m.parameters())
            dist.barrier()
            t0 = time.perf_counter()
            if what == "DDP construction":
                ddp = torch.nn.parallel.DistributedDataParallel(m)
                dt = time.perf_counter() - t0
                del ddp
            else:
                engine, _, _, _ = st.initialize(model=m, config=cfg)
                dt = time.perf_counter() - t0
                sent[what] = engine.stats()["comm_bytes"]
                engine.destroy()
            times[what].append(dt)
            dist.barrier()
    if rank == 0:
        with open(os.path.join(args.dir, "rank_start.json"), "w") as f:
            json.dump({"bytes": nbytes, "times": times, "sent": sent, "world": dist.get_world_size()}, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    os.makedirs(args.dir, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--master-addr",
           "127.0.0.1", "--master-port", str(port), os.path.abspath(__file__), "--worker", "--dir", args.dir,
           "--mib", str(args.mib), "--reps", str(args.reps)]
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(os.path.join(args.dir, "rank_start.json")) as f:
        r = json.load(f)
    ddp = statistics.median(r["times"]["DDP construction"])
    print(f"{r['world']} ranks, {r['bytes'] / 2 ** 20:.0f} MiB of fp32 weights, median of {args.reps}:")
    print(f"{'':28} {'seconds':>8} {'GB/s':>7} {'/ DDP':>7} {'rank 0 sent':>14}")
    for what, ts in r["times"].items():
        t = statistics.median(ts)
        sent = r["sent"].get(what)
        print(f"{what:28} {t:8.3f} {r['bytes'] / t / 1e9:7.2f} {t / ddp:7.3f} "
              f"{'' if sent is None else f'{sent:,} B':>14}")


if __name__ == "__main__":
    main()
