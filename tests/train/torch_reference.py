#!/usr/bin/env python3
"""An independent PyTorch Llama (following Hugging Face's modeling_llama.py)
for tests/train/ops_torch_test.cpp: reads a model, tokens and targets from
the binary file the test writes, runs forward and backward in fp32 on the CPU
and writes logits, the loss and every parameter's gradient.

Usage: torch_reference.py IN OUT

IN (little-endian):  b"STRATAOPS1", then int64 dim, heads, kv_heads, head_dim,
  ffn_dim, vocab, layers, B, T, tied; float64 rms_eps, rope_theta; int32
  tokens[B*T]; int32 targets[B*T] (negative: ignored); uint8 mask[B*T]
  (0: ignored); then fp32 tensors in HF order: embed_tokens [vocab, dim];
  per layer input_layernorm, q, k, v, o, post_attention_layernorm, gate, up,
  down; norm; lm_head (untied only).
OUT: float64 loss, int64 count, fp32 logits [B*T, vocab], then the
  gradients of the tensors in the same order (tied: one embedding gradient,
  the sum of both uses, as autograd gives it).
"""
import struct
import sys

import numpy as np
import torch


def rms_norm(x, w, eps):
    # HF LlamaRMSNorm: fp32 variance, normalise, weight applied last.
    var = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(var + eps))


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_cos_sin(T, head_dim, theta):
    # HF LlamaRotaryEmbedding (default rope type): inv_freq in fp32 from an
    # int64 arange, angles pos * inv_freq in fp32, emb = cat(freqs, freqs).
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    pos = torch.arange(T, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def layer(x, p, cfg, cos, sin):
    B, T, D = x.shape
    H, KV, hd = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    h = rms_norm(x, p["input_layernorm"], cfg["eps"])
    q = (h @ p["q_proj"].T).view(B, T, H, hd).transpose(1, 2)
    k = (h @ p["k_proj"].T).view(B, T, KV, hd).transpose(1, 2)
    v = (h @ p["v_proj"].T).view(B, T, KV, hd).transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    rep = H // KV  # repeat_kv: kv head j serves query heads j*rep .. j*rep+rep-1
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(2, 3)) * (hd ** -0.5)
    causal = torch.triu(torch.full((T, T), float("-inf")), diagonal=1)
    probs = torch.softmax(scores + causal, dim=-1, dtype=torch.float32)
    att = (probs @ v).transpose(1, 2).reshape(B, T, H * hd)
    x = x + att @ p["o_proj"].T
    h = rms_norm(x, p["post_attention_layernorm"], cfg["eps"])
    mlp = (torch.nn.functional.silu(h @ p["gate_proj"].T) * (h @ p["up_proj"].T)) @ p["down_proj"].T
    return x + mlp


LAYER_NAMES = ["input_layernorm", "q_proj", "k_proj", "v_proj", "o_proj",
               "post_attention_layernorm", "gate_proj", "up_proj", "down_proj"]


def main():
    src, dst = sys.argv[1], sys.argv[2]
    buf = open(src, "rb").read()
    magic = b"STRATAOPS1"
    assert buf[:len(magic)] == magic, "bad magic"
    off = len(magic)
    ints = struct.unpack_from("<10q", buf, off)
    off += 80
    dim, heads, kv_heads, head_dim, ffn, vocab, layers, B, T, tied = ints
    eps, theta = struct.unpack_from("<2d", buf, off)
    off += 16
    n = B * T

    def take(dtype, count):
        nonlocal off
        a = np.frombuffer(buf, dtype=dtype, count=count, offset=off)
        off += a.nbytes
        return a.copy()

    tokens = torch.from_numpy(take(np.int32, n).astype(np.int64))
    targets = torch.from_numpy(take(np.int32, n).astype(np.int64))
    mask = torch.from_numpy(take(np.uint8, n).astype(np.int64))
    targets = torch.where((mask == 0) | (targets < 0), torch.full_like(targets, -100), targets)

    shapes = {"input_layernorm": (dim,), "q_proj": (heads * head_dim, dim),
              "k_proj": (kv_heads * head_dim, dim), "v_proj": (kv_heads * head_dim, dim),
              "o_proj": (dim, heads * head_dim), "post_attention_layernorm": (dim,),
              "gate_proj": (ffn, dim), "up_proj": (ffn, dim), "down_proj": (dim, ffn)}

    def param(shape):
        t = torch.from_numpy(take(np.float32, int(np.prod(shape)))).reshape(shape)
        return t.requires_grad_(True)

    params = [param((vocab, dim))]
    embed = params[0]
    lay = []
    for _ in range(layers):
        p = {name: param(shapes[name]) for name in LAYER_NAMES}
        params += [p[name] for name in LAYER_NAMES]
        lay.append(p)
    norm = param((dim,))
    params.append(norm)
    if tied:
        lm_head = embed
    else:
        lm_head = param((vocab, dim))
        params.append(lm_head)
    assert off == len(buf), f"trailing bytes: {len(buf) - off}"

    cfg = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "eps": eps}
    cos, sin = rope_cos_sin(T, head_dim, theta)
    x = embed[tokens.view(B, T)]
    for p in lay:
        x = layer(x, p, cfg, cos, sin)
    logits = rms_norm(x, norm, eps) @ lm_head.T
    flat = logits.view(n, vocab).float()
    count = int((targets >= 0).sum())
    # HF's loss: mean cross-entropy over targets != -100 (already shifted here).
    loss = torch.nn.functional.cross_entropy(flat, targets, ignore_index=-100, reduction="mean")
    loss.backward()

    with open(dst, "wb") as f:
        f.write(struct.pack("<dq", float(loss.item()), count))
        f.write(flat.detach().numpy().astype("<f4").tobytes())
        for t in params:
            f.write(t.grad.detach().numpy().astype("<f4").tobytes())


if __name__ == "__main__":
    torch.manual_seed(0)
    torch.set_num_threads(1)
    main()
