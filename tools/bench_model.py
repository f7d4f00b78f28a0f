"""The small model and text the Python benches train on (bench_ranks.py,
bench_bytes.py): a 3.08M-parameter Llama (4 layers, dim 256, byte vocabulary)
written by `strata init-model`, and 4000 lines of a toy grammar."""
import os
import subprocess
import sys


def run(cmd, env=None):
    """Runs cmd; exits naming it, with the tail of its output, if it fails."""
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r.stdout


def small_model_and_data(strata, base):
    """BASE/model and BASE/data.txt; returns their paths."""
    model = os.path.join(base, "model")
    run([strata, "init-model", "--layers", "4", "--dim", "256", "--heads", "8", "--kv-heads", "4", "--ffn-dim",
         "704", "--vocab", "256", "--dtype", "fp32", "--seed", "3", "--out", model])
    data = os.path.join(base, "data.txt")
    words = ["cat", "dog", "bird", "fox", "owl", "fish"]
    with open(data, "w") as f:
        for i in range(4000):
            f.write(f"the {words[i % 6]} sees the {words[(i * 7 + i // 6) % 6]} . {i % 10} plus {i // 10 % 10} "
                    f"is {i % 10 + i // 10 % 10} .\n")
    return model, data
