#!/usr/bin/env python3
"""tools/prepare_data.py against transformers' own tokenizer, and the loss mask end to end.

A byte-level BPE tokenizer is trained here with `tokenizers` (no download),
given a chat template, and saved with a tiny Llama model as a Hub-style model
directory. Then:
  * text files and {"text"} lines: the ids equal AutoTokenizer's, an EOS
    after each (none after a conversation, as TRL);
  * {"messages"} lines: the ids equal the chat template's rendering tokenized
    by AutoTokenizer, and the mask is 1 exactly on the assistant turns (their
    end-of-turn marker included);
  * bad inputs fail naming the file and line (a line without messages, a
    template that raises, a directory without a tokenizer), writing nothing;
  * strata finetune --loss-mask: the validation loss before training equals
    transformers' float64 loss with labels -100 at the masked targets.

    prepare_data_test.py STRATA_BINARY PREPARE_DATA_PY
Exit 0 pass, 1 fail, 77 skip (no torch/transformers/tokenizers; a failure
under STRATA_REQUIRE_REFERENCE=1).
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

try:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, \
        PreTrainedTokenizerFast
except ImportError as e:  # pragma: no cover
    msg = f"prepare_data_test: skipped: cannot import torch/transformers/tokenizers ({e})"
    if os.environ.get("STRATA_REQUIRE_REFERENCE") == "1":
        print(msg.replace("skipped", "FAILED") + " (STRATA_REQUIRE_REFERENCE=1)")
        sys.exit(1)
    print(msg)
    sys.exit(77)

CHAT_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3,
          "Offload engines stream parameters between GPU memory, host RAM and NVMe.",
          "Hello there! How are you today? I am fine, thank you for asking.",
          "Strata fine-tunes models larger than GPU memory on one workstation."] * 20

failures = []


def check(cond, what):
    print(("  ok    " if cond else "  FAIL  ") + what)
    if not cond:
        failures.append(what)


def make_model_dir(d):
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<|start|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    from tokenizers.processors import TemplateProcessing
    tk.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tk.token_to_id("<s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                  additional_special_tokens=["<|start|>", "<|end|>"])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(d)
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(d)


def run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    strata, prep = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    w = tempfile.mkdtemp(prefix="strata-prep-")
    model = os.path.join(w, "model")
    make_model_dir(model)
    tok = AutoTokenizer.from_pretrained(model)
    eos = tok.eos_token_id

    texts = ["Hello there! How are you today?\nSecond line of the first file.\n",
             "The lazy dog sleeps; the fox does not."]
    with open(os.path.join(w, "a.txt"), "w") as f:
        f.write(texts[0])
    with open(os.path.join(w, "b.jsonl"), "w") as f:
        f.write(json.dumps({"text": texts[1]}) + "\n\n")
    chats = [[{"role": "system", "content": "You are terse."},
              {"role": "user", "content": "What is Strata?"},
              {"role": "assistant", "content": "An offload engine."},
              {"role": "user", "content": "And the fox?"},
              {"role": "assistant", "content": "Quick and brown."}],
             [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]]
    with open(os.path.join(w, "c.jsonl"), "w") as f:
        for c in chats:
            f.write(json.dumps({"messages": c}) + "\n")

    out = os.path.join(w, "out", "train")
    r = run([sys.executable, prep, "--tokenizer", model, "--out", out, os.path.join(w, "a.txt"),
             os.path.join(w, "b.jsonl"), os.path.join(w, "c.jsonl")])
    check(r.returncode == 0, f"prepare_data runs ({r.stdout.strip()} {r.stderr.strip()[-500:]})")
    ids = list(torch.frombuffer(bytearray(open(out + ".u32", "rb").read()), dtype=torch.int32).tolist())
    mask = list(open(out + ".mask", "rb").read())
    meta = json.load(open(out + ".json"))
    want, want_mask = [], []
    for t in texts:
        e = tok(t)["input_ids"]
        want += e + [eos]
        # The BOS is no target (packed after another document it would be one of its EOS).
        want_mask += [0 if e[0] == tok.bos_token_id else 1] + [1] * len(e)
    chat_ranges = []
    for c in chats:
        rendered = tok.apply_chat_template(c, tokenize=False)
        e = tok(rendered, add_special_tokens=False)["input_ids"]
        chat_ranges.append((len(want), len(want) + len(e)))
        want += e  # no EOS after a conversation (TRL adds none: the template ends the turns)
        want_mask += [None] * len(e)
    check(ids == want, f"token ids equal AutoTokenizer's, EOS after text documents ({len(ids)} tokens)")
    check(len(mask) == len(ids), "one mask byte per token")
    check(all(m == x for m, x in zip(mask, want_mask) if x is not None),
          "text documents and EOS are trained on, their BOS not")
    check(meta["tokens"] == len(ids) and meta["documents"] == 4 and meta["vocab_size"] == len(tok),
          f"metadata ({meta['documents']} docs, {meta['tokens']} tokens)")
    for (s, e), c in zip(chat_ranges, chats):
        trained = tok.decode([ids[i] for i in range(s, e) if mask[i]])
        context = tok.decode([ids[i] for i in range(s, e) if not mask[i]])
        want_trained = "".join(m["content"] + "<|end|>\n" for m in c if m["role"] == "assistant")
        check(trained == want_trained, f"chat mask covers exactly the assistant turns: {trained!r}")
        check(all(m["content"] in context for m in c if m["role"] != "assistant"),
              "system and user turns are context only")

    # Bad inputs: named, exit 1, nothing written.
    with open(os.path.join(w, "bad.jsonl"), "w") as f:
        f.write(json.dumps({"text": "fine"}) + "\n" + json.dumps({"msgs": []}) + "\n")
    r = run([sys.executable, prep, "--tokenizer", model, "--out", os.path.join(w, "bad"), os.path.join(w, "bad.jsonl")])
    check(r.returncode == 1 and "bad.jsonl:2" in r.stderr and not os.path.exists(os.path.join(w, "bad.u32")),
          f"a line without messages names file:line: {r.stderr.strip()}")
    with open(os.path.join(w, "bad2.jsonl"), "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": 3}]}) + "\n")
    r = run([sys.executable, prep, "--tokenizer", model, "--out", os.path.join(w, "bad2"), os.path.join(w, "bad2.jsonl")])
    check(r.returncode == 1 and "bad2.jsonl:1" in r.stderr and "content" in r.stderr,
          f"a malformed message names file:line: {r.stderr.strip()}")
    with open(os.path.join(w, "bad3.jsonl"), "wb") as f:
        f.write(b'{"text": "fine"}\n{"text": "\xff\xfe"}\n')
    r = run([sys.executable, prep, "--tokenizer", model, "--out", os.path.join(w, "bad3"), os.path.join(w, "bad3.jsonl")])
    check(r.returncode == 1 and "bad3.jsonl:2" in r.stderr and "UTF-8" in r.stderr and
          not any(n.startswith("bad3.") and not n.endswith(".jsonl") for n in os.listdir(w)),
          f"a line that is not UTF-8 names file:line and leaves nothing: {r.stderr.strip()}")
    os.makedirs(os.path.join(w, "notok"))
    r = run([sys.executable, prep, "--tokenizer", os.path.join(w, "notok"), "--out", os.path.join(w, "x"),
             os.path.join(w, "a.txt")])
    check(r.returncode == 1 and "no tokenizer" in r.stderr, f"a directory without a tokenizer: {r.stderr.strip()}")
    broken = os.path.join(w, "broken")
    make_model_dir(broken)
    cfg = json.load(open(os.path.join(broken, "tokenizer_config.json")))
    cfg["chat_template"] = "{{ raise_exception('this template refuses') }}"
    json.dump(cfg, open(os.path.join(broken, "tokenizer_config.json"), "w"))
    for f in ("chat_template.jinja",):
        p = os.path.join(broken, f)
        if os.path.exists(p):
            with open(p, "w") as fh:
                fh.write(cfg["chat_template"])
    r = run([sys.executable, prep, "--tokenizer", broken, "--out", os.path.join(w, "y"), os.path.join(w, "c.jsonl")])
    check(r.returncode == 1 and "c.jsonl:1" in r.stderr and "template" in r.stderr,
          f"a failing chat template names file:line: {r.stderr.strip()[:300]}")

    # Found by an audit, each against what transformers / TRL do.
    def tokenizer_with(name, template):
        d = os.path.join(w, name)
        t = AutoTokenizer.from_pretrained(model)
        t.chat_template = template
        t.save_pretrained(d)
        return d, t

    def prepare(tokdir, *inputs):
        o = os.path.join(w, "o", os.path.basename(tokdir) + "_" + os.path.basename(inputs[0]))
        r = run([sys.executable, prep, "--tokenizer", tokdir, "--out", o] + list(inputs))
        ok = r.returncode == 0
        got = (list(torch.frombuffer(bytearray(open(o + ".u32", "rb").read()), dtype=torch.int32).tolist()),
               list(open(o + ".mask", "rb").read())) if ok else (None, None)
        return r, got[0], got[1]

    one = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]
    # EOS is not doubled: a text document that already ends with it gets none;
    # a conversation gets none whatever its template writes (Mistral-style:
    # </s> after assistant turns only; TRL adds no EOS to conversations).
    eos_tpl, t_eos = tokenizer_with("eos_tpl", "{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}"
                                               "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n"
                                               "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n"
                                               "{% endif %}")
    two = one + [{"role": "user", "content": "ok"}]
    with open(os.path.join(w, "e.jsonl"), "w") as f:
        for rec in ({"messages": one}, {"text": "done</s>"}, {"messages": two}):
            f.write(json.dumps(rec) + "\n")
    r, ids2, mask2 = prepare(eos_tpl, os.path.join(w, "e.jsonl"))
    rendered = [t_eos(t_eos.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"]
                for c in (one, two)]
    want2 = rendered[0] + t_eos("done</s>")["input_ids"] + rendered[1]
    check(ids2 == want2, f"no EOS appended where the document has one, nor after a conversation: {ids2} vs {want2}")
    # {% generation %} blocks: transformers' own assistant mask.
    gen_tpl, t_gen = tokenizer_with("gen_tpl", "{% for m in messages %}<|start|>{{ m['role'] }}\n"
                                               "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                                               "<|end|>{% endgeneration %}{% else %}{{ m['content'] }}<|end|>{% endif %}"
                                               "\n{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n"
                                               "{% endif %}")
    r, ids3, mask3 = prepare(gen_tpl, os.path.join(w, "c.jsonl"))
    hf_mask = []
    for c in chats:
        enc = t_gen.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        hf_mask += list(enc["assistant_masks"])
    check(r.returncode == 0 and mask3 == hf_mask, "{% generation %} blocks: the mask is transformers' "
                                                  "return_assistant_tokens_mask")
    # A default system prompt before a first assistant turn is context, not a target.
    sys_tpl, t_sys = tokenizer_with("sys_tpl", "{% if messages[0]['role'] != 'system' %}<|start|>system\nBe kind."
                                               "<|end|>\n{% endif %}" + CHAT_TEMPLATE)
    with open(os.path.join(w, "s.jsonl"), "w") as f:
        f.write(json.dumps({"messages": [{"role": "assistant", "content": "Welcome!"}]}) + "\n")
    r, ids4, mask4 = prepare(sys_tpl, os.path.join(w, "s.jsonl"))
    trained4 = t_sys.decode([i for i, k in zip(ids4 or [], mask4 or []) if k]) if r.returncode == 0 else r.stderr
    check(trained4 == "Welcome!<|end|>\n", f"a template's default system prompt is not trained: {trained4!r}")
    # A template that ignores add_generation_prompt: the header cannot be told apart; said, not silent.
    nogen_tpl, _ = tokenizer_with("nogen_tpl", CHAT_TEMPLATE.split("{% if add_generation_prompt")[0])
    r, _, _ = prepare(nogen_tpl, os.path.join(w, "c.jsonl"))
    check(r.returncode == 0 and "ignores add_generation_prompt" in r.stderr,
          f"a template without a generation prompt warns ({r.stderr.strip()[-160:]})")
    # .json arrays and any-case suffixes are JSON; "\r\n" in a text file is kept; empty documents skipped.
    with open(os.path.join(w, "arr.json"), "w") as f:
        json.dump([{"messages": chats[1]}, {"text": "x"}, {"text": ""}], f)
    with open(os.path.join(w, "up.JSONL"), "w") as f:
        f.write(json.dumps({"messages": chats[1]}) + "\n")
    with open(os.path.join(w, "lines.json"), "w") as f:  # datasets' to_json writes JSON lines
        f.write(json.dumps({"text": "x"}) + "\n" + json.dumps({"text": "x"}) + "\n")
    r, ids6, _ = prepare(model, os.path.join(w, "lines.json"))
    check(ids6 == (tok("x")["input_ids"] + [eos]) * 2, f"a .json file of JSON lines ({r.stderr.strip()[-120:]})")
    with open(os.path.join(w, "crlf.txt"), "wb") as f:
        f.write(b"one\r\ntwo\r\n")
    r, ids5, _ = prepare(model, os.path.join(w, "arr.json"), os.path.join(w, "up.JSONL"), os.path.join(w, "crlf.txt"))
    chat1 = tok(tok.apply_chat_template(chats[1], tokenize=False), add_special_tokens=False)["input_ids"]
    want5 = chat1 + tok("x")["input_ids"] + [eos] + chat1 + tok("one\r\ntwo\r\n")["input_ids"] + [eos]
    check(ids5 == want5 and "1 empty documents skipped" in r.stdout,
          f".json arrays, .JSONL, CRLF kept, an empty document skipped ({r.stdout.strip()[:120]})")
    # A record with both keys, a lone surrogate, deep nesting: named with file:line, nothing written.
    for name, line in (("both.jsonl", json.dumps({"text": "a", "messages": one})),
                       ("sur.jsonl", '{"text": "\\ud800"}'),
                       ("deep.jsonl", "[" * 100000 + "]" * 100000)):
        with open(os.path.join(w, name), "w") as f:
            f.write(line + "\n")
        r, _, _ = prepare(model, os.path.join(w, name))
        check(r.returncode == 1 and f"{name}:1: " in r.stderr and "Traceback" not in r.stderr,
              f"{name}: named with file:line ({r.stderr.strip()[-160:]})")

    # End to end: the masked loss against transformers with labels -100.
    big = os.path.join(w, "big.jsonl")
    with open(big, "w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                                             {"role": "assistant", "content": f"It is {2 * i}."}]}) + "\n")
    pre = os.path.join(w, "big", "train")
    r = run([sys.executable, prep, "--tokenizer", model, "--out", pre, big])
    check(r.returncode == 0, f"prepare_data on 40 conversations: {r.stdout.strip()}")
    seq, batch = 32, 2

    def first_val_loss(what, out, *flags, bs=batch):
        """Runs one step of strata finetune on the conversations; its first validation loss (None if it failed)."""
        r = run([strata, "finetune", "--model", model, "--data", pre + ".u32", "--loss-mask", pre + ".mask",
                 "--val-fraction", "0.5", "--batch", str(bs), "--steps", "1", "--out", os.path.join(w, out),
                 "--device", "cpu", "--offload-params", "cpu", "--offload-optimizer", "cpu", "--progress", "quiet",
                 *flags])
        check(r.returncode == 0, f"strata finetune {what} runs ({r.stderr.strip()[-300:]})")
        if r.returncode != 0:
            return None
        return next(json.loads(line)["val_loss"] for line in open(os.path.join(w, out, "metrics.jsonl"))
                    if json.loads(line).get("event") == "eval")

    got = first_val_loss("--loss-mask", "ft", "--seq", str(seq), "--eval-batches", "1")
    ids = torch.frombuffer(bytearray(open(pre + ".u32", "rb").read()), dtype=torch.int32).to(torch.int64)
    m = torch.frombuffer(bytearray(open(pre + ".mask", "rb").read()), dtype=torch.uint8).to(torch.bool)
    n = len(ids)
    v = int(n * 0.5)
    val, vm = ids[n - v:], m[n - v:]
    wins = [(val[i * seq:i * seq + seq + 1], vm[i * seq:i * seq + seq + 1]) for i in range((v - 1) // seq)][:batch]
    x = torch.stack([a for a, _ in wins])
    labels = torch.stack([torch.where(b[1:], a[1:], torch.full_like(a[1:], -100)) for a, b in wins])
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = hf(input_ids=x[:, :-1]).logits
        want_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                      ignore_index=-100).item()
        plain = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).item()
    counted = int((labels != -100).sum())
    rel = abs(got - want_loss) / want_loss if got is not None else float("inf")
    check(rel < 1e-6, f"masked validation loss {got} equals transformers' {want_loss:.10f} (rel {rel:.2e}; "
                      f"{counted} of {labels.numel()} targets counted; unmasked loss would be {plain:.6f})")

    # --documents: windows inside one conversation each, right-padded, against transformers' per-example batch
    # (padding with attention_mask 0 and labels -100, as TRL's SFT without packing).
    docs = list(struct.unpack(f"<{os.path.getsize(pre + '.docs') // 8}Q", open(pre + ".docs", "rb").read()))
    check(len(docs) == 40 and docs[0] == 0 and docs == sorted(set(docs)), f"PREFIX.docs holds the 40 starts ({docs[:4]})")
    seq = 64
    got = first_val_loss("--documents", "ftd", "--documents", pre + ".docs", "--seq", str(seq), "--eval-batches", "2")
    first_val = next(i for i, d in enumerate(docs) if d >= n - v)
    ends = docs[1:] + [n]
    val_docs = [(ids[docs[i]:min(ends[i], docs[i] + seq + 1)], m[docs[i]:min(ends[i], docs[i] + seq + 1)])
                for i in range(first_val, len(docs))]
    check(all(len(e) <= seq + 1 for e, _ in val_docs), "each validation conversation fits one window")

    def hf_eval_loss(examples, bs):
        """The Hugging Face Trainer's eval_loss over `examples` in batches of `bs` (the last one smaller):
        each batch's mean loss over its labels, weighted by its batch size (losses.repeat(batch_size))."""
        total = weight = 0.0
        for k in range(0, len(examples), bs):
            part = examples[k:k + bs]
            width = max(len(e) for e, _ in part)
            x = torch.zeros(len(part), width, dtype=torch.int64)
            am = torch.zeros(len(part), width, dtype=torch.int64)
            labels = torch.full((len(part), width), -100, dtype=torch.int64)  # the model shifts them
            for b, (e, em) in enumerate(part):
                x[b, :len(e)] = e
                am[b, :len(e)] = 1
                labels[b, :len(e)] = torch.where(em, e, torch.full_like(e, -100))
            with torch.no_grad():
                total += len(part) * hf(input_ids=x, attention_mask=am, labels=labels).loss.item()
            weight += len(part)
        return total / weight

    for bs, evals, label in ((batch, 2, "ftd"), (3, 100, "ftd3")):  # the second: every window, the last batch partial
        if bs != batch:
            got = first_val_loss("--documents --batch 3", label, "--documents", pre + ".docs", "--seq", str(seq),
                                 "--eval-batches", str(evals), bs=bs)
        shown = val_docs[:bs * evals]
        want_loss = hf_eval_loss(shown, bs)
        rel = abs(got - want_loss) / want_loss if got is not None else float("inf")
        check(len(val_docs) % 3 != 0 and rel < 1e-6,
              f"--documents validation loss {got} equals transformers' padded per-example batches of {bs} "
              f"({len(shown)} windows) {want_loss:.10f} (rel {rel:.2e})")

    import shutil
    shutil.rmtree(w, ignore_errors=True)
    print(f"prepare_data_test: {'FAILED ' + str(len(failures)) if failures else 'all passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
