#!/usr/bin/env python3
"""Benchmarks of the PyTorch package against plain PyTorch in the same run
(BENCHMARKS.md, issue 12). Medians of interleaved repetitions.

  train   tokens/s of a Llama trained through strata.torch.initialize with
          parameters and optimizer state on NVMe (--dir), against the same
          model trained in RAM by plain PyTorch (torch.optim.AdamW, fused);
          ratio strata / torch (target >= 0.8).
          --device cuda: both models on the GPU (cuda:0): strata.torch's GPU
          path (NVMe offload, the engine's CUDA backend) against plain
          PyTorch with everything on the GPU (AdamW fused), each step timed
          to a torch.cuda.synchronize(). Unverified: never ran on a GPU yet.
  adam    one optimizer step over --adam-params fp32 parameters:
          strata.torch.CPUAdamW against torch.optim.AdamW(fused=True),
          torch.optim.AdamW(foreach=True) and DeepSpeedCPUAdam when deepspeed
          is importable and its CPU op builds here (not with --device cuda);
          CPUAdamW with its states on NVMe (nvme_path=--dir); and, for the
          record, the same update through the engine's own optimizer step
          (reduce_grad, step, weights copied back through an acquire or
          read_param), the design CPUAdamW's NVMe mode does not use
          (docs/python.md).

    python bench_torch.py --dir /var/tmp/sb [--only adam] [--json]
    python bench_torch.py --dir /var/tmp/sb --device cuda --json
"""
import argparse
import ctypes
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.utils.dlpack
from transformers import LlamaConfig, LlamaForCausalLM

import strata.torch as st
from strata import _lib


def lm_loss(model, x):
    logits = model(input_ids=x[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def make_model(a):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=a.vocab, hidden_size=a.dim, intermediate_size=a.ffn,
                                        num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                        num_key_value_heads=max(1, a.heads // 4)))


def bench_train(a, work):
    cuda = a.device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).to(dev) for _ in range(a.reps + 2)]
    ref = make_model(a).to(dev)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, fused=True)
    nvme = os.path.join(work, "nvme")
    os.makedirs(nvme)
    cfg = {"gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
    engine, _, _, _ = st.initialize(model=make_model(a).to(dev), config=cfg)

    def torch_step(x):
        opt.zero_grad()
        loss = lm_loss(ref, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()

    def strata_step(x):
        engine.backward(lm_loss(engine, x))
        engine.step()

    torch_step(data[0])
    strata_step(data[0])
    t_torch, t_strata = [], []
    for x in data[2:]:
        sync()
        t0 = time.perf_counter()
        torch_step(x)
        sync()
        t_torch.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        strata_step(x)
        sync()
        t_strata.append(time.perf_counter() - t0)
    s = engine.stats()
    device_memory = engine.device_memory
    engine.destroy()
    tok = a.batch * a.seq
    mt, ms = statistics.median(t_torch), statistics.median(t_strata)
    out = {"params": sum(p.numel() for p in ref.parameters()), "tokens_per_step": tok,
           f"torch_{'gpu' if cuda else 'ram'}_tokens_per_s": tok / mt, "strata_nvme_tokens_per_s": tok / ms,
           "ratio": mt / ms, "nvme_bytes": s["tier_bytes"]["nvme"], "reps": len(t_torch)}
    if cuda:
        out.update({"gpu": torch.cuda.get_device_name(dev), "strata_device_memory": device_memory,
                    "strata_device_tier_bytes": s["tier_bytes"]["device"]})
    return out


def engine_step_alternative(a, work):
    """The update through the engine's optimizer step, as a trainer drives it:
    masters and moments on NVMe, fp32 compute copies in host RAM; per step
    begin_micro_batch(1), reduce_grad (DLPack), set_group_lr, step, then the
    weights copied back into the torch tensor, through an acquire of the
    compute copy or read_param of the master. Seconds: {acquire, read_param}."""
    n = a.adam_params
    nvme = tempfile.mkdtemp(prefix="engine-step-", dir=work)
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": nvme},
                                 "offload_param": {"device": "cpu"}}}
    d = (_lib.ParamDesc * 1)()
    d[0].struct_size = ctypes.sizeof(_lib.ParamDesc)
    d[0].name = d[0].group = b"p"
    d[0].ndim = 1
    d[0].shape[0] = n
    d[0].dtype = _lib.DTYPE_F32
    opts = _lib.EngineOptions()
    _lib.check(_lib.strata_engine_options_init(ctypes.byref(opts)))
    cfg_bytes = json.dumps(cfg).encode()
    opts.config_json = cfg_bytes
    opts.device_kind = _lib.DEVICE_HOST
    e, s = ctypes.c_void_p(), ctypes.c_void_p()
    _lib.check(_lib.strata_engine_create(ctypes.byref(opts), d, 1, ctypes.byref(e)))
    _lib.check(_lib.strata_stream_create(e, b"bench", ctypes.byref(s)), e)
    p, grad = torch.randn(n), torch.randn(n)
    _lib.check(_lib.strata_engine_load_param(e, 0, p.data_ptr(), _lib.DTYPE_F32, n), e)
    r = _lib.StepResult()
    r.struct_size = ctypes.sizeof(r)

    def step(readback):
        _lib.check(_lib.strata_engine_begin_micro_batch(e, 1), e)
        _lib.reduce_grad_capsule(e, 0, torch.utils.dlpack.to_dlpack(grad), s)
        _lib.check(_lib.strata_engine_set_group_lr(e, 0, 1e-3), e)
        _lib.check(_lib.strata_engine_step(e, -1.0, ctypes.byref(r)), e)
        if readback == "read_param":
            _lib.check(_lib.strata_engine_read_param(e, 0, p.data_ptr(), _lib.DTYPE_F32, n), e)
            return
        ptrs, count = (ctypes.c_void_p * 1)(), ctypes.c_size_t()
        _lib.check(_lib.strata_engine_acquire(e, 0, s, ptrs, 1, ctypes.byref(count)), e)
        _lib.check(_lib.strata_stream_synchronize(s), e)  # host backend: the CPU reads it now
        p.copy_(torch.utils.dlpack.from_dlpack(_lib.param_capsule(e, 0)))
        _lib.check(_lib.strata_engine_release(e, 0, s), e)

    out = {}
    try:
        for readback in ("acquire", "read_param"):
            step(readback)
            ts = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                step(readback)
                ts.append(time.perf_counter() - t0)
            out[readback] = statistics.median(ts)
    finally:
        _lib.strata_stream_destroy(s)
        _lib.strata_engine_destroy(e)
        shutil.rmtree(nvme, ignore_errors=True)
    return out


def bench_adam(a, work):
    n = a.adam_params
    out = {}

    def timed(make, name, grad=None):
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n) if grad is None else grad
        try:
            o = make([p])
        except Exception as e:  # an optimizer this machine cannot build
            out[name] = f"not measured: {type(e).__name__}: {str(e)[:120]}"
            return
        o.step()
        ts = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            o.step()
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts)
        if hasattr(o, "close"):
            o.close()

    timed(lambda ps: st.CPUAdamW(ps, lr=1e-3, weight_decay=0.01), "strata_cpu_adamw")
    timed(lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True), "torch_adamw_fused")
    timed(lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True), "torch_adamw_foreach")

    def deepspeed_adam(ps):
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(ps, lr=1e-3, weight_decay=0.01)
    timed(deepspeed_adam, "deepspeed_cpu_adam")
    nvme = os.path.join(work, "cpuadamw-nvme")
    timed(lambda ps: st.CPUAdamW(ps, lr=1e-3, weight_decay=0.01, nvme_path=nvme), "strata_cpu_adamw_nvme")
    alt = engine_step_alternative(a, work)
    out["engine_step_nvme_acquire"] = alt["acquire"]
    out["engine_step_nvme_read_param"] = alt["read_param"]
    s = out["strata_cpu_adamw"]
    for k in list(out):
        if k != "strata_cpu_adamw" and isinstance(out[k], float):
            out[f"{k}_over_strata"] = out[k] / s
    out["params"] = n
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a directory on the SSD (NVMe files go under it)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1376)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--adam-params", type=int, default=64 << 20)
    ap.add_argument("--only", choices=("train", "adam"), help="run one of the two benchmarks")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: both models on cuda:0 (strata.torch's GPU path against plain PyTorch on the GPU)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    work = tempfile.mkdtemp(prefix="strata-bench-torch-", dir=a.dir)
    try:
        res = {"torch": torch.__version__, "threads": torch.get_num_threads(), "device": a.device}
        if a.only in (None, "train"):
            res["train"] = bench_train(a, work)
        if a.only in (None, "adam") and a.device == "cpu":
            res["adam"] = bench_adam(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(res, indent=2))
        return
    if "train" in res:
        t = res["train"]
        print(f"train: Llama {t['params'] / 1e6:.1f}M params, {t['tokens_per_step']} tokens/step, medians of "
              f"{t['reps']}")
        if a.device == "cuda":
            print(f"  plain PyTorch on the GPU   {t['torch_gpu_tokens_per_s']:8.1f} tokens/s   ({t['gpu']})")
        else:
            print(f"  plain PyTorch in RAM       {t['torch_ram_tokens_per_s']:8.1f} tokens/s")
        print(f"  strata.torch, NVMe         {t['strata_nvme_tokens_per_s']:8.1f} tokens/s   ratio {t['ratio']:.3f}")
    if "adam" not in res:
        return
    ad = res["adam"]
    print(f"adam: one step over {ad['params'] / 1e6:.0f}M fp32 params, seconds (median of {a.reps})")
    for k, v in ad.items():
        if k in ("params",) or k.endswith("_over_strata"):
            continue
        ratio = ad.get(f"{k}_over_strata")
        print(f"  {k:28s} {v if isinstance(v, str) else f'{v:.4f}'}" + (f"   / strata = {ratio:.2f}" if ratio else ""))


if __name__ == "__main__":
    main()
