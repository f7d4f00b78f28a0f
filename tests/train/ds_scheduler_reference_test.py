#!/usr/bin/env python3
"""`strata finetune --config` with a DeepSpeed "scheduler" section against
DeepSpeed's own schedules (deepspeed.runtime.lr_schedules).

For each case a run of a few steps past the warm-up and the decay writes
every step's lr to metrics.jsonl; DeepSpeed's class, built on a torch
optimizer with the config's optimizer lr and stepped once after each optimizer
step as DeepSpeed's engine steps it, gives the lr of each step. They must be
equal bit for bit (the same double operations and libm). Sections Strata
cannot follow are refused naming the key: OneCycle, "auto", an unknown
parameter, per-group lists, warmup_max_lr on WarmupCosineLR, a missing
total_num_steps, and --warmup beside the section (--lr beside one that sets
its own peak).

    ds_scheduler_reference_test.py STRATA_BINARY

Exit 0: every case passed; 1: a case failed; 77: deepspeed missing (a
failure instead when STRATA_REQUIRE_REFERENCE=1, as in CI).
"""
import json
import os
import subprocess
import sys
import tempfile

STEPS = 12


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    strata = sys.argv[1]
    try:
        import torch
        from deepspeed.runtime import lr_schedules as ds
    except Exception as e:  # ImportError, or a deepspeed that cannot start here
        if os.environ.get("STRATA_REQUIRE_REFERENCE") == "1":
            print(f"FAIL: deepspeed does not import ({e!r}) and STRATA_REQUIRE_REFERENCE=1")
            return 1
        print(f"skip: deepspeed does not import: {e!r}")
        return 77
    work = tempfile.mkdtemp(prefix="strata-ds-sched-")
    model = os.path.join(work, "model")
    subprocess.run([strata, "init-model", "--layers", "1", "--dim", "32", "--heads", "2", "--kv-heads", "1",
                    "--ffn-dim", "64", "--vocab", "256", "--dtype", "fp32", "--out", model],
                   check=True, capture_output=True)
    data = os.path.join(work, "data.txt")
    with open(data, "w") as f:
        f.write("the quick brown fox jumps over the lazy dog. " * 200)

    def finetune(name, cfg, *flags):
        path = os.path.join(work, name + ".json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        out = os.path.join(work, name)
        res = subprocess.run([strata, "finetune", "--model", model, "--data", data, "--seq", "16", "--batch", "2",
                              "--steps", str(STEPS), "--val-fraction", "0", "--progress", "quiet", "--no-export",
                              "--config", path, "--out", out, *flags], capture_output=True, text=True)
        return res, out

    lr = 2e-3
    cases = [
        ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 5}),
        ("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"}),  # max: the optimizer's lr
        ("WarmupLR", {"warmup_num_steps": 1}),  # counts as 2
        ("WarmupDecayLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 3,
                           "total_num_steps": 9, "warmup_type": "linear"}),
        ("WarmupDecayLR", {"warmup_num_steps": 4, "total_num_steps": 10.5}),
        ("WarmupCosineLR", {"total_num_steps": 9, "warmup_num_steps": 3, "warmup_min_ratio": 0.1,
                            "cos_min_ratio": 0.05}),
        ("WarmupCosineLR", {"total_num_steps": 8, "warmup_num_steps": 2, "warmup_type": "linear"}),
    ]
    problems = []
    for n, (kind, params) in enumerate(cases):
        cfg = {"optimizer": {"type": "AdamW", "params": {"lr": lr}}, "scheduler": {"type": kind, "params": params}}
        res, out = finetune(f"case{n}", cfg)
        if res.returncode != 0:
            problems.append(f"{kind} {params}: exit {res.returncode}: {res.stderr.strip()[-300:]}")
            continue
        with open(os.path.join(out, "metrics.jsonl")) as f:
            got = [json.loads(line)["lr"] for line in f if json.loads(line).get("event") == "train"]
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        sched = getattr(ds, kind)(opt, **params)
        want = []
        for _ in range(STEPS):
            want.append(opt.param_groups[0]["lr"])
            sched.step()
        if got != want:
            problems.append(f"{kind} {params}: lr per step {got} != DeepSpeed's {want}")
        print(f"  {kind:15s} {json.dumps(params):110s} {'ok' if got == want else 'DIFFERS'}")

    refused = [
        ("OneCycle", {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}, ()),
        ("warmup_max_lr", {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}, ()),
        ("warmup_steps", {"type": "WarmupLR", "params": {"warmup_steps": 10}}, ()),
        ("warmup_min_lr", {"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 0.0]}}, ()),
        ("warmup_max_lr", {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "warmup_max_lr": 1e-3}}, ()),
        ("total_num_steps", {"type": "WarmupDecayLR", "params": {}}, ()),
        ("warmup_type", {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, ()),
        ("--warmup", {"type": "WarmupLR", "params": {}}, ("--warmup", "3")),
        ("--lr", {"type": "WarmupDecayLR", "params": {"total_num_steps": 9}}, ("--lr", "1e-3")),  # peak: 0.001
        ("--lr", {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}, ("--lr", "1e-3")),
    ]
    for n, (name, section, flags) in enumerate(refused):
        res, _ = finetune(f"bad{n}", {"scheduler": section}, *flags)
        if res.returncode != 1 or name not in res.stderr:
            problems.append(f"a scheduler section with {name} was not refused by name (exit {res.returncode}: "
                            f"{res.stderr.strip()[-300:]})")
    print(f"  refused sections: {len(refused) - sum('not refused' in p for p in problems)} of {len(refused)} "
          "named the key")
    subprocess.run(["rm", "-rf", work], check=False)
    if problems:
        for p in problems:
            print("FAIL:", p)
        return 1
    print("DeepSpeed scheduler sections: every lr equals DeepSpeed's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
