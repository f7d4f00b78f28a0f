#!/usr/bin/env python3
"""Strata's CPU AdamW against PyTorch's torch.optim.AdamW on the CPU, in one run.

Runs `strata bench adam --json`, torch.optim.AdamW (for-loop, foreach and,
where this torch has it, fused) and, when deepspeed is installed, DeepSpeed's
CPU Adam (DeepSpeedCPUAdam, AdamW mode) on the same number of fp32 parameters with the
same thread count, and prints params/s side by side. Each measurement is the
median of --iters steps after one warm-up step; the whole set runs --rounds
times, interleaved (strata, torch variants, strata, ...) so that drift on a
shared machine hits every implementation alike, and the median over rounds is
reported.

    python3 scripts/bench_adam_torch.py --params 128M --threads 2
    python3 scripts/bench_adam_torch.py --params 32M --threads 2 --json

Needs torch (pip install torch, into a virtual environment: the PyPI wheel
for Linux x86-64 brings the CUDA libraries along, about 5 GB installed).
Exit status: 0 ok, 1 bad arguments or a missing dependency, 2 a run failed.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_count(text):
    t = text.strip().upper().removesuffix("I").removesuffix("B") if text else ""
    unit = t[-1] if t and t[-1] in UNITS else ""
    num = t[:-1] if unit else t
    try:
        value = int(num) * UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--params '{text}': expected a count like 1048576, 64M or 1G")
    if value <= 0:
        raise argparse.ArgumentTypeError("--params must be > 0")
    return value


def run_strata(binary, n, threads, iters):
    cmd = [binary, "bench", "adam", "--params", str(n), "--threads", str(threads), "--iters", str(iters), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
    return json.loads(proc.stdout)


def run_torch(torch, n, threads, iters, variant):
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.rand(n, generator=gen, dtype=torch.float32))
    p.grad = torch.rand(n, generator=gen, dtype=torch.float32) * 1e-2
    kwargs = {"lr": 1e-4, "weight_decay": 0.01}
    if variant == "for-loop":
        kwargs["foreach"] = False
    elif variant == "foreach":
        kwargs["foreach"] = True
    elif variant == "fused":
        kwargs["fused"] = True
    if variant == "deepspeed":
        # DeepSpeed's CPU Adam (csrc/adam, JIT-built on first use), AdamW mode.
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam([p], lr=1e-4, weight_decay=0.01, adamw_mode=True)
    else:
        opt = torch.optim.AdamW([p], **kwargs)
    times = []
    for i in range(iters + 1):
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        if i > 0:  # the first step allocates the states
            times.append(t1 - t0)
    del opt, p
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=parse_count, default=parse_count("128M"), help="fp32 parameters (128M = 128*2^20)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads for both")
    ap.add_argument("--iters", type=int, default=5, help="timed steps per measurement (median taken)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median over rounds reported)")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--strata", default=os.path.join(here, "..", "build-opt", "tools", "strata"), help="strata binary")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.threads < 1 or args.iters < 1 or args.rounds < 1:
        ap.error("--threads, --iters and --rounds must be >= 1")
    if not os.access(args.strata, os.X_OK):
        ap.error(f"strata binary not found at {args.strata} (build it, or pass --strata)")
    try:
        import torch
    except ImportError:
        sys.stderr.write("bench_adam_torch: torch is not installed (pip install torch)\n")
        return 1

    n, threads = args.params, args.threads
    variants = ["for-loop", "foreach"]
    if "fused" in torch.optim.AdamW.__init__.__code__.co_varnames:
        variants.append("fused")
    try:  # the peer to beat, where it installs (pip install deepspeed)
        import deepspeed  # noqa: F401
        variants.append("deepspeed")
    except ImportError:
        sys.stderr.write("bench_adam_torch: deepspeed not installed; comparing with torch only\n")
    strata_runs, torch_runs, errors = [], {v: [] for v in variants}, {}
    for _ in range(args.rounds):
        try:
            strata_runs.append(run_strata(args.strata, n, threads, args.iters))
        except (RuntimeError, json.JSONDecodeError) as e:
            sys.stderr.write(f"bench_adam_torch: {e}\n")
            return 2
        for v in variants:
            if v in errors:
                continue
            try:
                torch_runs[v].append(n / run_torch(torch, n, threads, args.iters, v))
            except (RuntimeError, TypeError, ImportError, OSError) as e:  # e.g. fused unsupported, JIT build failed
                errors[v] = str(e).splitlines()[0]
    strata = dict(strata_runs[0])
    for k in ("params_per_s", "ceiling_gbps", "ratio"):
        strata[k] = statistics.median(r[k] for r in strata_runs)
    rows = [{"impl": f"strata ({strata['isa']})", "params_per_s": strata["params_per_s"],
             "samples": [r["params_per_s"] for r in strata_runs]}]
    for v in variants:
        if v in errors:
            rows.append({"impl": f"torch AdamW {v}", "error": errors[v]})
        else:
            name = f"deepspeed {deepspeed.__version__} DeepSpeedCPUAdam" if v == "deepspeed" else f"torch {torch.__version__} AdamW {v}"
            rows.append({"impl": name, "params_per_s": statistics.median(torch_runs[v]),
                         "samples": torch_runs[v]})
    s = strata["params_per_s"]
    for r in rows:
        if "params_per_s" in r:
            r["strata_speedup"] = s / r["params_per_s"]
            r["gbps"] = r["params_per_s"] * 28 / 1e9
    result = {"params": n, "threads": threads, "iters": args.iters, "rounds": args.rounds,
              "ceiling_gbps": strata["ceiling_gbps"],
              "strata_ratio_to_ceiling": strata["ratio"], "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"AdamW step, {n} fp32 params, {threads} threads, median of {args.rounds} interleaved rounds "
              f"of {args.iters} steps (memory ceiling {strata['ceiling_gbps']:.1f} GB/s)")
        for r in rows:
            if "error" in r:
                print(f"  {r['impl']:<40} failed: {r['error']}")
            else:
                print(f"  {r['impl']:<40} {r['params_per_s']:10.3g} params/s  {r['gbps']:6.1f} GB/s  "
                      f"strata is {r['strata_speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
