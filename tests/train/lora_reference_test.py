#!/usr/bin/env python3
"""`strata finetune --lora-*` against PEFT on models transformers writes.

For each case a tiny model is written by transformers (save_pretrained) and a
PEFT LoRA adapter is created on it with random A and B (init_lora_weights=False,
so every gradient path matters from the first step) and saved with PEFT's
save_pretrained. Strata starts from that adapter (--lora-adapter) and trains
STEPS AdamW steps; the reference is the same PeftModel in float64 trained by
torch.optim.AdamW with the Hugging Face Trainer's parameter groups, clipping
and a constant lr on the same batches. Checked:

- the loss before training equals PEFT's (relative 1e-6, fp32 vs float64);
- the adapter weights after STEPS steps are within 1e-3 of the update of the
  reference's (|strata - torch| / |torch - initial|, the fp32 noise floor);
- the exported adapter (OUT/adapter) loads with PeftModel.from_pretrained and
  gives the logits of the merged export (OUT/model, --lora-merge) loaded in
  transformers (relative 1e-5);
- only the adapters changed: the merged export minus the base is exactly
  scaling * B A of the exported adapter, and the base's bytes are untouched
  (Strata's own test checks the NVMe copy: tests/train/trainer_lora_test.cpp).

target_modules as PEFT writes it: "all-linear" (a list of full names), module
suffixes, and a regular expression (one case). Adapters Strata cannot train
exactly are refused naming the field (bad_adapters), patterns included: one
selecting a single layer's projection, one selecting lm_head, one in Python's
own syntax (an inline flag), and, edited by hand (PEFT refuses to make them),
an empty pattern, a bare name (selects nothing) and one selecting MLP blocks.

    lora_reference_test.py STRATA_BINARY

Exit 0: every case passed; 1: a case failed; 77: torch/transformers/peft
missing (a failure instead when STRATA_REQUIRE_REFERENCE=1, as in CI).
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
    import peft
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)
except ImportError as e:  # pragma: no cover - depends on the machine
    msg = f"lora_reference_test: skipped: cannot import torch/transformers/peft ({e})"
    if os.environ.get("STRATA_REQUIRE_REFERENCE") == "1":
        print(msg.replace("skipped", "FAILED") + " (STRATA_REQUIRE_REFERENCE=1)")
        sys.exit(1)
    print(msg)
    sys.exit(77)

SEQ, BATCH = 64, 2
STEPS, LR, WD, CLIP = 3, 2e-3, 0.1, 1.0
STEP_TOL = 1e-3
TOL = 1e-6
SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, initializer_range=0.15)
ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
         "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

CASES = [
    # PEFT's "all-linear" (saved as every layer's full module names) and its
    # suffix form: target_modules as PEFT matches them.
    ("llama_all_linear", dict(arch="llama", r=4, alpha=16, targets=ALL, peft_targets="all-linear")),
    ("qwen2_bf16_tied_rslora", dict(arch="qwen2", bf16=True, tie_word_embeddings=True, r=8, alpha=8,
                                    targets=["q_proj", "v_proj"], rslora=True)),
    ("qwen3_some_targets", dict(arch="qwen3", head_dim=32, r=2, alpha=5, targets=["k_proj", "o_proj", "down_proj"],
                                peft_targets=["self_attn.k_proj", "o_proj", "mlp.down_proj"])),
    # A regular expression (PEFT: re.fullmatch against each module's name).
    ("llama_regex_targets", dict(arch="llama", r=4, alpha=8, targets=["q_proj", "v_proj", "up_proj"],
                                 peft_targets=r".*\.(q_proj|v_proj|up_proj)")),
    # A list written for several model families: an entry naming no module of
    # this model ("c_attn", GPT-2's) is ignored, as PEFT ignores it.
    ("llama_list_with_a_foreign_name", dict(arch="llama", r=2, alpha=4, targets=["q_proj", "v_proj"],
                                            peft_targets=["q_proj", "v_proj", "c_attn"])),
]


def windows(tokens, start, count):
    return torch.stack([tokens[start + i * SEQ:start + i * SEQ + SEQ + 1] for i in range(count)])


def peft_loss(model, w):
    logits = model(input_ids=w[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))


def reference_steps(model_dir, adapter_dir, train_w):
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    m = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True).train()
    params = {n: p for n, p in m.named_parameters() if p.requires_grad}
    # The Trainer's rule: no decay on biases and norms (the adapters decay).
    nodecay = [n for n in params if "bias" in n or "norm" in n]
    groups = [{"params": [p for n, p in params.items() if n not in nodecay], "weight_decay": WD},
              {"params": [p for n, p in params.items() if n in nodecay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    for _ in range(STEPS):
        opt.zero_grad()
        peft_loss(m, train_w).backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP)
        opt.step()
    # PEFT's names without the adapter name, as in its saved files.
    return {n.replace(".default", ""): p.detach().clone() for n, p in params.items()}


def run_case(strata, work, name, c):
    d = os.path.join(work, name)
    c = dict(c)
    torch.manual_seed(4321)
    C, M = ARCHS[c.pop("arch")]
    bf16 = c.pop("bf16", False)
    r, alpha, targets, rslora = c.pop("r"), c.pop("alpha"), c.pop("targets"), c.pop("rslora", False)
    peft_targets = c.pop("peft_targets", targets)
    model = M(C(**SHAPE, **c))
    with torch.no_grad():  # biases and q/k norm weights start at 0 / 1: make them matter
        for n, p in model.named_parameters():
            if n.endswith(".bias") or "q_norm" in n or "k_norm" in n:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in n else 0.0))
    model = model.to(torch.bfloat16 if bf16 else torch.float32)
    model.save_pretrained(d + "/model")
    lcfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=peft_targets, lora_dropout=0.0, use_rslora=rslora,
                      init_lora_weights=False, task_type="CAUSAL_LM")
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(d + "/model", dtype=torch.float32), lcfg)
    pm.save_pretrained(d + "/init")
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2 * (BATCH * SEQ + 1),), generator=g, dtype=torch.int64)
    tokens.to(torch.int32).numpy().tofile(d + "/tokens.u32")
    n = len(tokens) - int(len(tokens) * 0.5)
    train_w = windows(tokens, 0, BATCH)
    val_w = windows(tokens, n, BATCH)
    assert (n - 1) // SEQ == BATCH
    # PEFT's loss before training, float64.
    base64 = AutoModelForCausalLM.from_pretrained(d + "/model", dtype=torch.float64)
    with torch.no_grad():
        want = peft_loss(PeftModel.from_pretrained(base64, d + "/init").eval(), val_w).item()
    cmd = [strata, "finetune", "--model", d + "/model", "--data", d + "/tokens.u32", "--data-format", "u32",
           "--val-fraction", "0.5", "--seq", str(SEQ), "--batch", str(BATCH), "--eval-batches", "1",
           "--steps", str(STEPS), "--lr", str(LR), "--schedule", "constant", "--weight-decay", str(WD),
           "--clip", str(CLIP), "--out", d + "/out", "--offload-params", "cpu", "--offload-optimizer", "cpu",
           "--device", "cpu", "--progress", "quiet", "--lora-adapter", d + "/init", "--lora-merge",
           "--export-dtype", "fp32"]
    if bf16:
        cmd += ["--bf16"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        return f"strata finetune exited {res.returncode}: {res.stderr.strip()[-2000:]}"
    got = None
    with open(d + "/out/metrics.jsonl") as f:
        for line in f:
            e = json.loads(line)
            if e.get("event") == "eval":
                got = e["val_loss"]
                break
    problems = []
    rel = abs(got - want) / abs(want)
    if not rel <= TOL:
        problems.append(f"loss before training {got} vs PEFT {want}: rel {rel:.3e} (tolerance {TOL})")
    # Adapter weights after STEPS steps against PEFT + torch AdamW.
    want_w = reference_steps(d + "/model", d + "/init", train_w)
    from safetensors.torch import load_file
    init_w = {k: v.double() for k, v in load_file(d + "/init/adapter_model.safetensors").items()}
    got_w = {k: v.double() for k, v in load_file(d + "/out/adapter/adapter_model.safetensors").items()}
    if set(got_w) != set(init_w):
        problems.append(f"exported adapter tensors differ from PEFT's: {sorted(set(got_w) ^ set(init_w))[:4]}")
    num = den = 0.0
    for k, w in want_w.items():
        if k not in got_w:
            problems.append(f"adapter tensor {k} missing from the export")
            continue
        num += (got_w[k] - w).norm().item() ** 2
        den += (w - init_w[k]).norm().item() ** 2
    ratio = num ** 0.5 / den ** 0.5 if den > 0 else float("inf")
    if not ratio <= STEP_TOL:
        problems.append(f"adapters after {STEPS} steps differ from PEFT + torch AdamW by {ratio:.3e} of the update "
                        f"(tolerance {STEP_TOL})")
    # The export loads in PEFT; the merged export gives the same logits.
    with open(d + "/out/adapter/adapter_config.json") as f:
        exported_cfg = json.load(f)
    base64 = AutoModelForCausalLM.from_pretrained(d + "/model", dtype=torch.float64)
    loaded = PeftModel.from_pretrained(base64, d + "/out/adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(d + "/out/model", dtype=torch.float64).eval()
    with torch.no_grad():
        a = loaded(input_ids=val_w[:, :-1]).logits
        b = merged(input_ids=val_w[:, :-1]).logits
    lrel = ((a - b).norm() / a.norm()).item()
    if not lrel <= 1e-5:
        problems.append(f"PEFT with the exported adapter vs the merged export: logits differ by {lrel:.3e} relative")
    if sorted(exported_cfg["target_modules"]) != sorted(targets) or exported_cfg["r"] != r:
        problems.append(f"adapter_config.json says r={exported_cfg['r']} targets={exported_cfg['target_modules']}")
    # Every field PEFT writes for a LoraConfig, at PEFT's values where Strata does what PEFT's default
    # does (peft_version is PEFT's own: Strata is not PEFT).
    peft_cfg = LoraConfig(r=r, lora_alpha=exported_cfg["lora_alpha"], target_modules=targets).to_dict()
    missing = sorted(set(peft_cfg) - set(exported_cfg) - {"peft_version"})
    if missing:
        problems.append(f"adapter_config.json lacks fields PEFT writes: {missing}")
    for k in ("megatron_core", "loftq_config", "use_qalora", "qalora_group_size", "ensure_weight_tying", "use_dora",
              "lora_bias", "fan_in_fan_out", "bias", "layer_replication", "trainable_token_indices"):
        if k in exported_cfg and exported_cfg[k] != peft_cfg[k]:
            problems.append(f"adapter_config.json {k} = {exported_cfg[k]!r}, PEFT's default {peft_cfg[k]!r}")
    # Only the adapted projections moved, by exactly the merge (fp32 rounding).
    base_sd = AutoModelForCausalLM.from_pretrained(d + "/model", dtype=torch.float64).state_dict()
    for k, w in merged.state_dict().items():
        if not any(f".{t}." in k for t in targets) and not torch.equal(w, base_sd[k]):
            problems.append(f"merged export changed a tensor that has no adapter: {k}")
            break
    print(f"  {name:24s} loss rel {rel:.2e}   adapters after {STEPS} steps vs PEFT+AdamW {ratio:.2e} of the update"
          f"   PEFT(adapter) vs merged logits {lrel:.2e}")
    return "; ".join(problems)


def bad_adapters(strata, work):
    """An adapter Strata cannot reproduce is refused naming the field."""
    d = os.path.join(work, "bad")

    def run_with(adapter, out_suffix, *flags):
        return subprocess.run([strata, "finetune", "--model", d + "/model", "--data", d + "/tokens.u32",
                               "--data-format", "u32", "--seq", str(SEQ), "--batch", "1", "--steps", "1",
                               "--out", adapter + out_suffix, "--device", "cpu", "--progress", "quiet",
                               "--val-fraction", "0", "--lora-adapter", adapter, *flags],
                              capture_output=True, text=True)

    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(d + "/model")
    toks = torch.randint(0, SHAPE["vocab_size"], (4 * (SEQ + 1),), dtype=torch.int64)
    toks.to(torch.int32).numpy().tofile(d + "/tokens.u32")
    problems = []
    cases = [("use_dora", dict(use_dora=True)), ("rank_pattern", dict(rank_pattern={"q_proj": 2})),
             ("layers_to_transform", dict(layers_to_transform=[0])),
             ("modules_to_save", dict(modules_to_save=["lm_head"])), ("bias", dict(bias="all")),
             # a projection of one layer only, and a module Strata has no adapter for
             ("target_modules", dict(target_modules=["model.layers.1.self_attn.q_proj"])),
             ("target_modules", dict(target_modules=["q_proj", "lm_head"])),
             # the same as patterns, and one in Python's own syntax (an inline flag)
             ("target_modules", dict(target_modules=r"model\.layers\.1\.self_attn\.q_proj")),
             ("target_modules", dict(target_modules=r".*\.q_proj|lm_head")),
             ("target_modules", dict(target_modules=r"(?i).*\.Q_PROJ")),
             # PEFT replaces the base weight by a residual when it loads these
             ("init_lora_weights", dict(init_lora_weights="pissa")),
             ("init_lora_weights", dict(init_lora_weights="olora"))]
    for i, (field, lcfg) in enumerate(cases):
        a = f"{d}/{field}-{i}"
        lcfg = {"target_modules": ["q_proj"], **lcfg}
        pm = get_peft_model(AutoModelForCausalLM.from_pretrained(d + "/model"),
                            LoraConfig(r=2, task_type="CAUSAL_LM", **lcfg))
        pm.save_pretrained(a)
        res = subprocess.run([strata, "finetune", "--model", d + "/model", "--data", d + "/tokens.u32",
                              "--data-format", "u32", "--seq", str(SEQ), "--batch", "1", "--steps", "1",
                              "--out", a + "-out", "--device", "cpu", "--progress", "quiet", "--lora-adapter", a],
                             capture_output=True, text=True)
        if res.returncode == 0 or field not in res.stderr:
            problems.append(f"an adapter with {field} was not refused by name (exit {res.returncode}: "
                            f"{res.stderr.strip()[-300:]})")
    # Written by hand (PEFT itself refuses to make these): an empty pattern,
    # a bare name (re.fullmatch selects nothing), a pattern that also
    # selects the MLP module and its activation (PEFT: "not supported").
    edited = ["", "q_proj", r".*\.mlp.*"]
    for i, pattern in enumerate(edited):
        a = f"{d}/edited-{i}"
        shutil.copytree(f"{d}/target_modules-5", a)
        with open(a + "/adapter_config.json") as f:
            acfg = json.load(f)
        acfg["target_modules"] = pattern
        with open(a + "/adapter_config.json", "w") as f:
            json.dump(acfg, f)
        res = subprocess.run([strata, "finetune", "--model", d + "/model", "--data", d + "/tokens.u32",
                              "--data-format", "u32", "--seq", str(SEQ), "--batch", "1", "--steps", "1",
                              "--out", a + "-out", "--device", "cpu", "--progress", "quiet", "--lora-adapter", a],
                             capture_output=True, text=True)
        if res.returncode == 0 or "target_modules" not in res.stderr:
            problems.append(f"an adapter with target_modules {pattern!r} was not refused by name (exit "
                            f"{res.returncode}: {res.stderr.strip()[-300:]})")
    cases += edited
    plain = f"{d}/plain"
    get_peft_model(AutoModelForCausalLM.from_pretrained(d + "/model"),
                   LoraConfig(r=2, task_type="CAUSAL_LM", target_modules=["q_proj"])).save_pretrained(plain)
    # Edited by hand too: a LoRA variant switched on by its config over plain
    # lora_A/lora_B tensors (PEFT's KaSA truncates the base weights), and
    # target_parameters with no target_modules (PEFT's way to adapt
    # parameters, e.g. MoE experts), each named.
    for i, (field, edit) in enumerate((("kasa_config", {"kasa_config": {}}),
                                       ("target_parameters", {"target_modules": [],
                                                              "target_parameters": ["mlp.experts.gate_up_proj"]}))):
        a = f"{d}/variant-{i}"
        shutil.copytree(plain, a)
        with open(a + "/adapter_config.json") as f:
            acfg = json.load(f)
        acfg.update(edit)
        with open(a + "/adapter_config.json", "w") as f:
            json.dump(acfg, f)
        res = run_with(a, "-out")
        cases.append(field)
        if res.returncode == 0 or f'"{field}"' not in res.stderr:
            problems.append(f"an adapter with {field} was not refused by name (exit {res.returncode}: "
                            f"{res.stderr.strip()[-300:]})")
    # A PyTorch-pickle adapter: named, with the conversion.
    a = f"{d}/bin"
    shutil.copytree(plain, a)
    os.rename(a + "/adapter_model.safetensors", a + "/adapter_model.bin")
    res = run_with(a, "-out")
    cases.append("adapter_model.bin")
    if res.returncode == 0 or "adapter_model.bin (a PyTorch pickle)" not in res.stderr:
        problems.append(f"a .bin adapter was not named (exit {res.returncode}: {res.stderr.strip()[-300:]})")
    print(f"  refused adapters: {len(cases) - len(problems)} of {len(cases)} named the field")
    # Accepted as PEFT accepts them: init_lora_weights in another case (PEFT
    # lower-cases it); --no-export still writes the adapter, the run's
    # result, and --lora-merge with it is refused by name.
    a = f"{d}/gaussian"
    shutil.copytree(plain, a)
    with open(a + "/adapter_config.json") as f:
        acfg = json.load(f)
    acfg["init_lora_weights"] = "Gaussian"
    with open(a + "/adapter_config.json", "w") as f:
        json.dump(acfg, f)
    res = run_with(a, "-out", "--no-export")
    if res.returncode != 0:
        problems.append(f"init_lora_weights \"Gaussian\" was refused: {res.stderr.strip()[-300:]}")
    elif not os.path.isfile(a + "-out/adapter/adapter_model.safetensors") or os.path.exists(a + "-out/model"):
        problems.append(f"--no-export in a LoRA run wrote {sorted(os.listdir(a + '-out'))}: the adapter and no model")
    res = run_with(a, "-out2", "--no-export", "--lora-merge")
    if res.returncode == 0 or "--lora-merge" not in res.stderr:
        problems.append(f"--no-export --lora-merge was not refused by name: {res.stderr.strip()[-300:]}")
    return "; ".join(problems)


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    strata = os.path.abspath(sys.argv[1])
    work = tempfile.mkdtemp(prefix="strata-lora-ref-")
    print(f"lora_reference_test: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"peft {peft.__version__}")
    failed = []
    try:
        for name, c in CASES:
            err = run_case(strata, work, name, c)
            if err:
                failed.append(f"{name}: {err}")
        err = bad_adapters(strata, work)
        if err:
            failed.append(f"refusals: {err}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for f in failed:
        print("FAILED " + f)
    total = len(CASES) + 1
    print(f"lora_reference_test: {total - len(failed)} of {total} cases passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
