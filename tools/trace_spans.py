#!/usr/bin/env python3
"""Where a training step's time goes, from a trace `strata finetune --trace T`
wrote: the milliseconds per step of each span, per thread, over the steps
after the first few (the start-up's uploads and first reads are left out).

  python3 tools/trace_spans.py TRACE [TRACE ...] [--skip 6] [--only acquire_wait,wait_update]

Steps are counted by the trainer's `embed_forward` spans (one per forward);
the window runs from the forward of step --skip to that of the last step.
Spans nest (`acquire_wait` inside `layer_forward`; `wait_read` inside
`optimizer_step`), so a thread's rows need not add up to the step. The
trainer's waits (`acquire_wait`: a group's upload not ready; `wait_update`:
a pipelined update not done; the difference of `embed_forward` and
`layer_forward` between two placements) are what an offload adds to the step.
Threads are named by their role (trainer, uploader, optimizer, accumulator,
io-queue N).
"""
import argparse
import collections
import json


# A thread's role, by a span only it records.
ROLES = [("embed_forward", "trainer"), ("optimizer_step", "optimizer"), ("upload_group", "uploader"),
         ("accumulate", "accumulator"), ("save_checkpoint", "trainer")]


def spans(path):
    with open(path) as f:
        t = json.load(f)
    return [e for e in (t["traceEvents"] if isinstance(t, dict) else t) if e.get("ph") == "X"]


def summary(path, skip):
    ev = spans(path)
    forwards = sorted(e["ts"] for e in ev if e["name"] == "embed_forward")
    if len(forwards) < skip + 2:
        raise SystemExit(f"{path}: {len(forwards)} forwards; need more than {skip + 1} (train longer or lower --skip)")
    lo, hi = forwards[skip], forwards[-1]
    steps = sum(1 for x in forwards if lo <= x < hi)
    names = collections.defaultdict(collections.Counter)
    for e in ev:
        names[e["tid"]][e["name"]] += 1
    io_queues = sorted(tid for tid, c in names.items() if set(c) <= {"nvme_read", "nvme_write", "h2d", "d2h"})

    def thread(tid):
        if tid in io_queues:
            return f"io-queue {io_queues.index(tid)}"
        for span, who in ROLES:
            if span in names[tid]:
                return who
        return names[tid].most_common(1)[0][0] + " thread"

    total = collections.defaultdict(float)
    for e in ev:
        if lo <= e["ts"] < hi:
            total[(thread(e["tid"]), e["name"])] += e["dur"]
    return (hi - lo) / steps / 1000, steps, {k: v / steps / 1000 for k, v in total.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--skip", type=int, default=6, help="steps left out at the start (default 6)")
    ap.add_argument("--only", default="", help="comma-separated span names to print (default: all)")
    a = ap.parse_args()
    only = set(filter(None, a.only.split(",")))
    for path in a.traces:
        step_ms, steps, rows = summary(path, a.skip)
        print(f"{path}: {step_ms:.2f} ms per step over {steps} steps")
        for (thread, name), ms in sorted(rows.items()):
            if not only or name in only:
                print(f"  {thread:<28} {name:<24} {ms:8.2f} ms/step")


if __name__ == "__main__":
    main()
