#!/usr/bin/env python3
"""`strata finetune` against Hugging Face transformers on models transformers writes.

For each case a tiny model is built with transformers (random init, fp32) and
written with save_pretrained, in transformers 5's config layout
(rope_parameters) and rewritten into the 4.x layout (rope_theta and
rope_scaling at the top level). Strata fine-tunes it for one step on a u32 token
file; its validation loss before training (the same windows Strata's data
split defines: the validation part cut into seq+1-token windows at stride seq,
batch 0) must equal transformers' float64 loss on those windows to fp32
rounding (relative 1e-6). A negative control shows the check would catch the
old bug: the same model with the RoPE settings dropped (theta 10000, no
scaling) gives a loss that differs by far more than the tolerance. The export
must load back in transformers with the same RoPE settings it was given.
Per-tensor gradients: the CPU model ops' gradient of every parameter on the
validation windows (tests/train/grad_probe.cpp, the trainer's wiring) against
transformers' float64 autograd, relative per tensor (GRAD_TOL).

    hf_reference_test.py STRATA_BINARY GRAD_PROBE_BINARY

Exit 0: every case passed; 1: a case failed; 77: torch/transformers missing
(a failure instead when STRATA_REQUIRE_REFERENCE=1, as in CI).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

try:
    import torch
    import transformers
    from transformers import (AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
except ImportError as e:  # pragma: no cover - depends on the machine
    msg = f"hf_reference_test: skipped: cannot import torch/transformers ({e})"
    if os.environ.get("STRATA_REQUIRE_REFERENCE") == "1":
        print(msg.replace("skipped", "FAILED") + " (STRATA_REQUIRE_REFERENCE=1)")
        sys.exit(1)
    print(msg)
    sys.exit(77)

SEQ, BATCH = 64, 2
STEPS, LR, WD, CLIP = 3, 1e-3, 0.1, 1.0
STEP_TOL = 1e-3  # |strata - torch| / |torch - initial| over all weights after STEPS AdamW steps
TOL = 1e-6  # relative: fp32 compute against float64 (issue 11: within 1e-6 on the loss)
GRAD_TOL = 1e-5  # per tensor: |strata - transformers| / |transformers|, fp32 against float64

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
             rms_norm_eps=1e-5, initializer_range=0.15)

CASES = [
    ("default_theta_10k", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    ("default_theta_500k", dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    ("default_theta_500k_tied", dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                     tie_word_embeddings=True)),
    ("linear", dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    ("llama3", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                     "rope_theta": 500000.0})),
    ("yarn", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                   "rope_theta": 10000.0})),
    # Mistral: Llama's math with a sliding attention window (longer than SEQ here).
    ("mistral", dict(arch="mistral", sliding_window=4096,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    ("mistral_no_window_tied", dict(arch="mistral", sliding_window=None, tie_word_embeddings=True,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # bf16 weights, bf16 compute copies (--bf16): the reference keeps float64
    # masters and runs each forward/backward on their bf16 rounding, as Strata does.
    # Qwen2: q/k/v biases (random here, as trained models have them), tied.
    ("qwen2_tied", dict(arch="qwen2", tie_word_embeddings=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    ("qwen2_yarn", dict(arch="qwen2", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 32,
                                                       "rope_theta": 1000000.0})),
    # Qwen3: per-head q/k RMSNorm (random weights), head_dim 32 != 64 / 4.
    ("qwen3", dict(arch="qwen3", head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    ("qwen3_tied_hd8", dict(arch="qwen3", head_dim=8, tie_word_embeddings=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    ("bf16_qwen3", dict(arch="qwen3", bf16=True, head_dim=32,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    ("bf16_llama3", dict(bf16=True, rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                                     "rope_theta": 500000.0})),
    ("bf16_mistral_tied", dict(arch="mistral", bf16=True, tie_word_embeddings=True, sliding_window=None,
                               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # pad_token_id: nn.Embedding(padding_idx=) gives that row no gradient from
    # the lookup (a tied head still trains it); the token is in the data.
    ("pad_token_id", dict(pad_token_id=5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    ("qwen2_tied_pad_token_id", dict(arch="qwen2", pad_token_id=7, tie_word_embeddings=True,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
]


ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
         "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def to_v4_layout(config_path):
    """Rewrites a transformers-5 config.json into the 4.x layout."""
    with open(config_path) as f:
        c = json.load(f)
    rp = dict(c.pop("rope_parameters"))
    c["rope_theta"] = rp.pop("rope_theta")
    rp.pop("partial_rotary_factor", None)
    c["rope_scaling"] = None if rp.get("rope_type") == "default" else rp
    with open(config_path, "w") as f:
        json.dump(c, f, indent=2)


def val_windows(tokens, val_fraction):
    n = len(tokens)
    v = int(n * val_fraction)
    val = tokens[n - v:]
    wins = [val[i * SEQ:i * SEQ + SEQ + 1] for i in range((len(val) - 1) // SEQ)]
    return torch.stack(wins[:BATCH])


def torch_adamw(model_dir, train_windows, bf16=False):
    """STEPS AdamW steps in float64 with the Hugging Face Trainer's parameter
    groups (no decay on biases and norm weights), clipping, a constant lr."""
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).train()
    # Trainer.get_decay_parameter_names (transformers 5.24) without building a
    # Trainer (which needs accelerate): its patterns over its helper.
    from transformers.trainer_pt_utils import get_parameter_names
    patterns = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    decay = set(get_parameter_names(m, [torch.nn.LayerNorm], patterns))
    params = dict(m.named_parameters())
    groups = [{"params": [p for n, p in params.items() if n in decay], "weight_decay": WD},
              {"params": [p for n, p in params.items() if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    for _ in range(STEPS):
        opt.zero_grad()
        masters = {n: p.detach().clone() for n, p in params.items()} if bf16 else None
        if bf16:
            with torch.no_grad():
                for p in params.values():
                    p.copy_(p.to(torch.bfloat16).to(torch.float64))
        logits = m(input_ids=train_windows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), train_windows[:, 1:].reshape(-1))
        loss.backward()
        if bf16:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(masters[n])
        torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
        opt.step()
    return {n: p.detach() for n, p in m.state_dict().items()}, sorted(set(params) - decay)


def hf_loss(model_dir, windows, drop_rope=False):
    cfg = AutoConfig.from_pretrained(model_dir)
    if drop_rope:
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    m = AutoModelForCausalLM.from_pretrained(model_dir, config=cfg, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = m(input_ids=windows[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 windows[:, 1:].reshape(-1)).item()


def grad_check(probe, d, windows):
    """Per-tensor gradients of the CPU ops against transformers' float64 autograd."""
    windows.to(torch.int32).numpy().tofile(d + "/grad_windows.u32")
    B, T = windows.shape[0], windows.shape[1] - 1
    r = subprocess.run([probe, d + "/model", d + "/grad_windows.u32", str(B), str(T), d + "/grads.safetensors"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"grad_probe exited {r.returncode}: {r.stderr.strip()[-1000:]}"
    from safetensors import safe_open
    got = {}
    with safe_open(d + "/grads.safetensors", "pt") as f:
        probe_loss = float(f.metadata()["loss"])
        for k in f.keys():
            got[k] = f.get_tensor(k).double()
    m = AutoModelForCausalLM.from_pretrained(d + "/model", dtype=torch.float64).train()
    logits = m(input_ids=windows[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    loss.backward()
    worst, worst_name, problems = 0.0, "", []
    params = dict(m.named_parameters())
    for n, p in params.items():
        if n not in got:
            problems.append(f"no gradient for {n}")
            continue
        rel = ((got[n] - p.grad).norm() / p.grad.norm()).item() if p.grad.norm() > 0 else (got[n].norm().item())
        if rel > worst:
            worst, worst_name = rel, n
        if not rel <= GRAD_TOL:
            problems.append(f"gradient of {n} differs by {rel:.3e} relative (tolerance {GRAD_TOL})")
    extra = sorted(set(got) - set(params))
    if extra:
        problems.append(f"gradients for tensors transformers does not have: {extra[:3]}")
    lrel = abs(probe_loss - loss.item()) / abs(loss.item())
    if not lrel <= TOL:
        problems.append(f"grad_probe loss differs by {lrel:.3e}")
    return (worst, worst_name, len(params)), "; ".join(problems)


def save_tokenizer_and_generation_config(d):
    """A word-level tokenizer (the tokenizers library) and a generation config
    beside the weights, as a model from the Hub has them: the export must
    carry them (AutoTokenizer.from_pretrained(OUT/model), generate())."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(SHAPE["vocab_size"] - 3)])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(d)
    GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=True, temperature=0.7, top_p=0.9).save_pretrained(d)


def export_is_whole(src, out):
    """'' when OUT/model's tokenizer and generation config are the model's."""
    from transformers import AutoTokenizer, GenerationConfig
    text = "w1 w7 w42 zz w3"
    a, b = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(out)
    if a(text)["input_ids"] != b(text)["input_ids"] or b.eos_token != "</s>":
        return f"the export's tokenizer differs: {b(text)['input_ids']} vs {a(text)['input_ids']}"
    if GenerationConfig.from_pretrained(src).to_dict() != GenerationConfig.from_pretrained(out).to_dict():
        return "the export's generation_config.json differs from the model's"
    return ""


def run_case(strata, work, name, extra, layout, probe=None):
    d = os.path.join(work, f"{name}.{layout}")
    torch.manual_seed(1234)
    extra = dict(extra)
    C, M = ARCHS[extra.pop("arch", "llama")]
    bf16 = extra.pop("bf16", False)
    cfg = C(**SHAPE, **extra)
    model = M(cfg)
    with torch.no_grad():  # biases and q/k norm weights start at 0 / 1: make them matter
        for n, p in model.named_parameters():
            if n.endswith(".bias") or "q_norm" in n or "k_norm" in n:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in n else 0.0))
    model = model.to(torch.bfloat16 if bf16 else torch.float32)
    model.save_pretrained(d + "/model")
    save_tokenizer_and_generation_config(d + "/model")
    if layout == "v4":
        to_v4_layout(d + "/model/config.json")
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2 * (BATCH * SEQ + 1),), generator=g, dtype=torch.int64)
    tokens.to(torch.int32).numpy().tofile(d + "/tokens.u32")
    windows = val_windows(tokens, 0.5)
    want = hf_loss(d + "/model", windows)
    wrong = hf_loss(d + "/model", windows, drop_rope=True)
    cmd = [strata, "finetune", "--model", d + "/model", "--data", d + "/tokens.u32", "--data-format", "u32",
           "--val-fraction", "0.5", "--seq", str(SEQ), "--batch", str(BATCH), "--eval-batches", "1",
           "--steps", str(STEPS), "--lr", str(LR), "--schedule", "constant", "--weight-decay", str(WD),
           "--clip", str(CLIP), "--out", d + "/out", "--offload-params", "cpu",
           "--offload-optimizer", "cpu", "--device", "cpu", "--progress", "quiet"]
    if bf16:
        cmd += ["--bf16", "--export-dtype", "fp32"]  # the fp32 masters, to compare with the reference's
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return f"strata finetune exited {r.returncode}: {r.stderr.strip()[-2000:]}"
    got = None
    with open(d + "/out/metrics.jsonl") as f:
        for line in f:
            e = json.loads(line)
            if e.get("event") == "eval":
                got = e["val_loss"]
                break
    if got is None:
        return "no eval line in metrics.jsonl"
    rel = abs(got - want) / abs(want)
    control = abs(wrong - want) / abs(want)
    print(f"  {name:26s} {layout}: strata {got:.10f}  transformers (float64) {want:.10f}  rel {rel:.2e}"
          f"   (RoPE ignored: rel {control:.2e})")
    problems = []
    if not rel <= TOL:
        problems.append(f"loss differs by {rel:.3e} relative (tolerance {TOL})")
    plain_rope = extra.get("rope_parameters") == {"rope_type": "default", "rope_theta": 10000.0}
    if not plain_rope and not control > 10 * TOL:
        problems.append(f"negative control too weak: ignoring RoPE changes the loss by only {control:.3e}")
    # The export loads in transformers with the RoPE it was given.
    ref = AutoConfig.from_pretrained(d + "/model").rope_parameters
    exp = AutoConfig.from_pretrained(d + "/out/model").rope_parameters
    if ref != exp:
        problems.append(f"export changed the RoPE settings: {ref} -> {exp}")
    if probe:
        g, err = grad_check(probe, d, windows)
        if err:
            problems.append(err)
        if g:
            print(f"  {'':26s}     per-tensor gradients vs transformers float64 ({g[2]} tensors): worst "
                  f"{g[0]:.2e} ({g[1]})")
    err = export_is_whole(d + "/model", d + "/out/model")
    if err:
        problems.append(err)
    back = AutoModelForCausalLM.from_pretrained(d + "/out/model", dtype=torch.float64)
    if type(back) is not type(model):
        problems.append(f"export loads as {type(back).__name__}, not {type(model).__name__}")
    # STRATA_STEPS AdamW steps against torch.optim.AdamW: the training part is
    # exactly BATCH windows (no slack, so no shift), so every step's batch is
    # those windows, in some order (the loss and gradients do not depend on it).
    n = len(tokens) - int(len(tokens) * 0.5)
    train = tokens[:n]
    train_windows = torch.stack([train[i * SEQ:i * SEQ + SEQ + 1] for i in range((n - 1) // SEQ)])
    assert train_windows.shape[0] == BATCH
    want_w, undecayed = torch_adamw(d + "/model", train_windows, bf16)
    init = {k: v.double() for k, v in model.state_dict().items()}
    got_w = back.state_dict()
    num = den = 0.0
    worst = (0.0, "")
    for k, w in want_w.items():
        if k not in got_w:
            continue  # a tied lm_head
        diff = (got_w[k] - w).norm().item()
        upd = (w - init[k]).norm().item()
        num += diff ** 2
        den += upd ** 2
        if upd > 0 and diff / upd > worst[0]:
            worst = (diff / upd, k)
    ratio = (num ** 0.5) / (den ** 0.5)
    print(f"  {'':26s}     {STEPS} AdamW steps vs torch.optim.AdamW (float64, HF no-decay groups: "
          f"{len(undecayed)} tensors): |diff| / |update| = {ratio:.2e} (worst tensor {worst[0]:.2e} {worst[1]})")
    if not ratio <= STEP_TOL:
        problems.append(f"weights after {STEPS} steps differ from torch by {ratio:.3e} of the update (tolerance {STEP_TOL})")
    return "; ".join(problems)


# Every field of LlamaConfig and MistralConfig (transformers' own list: the
# __init__ signature and to_dict()) is changed in turn; Strata must either
# refuse the config naming the field, or give transformers' loss for the
# model that config describes. A field Strata ignored while it changed the
# math would fail here. Values per field: a change that matters if it is
# read at all. dtype is left out: it picks the precision, checked apart.
AUDIT_VALUES = {
    "vocab_size": [80], "hidden_size": [96], "intermediate_size": [96], "num_hidden_layers": [1, 3],
    "num_attention_heads": [2, 8], "num_key_value_heads": [1, 4], "hidden_act": ["gelu", "relu"],
    "max_position_embeddings": [128], "initializer_range": [0.3], "rms_norm_eps": [1e-2, 1e-8],
    "use_cache": [False], "pad_token_id": [0], "bos_token_id": [5], "eos_token_id": [6], "pretraining_tp": [2],
    "tie_word_embeddings": [True], "attention_bias": [True], "attention_dropout": [0.1], "mlp_bias": [True],
    "head_dim": [32, 8], "sliding_window": [SEQ // 2, 8 * SEQ, None],
    "rope_parameters": [{"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                        {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}],
    "output_hidden_states": [True], "return_dict": [False], "chunk_size_feed_forward": [4],
    "is_encoder_decoder": [True], "id2label": [{"0": "a", "1": "b", "2": "c"}], "label2id": [{"a": 0}],
    "problem_type": ["regression"], "architectures": [None], "transformers_version": ["4.40.0"],
    "output_attentions": [True], "_name_or_path": ["elsewhere"],
    # Qwen2/3: sliding windows on some layers, Qwen3's attention_bias.
    "use_sliding_window": [True], "max_window_layers": [0, 1],
    "layer_types": [["full_attention", "sliding_attention"], ["full_attention", "full_attention"]],
}
# Combined settings (one field's value only matters with another's).
AUDIT_COMBOS = {
    "qwen2": [dict(use_sliding_window=True, sliding_window=SEQ // 2, max_window_layers=1),
              dict(use_sliding_window=True, sliding_window=8 * SEQ, max_window_layers=0)],
    "qwen3": [dict(use_sliding_window=True, sliding_window=SEQ // 2, max_window_layers=1)],
}
AUDIT_SKIP = {"dtype": "precision, tested apart (bf16 cases)"}


def audit_fields(strata, work):
    import inspect
    problems, outcomes = [], []
    for arch, (C, M) in ARCHS.items():
        fields = set(C().to_dict()) | {n for n in inspect.signature(C.__init__).parameters if n not in ("self", "kwargs")}
        fields -= {"model_type"}
        todo = []
        for field in sorted(fields):
            if field in AUDIT_SKIP:
                continue
            if field not in AUDIT_VALUES:
                problems.append(f"{arch}: config field {field!r} has no audit value: add one (or a reason to skip)")
                continue
            todo += [(field, v) for v in AUDIT_VALUES[field]]
        todo += [("__combo__", v) for v in AUDIT_COMBOS.get(arch, [])]
        for field, value in todo:
            if field == "layer_types" and len(value) != SHAPE["num_hidden_layers"]:
                continue
            d = os.path.join(work, f"audit.{arch}.{field}.{len(outcomes)}")
            kw = dict(SHAPE)
            kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
            if field == "__combo__":
                kw.update(value)
            else:
                kw[field] = value
            try:
                torch.manual_seed(11)
                cfg = C(**kw)
                model = M(cfg).to(torch.float32)
                model.save_pretrained(d + "/model")
                # What transformers makes of the saved config (its loss is the truth).
                g = torch.Generator().manual_seed(5)
                vocab = AutoConfig.from_pretrained(d + "/model").vocab_size
                tokens = torch.randint(0, vocab, (2 * (BATCH * SEQ + 1),), generator=g, dtype=torch.int64)
                tokens.to(torch.int32).numpy().tofile(d + "/tokens.u32")
                want = hf_loss(d + "/model", val_windows(tokens, 0.5))
            except Exception as e:  # transformers itself rejects the value
                outcomes.append(f"{arch}.{field}={value!r}: transformers refuses ({type(e).__name__})")
                continue
            r = subprocess.run([strata, "finetune", "--model", d + "/model", "--data", d + "/tokens.u32",
                                "--data-format", "u32", "--val-fraction", "0.5", "--seq", str(SEQ), "--batch",
                                str(BATCH), "--eval-batches", "1", "--steps", "1", "--out", d + "/out",
                                "--offload-params", "cpu", "--offload-optimizer", "cpu", "--device", "cpu",
                                "--progress", "quiet", "--no-export"], capture_output=True, text=True)
            if r.returncode != 0:
                named = field in r.stderr or (field == "rope_parameters" and ("rope_type" in r.stderr or
                                                                              "partial_rotary_factor" in r.stderr))
                if field == "__combo__":
                    named = any(k in r.stderr for k in value)
                outcomes.append(f"{arch}.{field}={value!r}: refused" + ("" if named else " WITHOUT NAMING IT"))
                if not named:
                    problems.append(f"{arch}.{field}={value!r}: refused without naming the field: "
                                    f"{r.stderr.strip()[-300:]}")
                continue
            got = None
            for line in open(d + "/out/metrics.jsonl"):
                e = json.loads(line)
                if e.get("event") == "eval":
                    got = e["val_loss"]
                    break
            rel = abs(got - want) / abs(want)
            outcomes.append(f"{arch}.{field}={value!r}: trained, loss rel {rel:.1e}")
            if not rel <= TOL:
                problems.append(f"{arch}.{field}={value!r}: Strata trained it with loss {got}, transformers' "
                                f"model gives {want} (rel {rel:.2e}): the field changes the math and Strata "
                                f"ignored it")
            shutil.rmtree(d, ignore_errors=True)
    for o in outcomes:
        print("    audit " + o)
    print(f"  config field audit: {len(outcomes)} settings of {len(AUDIT_VALUES)} fields: "
          f"{sum('refused' in o and 'transformers' not in o for o in outcomes)} refused by name, "
          f"{sum('trained' in o for o in outcomes)} trained to transformers' loss, "
          f"{sum('transformers refuses' in o for o in outcomes)} refused by transformers itself")
    return problems


def sliding_window_refused(strata, work):
    """A Mistral window shorter than the sequence: refused by name, not ignored."""
    d = os.path.join(work, "mistral_short_window")
    torch.manual_seed(1)
    MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=SEQ // 2)).save_pretrained(d + "/model")
    torch.randint(0, SHAPE["vocab_size"], (4 * SEQ,), dtype=torch.int64).to(torch.int32).numpy().tofile(
        d + "/tokens.u32")
    r = subprocess.run([strata, "finetune", "--model", d + "/model", "--data", d + "/tokens.u32", "--data-format",
                        "u32", "--seq", str(SEQ), "--batch", "1", "--steps", "1", "--out", d + "/out", "--device",
                        "cpu", "--progress", "quiet"], capture_output=True, text=True)
    ok = r.returncode == 1 and "sliding_window" in r.stderr and f"--seq {SEQ // 2}" in r.stderr
    print(f"  mistral sliding_window {SEQ // 2} < seq {SEQ}: exit {r.returncode}: {r.stderr.strip()[:200]}")
    return "" if ok else f"not refused as expected (exit {r.returncode}): {r.stderr.strip()[:500]}"


def masked_accumulation(strata, work):
    """A loss mask with gradient accumulation: the step's gradient is that of the mean over every counted target
    of the step, as the Hugging Face Trainer weighs micro-batches (num_items_in_batch), not the mean of each
    micro-batch's own mean (which gave a 3% larger norm on a chat data set). The training part is exactly ACCUM
    windows of batch 1, so step 1 sees each once, in an order the sum does not depend on; the masks count
    from 3 to all SEQ targets per window."""
    accum = 3
    d = os.path.join(work, "masked_accumulation")
    torch.manual_seed(1234)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(d + "/model")
    g = torch.Generator().manual_seed(11)
    n = accum * SEQ + 1  # the training part: ACCUM windows of SEQ+1 tokens at stride SEQ, no slack
    tokens = torch.randint(0, SHAPE["vocab_size"], (2 * n,), generator=g, dtype=torch.int64)
    mask = torch.ones(2 * n, dtype=torch.uint8)
    for w, keep in enumerate((3, SEQ // 2, SEQ)):  # window w's targets are tokens w*SEQ+1 .. w*SEQ+SEQ
        mask[w * SEQ + 1 + keep:w * SEQ + 1 + SEQ] = 0
    tokens.to(torch.int32).numpy().tofile(d + "/tokens.u32")
    mask.numpy().tofile(d + "/tokens.mask")
    r = subprocess.run([strata, "finetune", "--model", d + "/model", "--data", d + "/tokens.u32", "--data-format",
                        "u32", "--loss-mask", d + "/tokens.mask", "--val-fraction", "0.5", "--seq", str(SEQ),
                        "--batch", "1", "--grad-accum", str(accum), "--steps", "1", "--clip", "0", "--out",
                        d + "/out", "--device", "cpu", "--progress", "quiet", "--no-export"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return f"strata finetune exited {r.returncode}: {r.stderr.strip()[-2000:]}"
    got = next(e for e in map(json.loads, open(d + "/out/metrics.jsonl")) if e.get("event") == "train")
    m = LlamaForCausalLM.from_pretrained(d + "/model", dtype=torch.float64).train()
    wins = [(tokens[w * SEQ:w * SEQ + SEQ + 1], mask[w * SEQ:w * SEQ + SEQ + 1]) for w in range(accum)]
    items = sum(int(k[1:].sum()) for _, k in wins)
    norms, losses = [], []
    for weigh_by_items in (True, False):
        m.zero_grad()
        total = 0.0
        for x, k in wins:
            labels = torch.where(k.bool(), x, torch.full_like(x, -100))[None]
            # transformers' own loss (labels shifted inside the model, -100 ignored); the Trainer's
            # num_items_in_batch makes it a sum over the step's targets / their number
            out = m(input_ids=x[None], labels=labels, num_items_in_batch=items if weigh_by_items else None)
            loss = out.loss if weigh_by_items else out.loss / accum  # else: each micro-batch's mean, averaged
            loss.backward()
            total += out.loss.item()
        norms.append(sum(p.grad.pow(2).sum().item() for p in m.parameters()) ** 0.5)
        losses.append(total)
    rel = abs(got["grad_norm"] - norms[0]) / norms[0]
    control = abs(norms[1] - norms[0]) / norms[0]
    loss_rel = abs(got["loss"] - losses[0]) / losses[0]
    print(f"  masked accumulation ({accum} micro-batches, {items} targets): grad norm strata {got['grad_norm']:.8f}"
          f"  transformers (float64, num_items_in_batch) {norms[0]:.8f}  rel {rel:.2e}; loss rel {loss_rel:.2e}"
          f"   (mean of micro-batch means: rel {control:.2e})")
    problems = []
    if not rel <= 1e-5:
        problems.append(f"grad norm differs by {rel:.3e} relative")
    if not loss_rel <= 1e-5:
        problems.append(f"loss differs by {loss_rel:.3e} relative")
    if not control > 100 * 1e-5:
        problems.append(f"negative control too weak: {control:.3e}")
    return "; ".join(problems)


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__)
        return 2
    strata = os.path.abspath(sys.argv[1])
    probe = os.path.abspath(sys.argv[2]) if len(sys.argv) == 3 else None
    work = tempfile.mkdtemp(prefix="strata-hf-ref-")
    print(f"hf_reference_test: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"seq {SEQ}, batch {BATCH}")
    failed = []
    try:
        for name, extra in CASES:
            for layout in ("v5", "v4"):
                err = run_case(strata, work, name, extra, layout, probe)
                if err:
                    failed.append(f"{name} ({layout} layout): {err}")
        err = sliding_window_refused(strata, work)
        if err:
            failed.append(f"sliding window: {err}")
        err = masked_accumulation(strata, work)
        if err:
            failed.append(f"masked accumulation: {err}")
        audit = audit_fields(strata, work)
        if audit:
            failed.append("config field audit: " + "; ".join(audit))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for f in failed:
        print("FAILED " + f)
    total = 2 * len(CASES) + 3
    print(f"hf_reference_test: {total - len(failed)} of {total} cases passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
