#!/usr/bin/env python3
"""Training speed with parameters and optimizer states on NVMe against the
same run with everything in RAM, with the pipelined step on and off
(strata.pipelined_step), all measured in one invocation.

  python3 tools/bench_offload.py --strata build/tools/strata [--steps 40] [--reps 3] [--dir /var/tmp/sbo]
      [--placements RAM,NVMe,GPU+NVMe,NVMe-nohandoff] [--baseline OTHER/strata]

Trains the 3.08M-parameter Llama of bench_model.py (4 layers, dim 256, fp32
like `strata demo`; 8 x 128 tokens per step, CPU ops on the host backend) in
configurations interleaved --reps times so drift on a shared machine hits all
alike: placements (RAM; NVMe: parameters and states on NVMe; GPU+NVMe:
compute copies on the device, master and moments on NVMe; NVMe-nohandoff:
NVMe with strata.optimizer_handoff off) x {pipelined,
synchronous} x the binaries (--strata and an optional --baseline). Per run: the median
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


PLACEMENTS = {
    # name: (offload_param, offload_optimizer) as functions of the NVMe directory
    "RAM": lambda nv: ({"device": "cpu"}, {"device": "cpu"}),
    "NVMe": lambda nv: ({"device": "nvme", "nvme_path": nv}, {"device": "nvme", "nvme_path": nv}),
    # Parameters in RAM, optimizer states on NVMe (ZeRO-Infinity's usual split).
    "RAM+NVMe": lambda nv: ({"device": "cpu"}, {"device": "nvme", "nvme_path": nv}),
    # Compute copies homed on the (host backend's) device, master and moments on NVMe:
    # the one-GPU case where the model's bf16/fp32 copy fits on the GPU.
    "GPU+NVMe": lambda nv: ({"device": "none"}, {"device": "nvme", "nvme_path": nv}),
    # NVMe with strata.optimizer_handoff off: the next forward's first groups
    # read back from NVMe what the optimizer pass wrote (what the hand-off saves).
    "NVMe-nohandoff": lambda nv: ({"device": "nvme", "nvme_path": nv}, {"device": "nvme", "nvme_path": nv}),
}


def config(place, nvme_dir, pipelined):
    op, oo = PLACEMENTS[place](nvme_dir)
    strata = {"pipelined_step": pipelined}
    if place.endswith("-nohandoff"):
        strata["optimizer_handoff"] = False
    return {"zero_optimization": {"stage": 3, "offload_param": op, "offload_optimizer": oo}, "strata": strata}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata", required=True)
    ap.add_argument("--baseline", default=None,
                    help="a second strata binary (e.g. an older commit's), run interleaved with --strata")
    ap.add_argument("--placements", default="RAM,NVMe", help=f"comma-separated, of {', '.join(PLACEMENTS)}")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None,
                    help="where to make the work directory (its disk is the NVMe tier); default: $TMPDIR")
    a = ap.parse_args()
    places = a.placements.split(",")
    for p in places:
        if p not in PLACEMENTS:
            raise SystemExit(f"unknown placement {p!r} (known: {', '.join(PLACEMENTS)})")
    bins = [("new", a.strata)] + ([("base", a.baseline)] if a.baseline else [])
    if a.dir:
        os.makedirs(a.dir, exist_ok=True)
    base = tempfile.mkdtemp(prefix="strata-bench-offload-", dir=a.dir)
    model, data = small_model_and_data(a.strata, base)
    tokens_per_step = 8 * 128
    kinds = [(b, p, pl) for b, _ in bins for p in places for pl in (True, False)]
    binary = dict(bins)
    step_s = {k: [] for k in kinds}
    losses = {}
    for rep in range(a.reps):
        for k in kinds:
            b, place, pipelined = k
            out, nv = os.path.join(base, "out"), os.path.join(base, "nvme")
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(nv, ignore_errors=True)
            os.makedirs(nv)
            cfg = os.path.join(base, "config.json")
            with open(cfg, "w") as f:
                json.dump(config(place, nv, pipelined), f)
            run([binary[b], "finetune", "--model", model, "--data", data, "--seq", "128", "--batch", "8", "--steps",
                 str(a.steps), "--eval-every", "0", "--eval-batches", "1", "--no-export", "--progress", "quiet",
                 "--out", out, "--device", "cpu", "--config", cfg])
            train = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
            train = [l for l in train if l.get("event") == "train"]
            step_s[k].append(statistics.median(l["step_s"] for l in train[4:]))
            losses.setdefault((b, place), set()).add(train[-1]["loss"])
    for (b, place), seen in losses.items():
        if len(seen) != 1:
            raise SystemExit(f"{b} {place}: pipelined and synchronous runs ended with different losses {seen}")
        if place.endswith("-nohandoff") and (b, "NVMe") in losses and losses[(b, "NVMe")] != seen:
            raise SystemExit(f"{b}: NVMe with and without the optimizer hand-off ended with different losses")
    med = {k: statistics.median(v) for k, v in step_s.items()}
    print(f"{a.steps} steps of 8 x 128 tokens, fp32, CPU ops; median step time over steps 5..{a.steps}, "
          f"median of {a.reps} interleaved runs")
    print(f"{'binary':<6} {'placement':<14} {'step':<12} {'s/step':>8} {'tokens/s':>9}   runs (s/step)")
    for k in kinds:
        print(f"{k[0]:<6} {k[1]:<14} {'pipelined' if k[2] else 'synchronous':<12} {med[k]:>8.4f} "
              f"{tokens_per_step / med[k]:>9.0f}   {' '.join(f'{x:.4f}' for x in step_s[k])}")
    for b, _ in bins:
        for pipelined in (True, False):
            mode = "pipelined" if pipelined else "synchronous"
            if "RAM" in places:
                for place in places:
                    if place != "RAM":
                        r = med[(b, "RAM", pipelined)] / med[(b, place, pipelined)]
                        print(f"{b}: {place} / RAM tokens/s, {mode} step: {r:.3f}")
        for place in places:
            r = med[(b, place, False)] / med[(b, place, True)]
            print(f"{b}: {place}: pipelined / synchronous tokens/s: {r:.3f}")
    if a.baseline:
        for place in places:
            for pipelined in (True, False):
                r = med[("base", place, pipelined)] / med[("new", place, pipelined)]
                same = losses[("new", place)] == losses[("base", place)]
                print(f"new / base tokens/s, {place}, {'pipelined' if pipelined else 'synchronous'}: {r:.3f}"
                      f" (final loss {'identical' if same else 'DIFFERS'})")
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
