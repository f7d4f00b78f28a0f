#!/usr/bin/env python3
"""Bytes moved per optimizer step by `strata finetune`, measured, against what
the placement requires (the planner's count, written by the run itself as the
"plan" line of metrics.jsonl), on each link: NVMe read, NVMe write,
host->device, device->host.

  python3 tools/bench_bytes.py --strata build/tools/strata [--steps 12] [--dir /tmp/sbb]

Runs a 3.08M-parameter Llama (4 layers, dim 256) with parameters and optimizer
states on NVMe, at gradient accumulation 1 and 4 (--grad-accum), with the
compute copies on the device and master and moments on NVMe, and with the
automatic placement (everything fits: compute copies on the device, the rest
in RAM); prints, per run and link, the median over steps 3.. of the bytes
each step moved (differences of the cumulative counters on the metrics' train
lines), the plan's bytes per step, and their ratio (1.000: exactly what the
placement requires; above: bytes moved that need not be; below: the planner
over-counts, e.g. a group still in its device slot is not uploaded again). The
runs use the CPU ops on the host backend, where "device" memory is RAM: the
host->device bytes are the copies the engine makes into its device slots.
"""
import argparse
import json
import os
import shutil
import statistics
import tempfile

from bench_model import run, small_model_and_data

LINKS = ("nvme_read_bytes", "nvme_write_bytes", "h2d_bytes", "d2h_bytes")


def measure(metrics):
    lines = [json.loads(l) for l in open(metrics)]
    plan = next(l for l in lines if l.get("event") == "plan")
    train = [l for l in lines if l.get("event") == "train"]
    per = {k: [b[k] - a[k] for a, b in zip(train, train[1:])][1:] for k in LINKS}  # steps 3..
    return plan, {k: statistics.median(v) if v else 0 for k, v in per.items()}, \
        statistics.median(l["step_s"] for l in train[2:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    base = a.dir or tempfile.mkdtemp(prefix="strata-bench-bytes-")
    os.makedirs(base, exist_ok=True)
    model, data = small_model_and_data(a.strata, base)
    # (name, --offload-params, --offload-optimizer, accumulation); "nv" stands for nvme:DIR
    runs = [("NVMe, accumulation 1", "nv", "nv", 1), ("NVMe, accumulation 4", "nv", "nv", 4),
            ("GPU params, NVMe opt", "none", "nv", 1), ("auto (all fits)", "auto", "auto", 1)]
    print(f"{a.steps} steps of 4 x 128 tokens per micro-batch, bf16 compute, CPU ops; medians of steps 3..{a.steps}")
    print(f"{'run':<22} {'link':<17} {'measured/step':>14} {'plan/step':>14} {'ratio':>7}")
    for name, params, optim, accum in runs:
        out = os.path.join(base, "out")
        nv = os.path.join(base, "nvme")
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(nv, ignore_errors=True)
        os.makedirs(nv)
        cmd = [a.strata, "finetune", "--model", model, "--data", data, "--seq", "128", "--batch", "4", "--grad-accum",
               str(accum), "--steps", str(a.steps), "--eval-every", "0", "--eval-batches", "1", "--no-export",
               "--progress", "quiet", "--out", out, "--device", "cpu", "--bf16"]
        where = lambda t: "nvme:" + nv if t == "nv" else t
        cmd += ["--offload-params", where(params), "--offload-optimizer", where(optim)]
        run(cmd)
        plan, got, step_s = measure(os.path.join(out, "metrics.jsonl"))
        for k in LINKS:
            want = plan["per_step"][k]
            ratio = f"{got[k] / want:.3f}" if want else ("-" if got[k] == 0 else "inf")
            print(f"{name:<22} {k[:-6]:<17} {got[k]:>14.0f} {want:>14} {ratio:>7}")
        print(f"{name:<22} {'(step s)':<17} {step_s:>14.4f}")
    if not a.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
