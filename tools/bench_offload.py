#!/usr/bin/env python3
"""Training speed with parameters and optimizer states on NVMe against the
same run with everything in RAM, with the pipelined step on and off
(strata.pipelined_step), all measured in one invocation.

  python3 tools/bench_offload.py --strata build/tools/strata [--steps 40] [--reps 3] [--dir /var/tmp/sbo]

Trains the 3.08M-parameter Llama of bench_model.py (4 layers, dim 256, fp32
like `strata demo`; 8 x 128 tokens per step, CPU ops on the host backend) in
four configurations, interleaved --reps times so drift on a shared machine
hits all alike: {RAM, NVMe} x {pipelined, synchronous}. Per run: the median
step time over steps 5.. from metrics.jsonl; per configuration: the median
over repetitions. Prints tokens/s and the ratio NVMe / RAM for each step mode
(target >= 0.95: the NVMe traffic hidden behind compute), and pipelined /
synchronous for each placement. Every run of a pair must end with the same
final loss (the pipelined step is exact); the bench fails otherwise.
"""
import argparse
import json
import os
import shutil
import statistics
import tempfile

from bench_model import run, small_model_and_data


def config(nvme_dir, pipelined):
    off = {"device": "nvme", "nvme_path": nvme_dir} if nvme_dir else {"device": "cpu"}
    return {"zero_optimization": {"stage": 3, "offload_param": dict(off), "offload_optimizer": dict(off)},
            "strata": {"pipelined_step": pipelined}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="work directory (its disk is the NVMe tier); default: a temp dir")
    a = ap.parse_args()
    base = a.dir or tempfile.mkdtemp(prefix="strata-bench-offload-")
    os.makedirs(base, exist_ok=True)
    model, data = small_model_and_data(a.strata, base)
    tokens_per_step = 8 * 128
    kinds = [("RAM", False, True), ("RAM", False, False), ("NVMe", True, True), ("NVMe", True, False)]
    step_s = {k: [] for k in kinds}
    losses = {}
    for rep in range(a.reps):
        for k in kinds:
            _, nvme, pipelined = k
            out, nv = os.path.join(base, "out"), os.path.join(base, "nvme")
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(nv, ignore_errors=True)
            os.makedirs(nv)
            cfg = os.path.join(base, "config.json")
            with open(cfg, "w") as f:
                json.dump(config(nv if nvme else None, pipelined), f)
            run([a.strata, "finetune", "--model", model, "--data", data, "--seq", "128", "--batch", "8", "--steps",
                 str(a.steps), "--eval-every", "0", "--eval-batches", "1", "--no-export", "--progress", "quiet",
                 "--out", out, "--device", "cpu", "--config", cfg])
            train = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
            train = [l for l in train if l.get("event") == "train"]
            step_s[k].append(statistics.median(l["step_s"] for l in train[4:]))
            losses.setdefault(k[:2], set()).add(train[-1]["loss"])
    for (place, _), seen in losses.items():
        if len(seen) != 1:
            raise SystemExit(f"{place}: pipelined and synchronous runs ended with different losses {seen}")
    med = {k: statistics.median(v) for k, v in step_s.items()}
    print(f"{a.steps} steps of 8 x 128 tokens, fp32, CPU ops; median step time over steps 5..{a.steps}, "
          f"median of {a.reps} interleaved runs")
    print(f"{'placement':<6} {'step':<12} {'s/step':>8} {'tokens/s':>9}   runs (s/step)")
    for k in kinds:
        print(f"{k[0]:<6} {'pipelined' if k[2] else 'synchronous':<12} {med[k]:>8.4f} {tokens_per_step / med[k]:>9.0f}"
              f"   {' '.join(f'{x:.4f}' for x in step_s[k])}")
    for pipelined in (True, False):
        r = med[("RAM", False, pipelined)] / med[("NVMe", True, pipelined)]
        print(f"NVMe / RAM tokens/s, {'pipelined' if pipelined else 'synchronous'} step: {r:.3f}")
    for place, nvme in (("RAM", False), ("NVMe", True)):
        r = med[(place, nvme, False)] / med[(place, nvme, True)]
        print(f"{place}: pipelined / synchronous tokens/s: {r:.3f}")
    if not a.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
