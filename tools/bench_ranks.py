#!/usr/bin/env python3
"""Step time and bytes communicated of `strata finetune` with 1, 2 and 3 host
ranks (ZeRO stages 3 and 2; under mpirun over MPI, or torchrun-style over TCP)
on the same global batch, in one run.

  python3 tools/bench_ranks.py --strata build/tools/strata [--steps 12] [--stages 3,2] [--grad-accum K]
      [--baseline OTHER/strata] [--reps R] [--dir /tmp/sbr]
      [--transports mpi,tcp --launch-ranks build/tests/comm/launch_ranks]

Prints, per world size N: the median step time (steps 3.. of the run) and its
ratio to the 1-rank run measured here, the bytes each rank sent per step (the
engine's stats().comm_bytes, from metrics.jsonl) and their ratio to ZeRO's
volume per rank per step for psi bytes of parameters in the compute dtype:
stage 3, 3 * psi * (N-1)/N (all-gather in forward, again in backward,
reduce-scatter of the gradients; Strata sends less where backward's first
acquires find their groups still gathered in the device buffers); stages 1-2, 2 * psi * (N-1)/N (reduce-scatter,
all-gather of the updated shards). With --grad-accum K (micro-batches per step
on every rank) stage 2 and 3 reduce-scatter every micro-batch, so their volume
grows by (K-1) gradient reduce-scatters; stage 1 sums each rank's micro-batches
on its device and reduce-scatters once per step: ZeRO's 2 * psi whatever K.
Strata reduce-scatters fp32 gradients (the
exact rank-order sum), so with a bf16 model its volume is 4/3 (stage 3) and 3/2
(stage 2) of those formulas and with an fp32 model exactly them; the embedding and head are gathered as the
trainer acquires them (the head once per micro-batch for forward and backward).
Ranks on one host share its cores: the step time of N ranks on a 2-core
machine measures overhead, not speed-up. With --baseline, every run is made
with that binary too, right after (interleaved, --reps times each), and the
table adds its median step time and the ratio of the two (new / baseline:
below 1 is faster); the final losses of the two must be equal. With
--transports mpi,tcp every N-rank run is made with both communicators
(mpirun; launch_ranks, which starts the ranks torchrun-style); their final
losses must be equal.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

from bench_model import run, small_model_and_data


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata", required=True)
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--transports", default="mpi", help="communicators of the N-rank runs: mpi, tcp or both")
    ap.add_argument("--launch-ranks", default="build/tests/comm/launch_ranks",
                    help="the torchrun-style launcher for --transports tcp")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--global-batch", type=int, default=6)
    ap.add_argument("--dtype", default="bf16", help="compute dtype of the run (--bf16 or fp32)")
    ap.add_argument("--stages", default="3,2", help="ZeRO stages to run with N > 1 ranks (3, 2, 1)")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step on every rank")
    ap.add_argument("--baseline", default=None, help="another strata binary, run interleaved with --strata")
    ap.add_argument("--reps", type=int, default=1, help="runs of each configuration (and binary)")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    base = a.dir or tempfile.mkdtemp(prefix="strata-bench-ranks-")
    os.makedirs(base, exist_ok=True)
    model, data = small_model_and_data(a.strata, base)
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    env = dict(os.environ, OMPI_MCA_btl_vader_single_copy_mechanism="none", OMPI_MCA_rmaps_base_oversubscribe="1")
    rows = []
    psi_bytes = None
    stages = [int(x) for x in a.stages.split(",")]
    transports = a.transports.split(",")
    if not set(transports) <= {"mpi", "tcp"}:
        sys.exit(f"--transports {a.transports}: expected mpi, tcp or mpi,tcp")
    runs = [(1, stages[0], "-")] + [(n, st, t) for n in (2, 3) for st in stages for t in transports]
    def one_run(binary, n, stage, transport):
        out = os.path.join(base, f"out{n}-{stage}")
        cfg_path = os.path.join(base, f"stage{stage}.json")
        with open(cfg_path, "w") as f:
            json.dump({"zero_optimization": {"stage": stage}}, f)
        shutil.rmtree(out, ignore_errors=True)
        cmd = [binary, "finetune", "--model", model, "--data", data, "--seq", "128", "--batch",
               str(a.global_batch // n), "--steps", str(a.steps), "--eval-batches", "1", "--no-export",
               "--progress", "quiet", "--out", out, "--device", "cpu", "--config", cfg_path]
        if a.grad_accum > 1:
            cmd += ["--grad-accum", str(a.grad_accum)]
        if a.dtype == "bf16":
            cmd.append("--bf16")
        if n > 1 and transport == "mpi":
            cmd = [a.mpirun, "--oversubscribe", "--allow-run-as-root", "-np", str(n)] + cmd
        elif n > 1:
            cmd = [a.launch_ranks, str(n)] + cmd
        run(cmd, env)
        lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"train"' in l]
        steps = [l["step_s"] for l in lines[2:]] or [l["step_s"] for l in lines]
        comm = [b["comm_bytes"] - p["comm_bytes"] for p, b in zip(lines, lines[1:])]
        return steps, statistics.median(comm) if comm else 0, lines[-1]["loss"]

    base_s = {}
    final = {}
    for n, stage, transport in runs:
        if a.global_batch % n:
            continue
        steps, base_steps = [], []
        for _ in range(a.reps):
            s_new, c, loss = one_run(a.strata, n, stage, transport)
            steps += s_new
            if final.setdefault((n, stage), loss) != loss:
                sys.exit(f"{n} ranks, stage {stage}: final loss {loss} over {transport}, {final[(n, stage)]} over "
                         f"the other transport")
            if a.baseline:
                s_base, _, base_loss = one_run(a.baseline, n, stage, transport)
                base_steps += s_base
                if base_loss != loss:
                    sys.exit(f"{n} ranks, stage {stage}: final loss {loss} here, {base_loss} with the baseline")
        rows.append((n, stage, transport, statistics.median(steps), c))
        if a.baseline:
            base_s[(n, stage, transport)] = statistics.median(base_steps)
    params = 0
    # Parameters of the model: from the 1-rank run's export-free plan is not
    # at hand; count them from the config (Llama: embed, layers, norm, tied or not).
    d, f_, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kvh = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = d // cfg["num_attention_heads"]
    per_layer = d * d * 2 + 2 * d * kvh * hd + 3 * d * f_ + 2 * d
    params = v * d + L * per_layer + d + (0 if cfg.get("tie_word_embeddings") else v * d)
    esz = 2 if a.dtype == "bf16" else 4
    psi_bytes = params * esz
    t1 = rows[0][3]
    print(f"model: {params} parameters, {a.dtype} compute; global batch {a.global_batch} x 128 tokens; "
          f"{a.grad_accum} micro-batch(es) per step; {a.steps} steps; medians of steps 3..{a.steps}")
    extra = f" {'baseline s':>10} {'new/base':>8}" if a.baseline else ""
    print(f"{'ranks':>5} {'stage':>5} {'via':>4} {'step s':>9} {'vs 1 rank':>10} {'sent/rank/step':>15} "
          f"{'ZeRO k*psi(N-1)/N':>18} {'ratio':>6}{extra}")
    for n, stage, transport, s, c in rows:
        zero = (3 if stage == 3 else 2) * psi_bytes * (n - 1) / n
        ratio = f"{c / zero:.3f}" if zero else "-"
        key = (n, stage, transport)
        extra = f" {base_s[key]:>10.4f} {s / base_s[key]:>8.3f}" if a.baseline else ""
        print(f"{n:>5} {stage if n > 1 else '-':>5} {transport:>4} {s:>9.4f} {s / t1:>10.3f} {c:>15.0f} "
              f"{zero:>18.0f} {ratio:>6}{extra}")
    if not a.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
