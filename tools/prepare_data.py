#!/usr/bin/env python3
"""Tokenize training data with a model's own tokenizer for `strata finetune`.

    python3 tools/prepare_data.py --tokenizer MODEL_DIR --out data/train INPUT [INPUT ...]
    strata finetune --model MODEL_DIR --data data/train.u32 --data-format u32 \\
        --loss-mask data/train.mask ...

The tokenizer is the model's own, loaded with transformers' AutoTokenizer from
MODEL_DIR (tokenizer.json / tokenizer_config.json, as downloaded from the Hub):
Strata never tokenizes by itself, so the ids are the ones the model was
trained with.

Inputs, one document each (the format is chosen per file by its suffix, in
any case, or by --format):
  *.txt, anything else      the whole file is one document (bytes as they
                            are: "\r\n" is kept);
  *.jsonl                   one JSON object per line:
     {"text": "..."}                       a document;
     {"messages": [{"role": ..., "content": ...}, ...]}
                                           a conversation, rendered with the
                                           tokenizer's chat template; only the
                                           assistant turns are trained on;
  *.json                    one such object, an array of them, or JSON lines
                            (a Hugging Face dataset's to_json writes those).
Documents are written back to back. A text document gets the tokenizer's EOS
after it (--no-eos: none), trained on, unless its ids end with it already; a
conversation gets none, its chat template ending each turn (TRL's SFT adds
the EOS to non-conversational examples only). An empty text document is
skipped. A text document's ids are exactly
AutoTokenizer's tokenizer(text)["input_ids"] (with the BOS the tokenizer adds,
if any). A conversation's mask is transformers' own
(apply_chat_template(return_assistant_tokens_mask=True)) when the template
marks the assistant's text with {% generation %}; otherwise each assistant
turn's text after the generation prompt (a template that ignores
add_generation_prompt gets the role header trained too, with a warning).
With --documents PREFIX.docs, strata finetune cuts windows inside each
document, padded, as Hugging Face's per-example batches (TRL's SFT without
packing); without it, documents are packed into one stream cut into --seq
windows: attention crosses document boundaries and a window may start inside
a conversation (its earlier turns out of sight).

Outputs:
  PREFIX.u32   little-endian uint32 token ids;
  PREFIX.mask  one byte per token: 1 = a target the loss counts (text: every
               token but a leading BOS, the EOS included; chat: the tokens
               of assistant turns, their end-of-turn markers included),
               0 = context only;
  PREFIX.docs  little-endian uint64 token offsets where each document starts
               (strata finetune --documents);
  PREFIX.json  what was done: tokenizer, vocab size, EOS id, documents, tokens,
               trained tokens, library versions.

Errors name the file and line and exit 1; nothing is written then (the
outputs are written to temporary names and renamed at the end).
"""
import argparse
import json
import os
import re
import sys


def fail(msg):
    print(f"prepare_data: {msg}", file=sys.stderr)
    sys.exit(1)


def load_tokenizer(path):
    try:
        import transformers
        from transformers import AutoTokenizer
    except ImportError as e:
        fail(f"needs transformers and tokenizers from PyPI ({e}); pip install transformers tokenizers")
    if not os.path.isdir(path):
        fail(f"{path}: not a directory (give the model directory holding tokenizer.json / tokenizer_config.json)")
    has = [f for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
           if os.path.exists(os.path.join(path, f))]
    if not has:
        fail(f"{path}: no tokenizer here (none of tokenizer.json, tokenizer_config.json, tokenizer.model, "
             f"vocab.json); copy the model's tokenizer files next to its config.json")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types here
        fail(f"{path}: transformers cannot load the tokenizer: {type(e).__name__}: {e}")
    return tok, transformers.__version__


class Packer:
    """Streams documents into the temporary output files a buffer at a time,
    so memory stays bounded whatever the corpus size."""

    FLUSH = 1 << 20  # tokens

    def __init__(self, eos, ids_file, mask_file, docs_file):
        import array
        self.array = array
        self.eos = eos
        self.ids_file, self.mask_file, self.docs_file = ids_file, mask_file, docs_file
        self.ids = array.array("I")
        self.mask = bytearray()
        self.starts = array.array("Q")
        self.docs = self.tokens = self.trained = self.empty = 0

    def add(self, ids, mask, chat=False):
        """One document, then, for a text document, the EOS unless it ends with it already (a tokenizer that
        appends it), trained on. A conversation gets none: its chat template ends each turn (Llama-3's
        <|eot_id|>, Qwen's <|im_end|>, Mistral's </s>), and TRL's SFT adds the EOS to non-conversational
        examples only."""
        assert len(ids) == len(mask)
        if ids and max(ids) >= 2 ** 32:
            fail(f"token id {max(ids)} does not fit in uint32")
        self.starts.append(self.tokens + len(self.ids))
        self.ids.extend(ids)
        self.mask.extend(mask)
        if self.eos is not None and not chat and not (ids and ids[-1] == self.eos):
            self.ids.append(self.eos)
            self.mask.append(1)
        if self.starts[-1] == self.tokens + len(self.ids):  # nothing added (no ids, no EOS): no document
            self.starts.pop()
            self.empty += 1
            return
        self.docs += 1
        if len(self.ids) >= self.FLUSH:
            self.flush()

    def flush(self):
        if sys.byteorder != "little":
            self.ids.byteswap()
            self.starts.byteswap()
        self.ids.tofile(self.ids_file)
        self.starts.tofile(self.docs_file)
        self.starts = self.array.array("Q")
        self.mask_file.write(self.mask)
        self.tokens += len(self.ids)
        self.trained += sum(self.mask)
        self.ids = self.array.array("I")
        self.mask = bytearray()


def text_doc(tok, text):
    ids = tok(text)["input_ids"]
    mask = [1] * len(ids)
    if ids and ids[0] == tok.bos_token_id:
        mask[0] = 0  # packed after another document, the BOS would be a target of its EOS
    return ids, mask


_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_CHECKED_GEN_PROMPT = set()  # ids of the tokenizers checked


def _check_generation_prompt(tok, where):
    """Warns, once per tokenizer, when its template writes nothing for add_generation_prompt: an assistant
    turn's header (its role marker) then cannot be told from its text and is trained too."""
    if id(tok) in _CHECKED_GEN_PROMPT:
        return
    _CHECKED_GEN_PROMPT.add(id(tok))
    probe = [{"role": "user", "content": "x"}]
    try:
        ignores = (tok.apply_chat_template(probe, tokenize=False, add_generation_prompt=True) ==
                   tok.apply_chat_template(probe, tokenize=False, add_generation_prompt=False))
    except Exception:  # a template that wants another first message: the real ones say (render below)
        return
    if ignores:
        print(f"prepare_data: warning: {where}: the chat template ignores add_generation_prompt, so an assistant "
              f"turn's header (its role marker) cannot be told from its text and is trained too", file=sys.stderr)


def _render_empty(tok):
    """The template's text before a first assistant turn: an empty conversation with the generation prompt
    ("" where the template cannot render one)."""
    try:
        return tok.apply_chat_template([], tokenize=False, add_generation_prompt=True)
    except Exception:
        return ""


def chat_doc(tok, messages, where):
    if not isinstance(messages, list) or not messages:
        fail(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            fail(f"{where}: messages[{i}] must be an object with string \"role\" and \"content\", got "
                 f"{json.dumps(m)[:200]}")
    if not getattr(tok, "chat_template", None):
        fail(f"{where}: the tokenizer has no chat template (tokenizer_config.json \"chat_template\"), so a "
             f"conversation cannot be rendered as the model expects")
    if not getattr(tok, "is_fast", False):
        fail(f"{where}: the tokenizer is not a fast (Rust) tokenizer; the assistant mask needs its offsets")

    def render(msgs, gen):
        try:
            return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        except Exception as e:
            fail(f"{where}: the chat template failed: {type(e).__name__}: {e}")

    if not any(m["role"] == "assistant" for m in messages):
        fail(f"{where}: the conversation has no assistant turn: nothing to train on")
    template = tok.get_chat_template() if hasattr(tok, "get_chat_template") else tok.chat_template
    if isinstance(template, str) and _GENERATION.search(template):
        # The template marks what the assistant generates ({% generation %}):
        # transformers' own mask, as the Trainer and TRL take it.
        try:
            enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        except Exception as e:
            fail(f"{where}: the chat template failed: {type(e).__name__}: {e}")
        ids, mask = list(enc["input_ids"]), [int(bool(b)) for b in enc["assistant_masks"]]
        if not any(mask):
            fail(f"{where}: the chat template's {{% generation %}} blocks mark no token of the assistant turns")
        return ids, mask
    _check_generation_prompt(tok, where)
    full = render(messages, False)
    # Character spans of the assistant turns: the text a turn adds after the
    # generation prompt. Templates whose earlier text changes as turns are
    # added cannot be masked this way: refused, never guessed.
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        # The text before the turn, generation prompt included (for the
        # first message too: a template may add a default system prompt).
        before = render(messages[:i], True) if i > 0 else _render_empty(tok)
        upto = render(messages[:i + 1], False)
        if i == 0 and (not before or not upto.startswith(before)):
            # A template that cannot render an empty conversation (it reads
            # messages[0]): the turn starts where its text does.
            k = upto.rfind(m["content"]) if m["content"] else -1
            before = upto[:k] if k >= 0 else ""
        if not upto.startswith(before) or not full.startswith(upto):
            fail(f"{where}: the chat template renders earlier turns differently once later ones are added; "
                 f"the assistant turns cannot be located (turn {i})")
        spans.append((len(before), len(upto)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = []
    for (a, b) in offsets:
        mask.append(1 if any(a < e and b > s for (s, e) in spans) else 0)
    return ids, mask


def _lines(f, path):
    """The lines of binary file f, decoded one by one, so a byte that is not
    UTF-8 is an error naming its line."""
    for n, raw in enumerate(f, 1):
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as e:
            fail(f"{path}:{n}: not UTF-8 ({e})")


def add_record(tok, p, obj, where):
    """One JSON record (a JSONL line, an element of a .json array): a document or a conversation."""
    if not isinstance(obj, dict):
        fail(f"{where}: expected an object with \"text\" or \"messages\"")
    if "messages" in obj and "text" in obj:
        fail(f"{where}: the object has both \"text\" and \"messages\"; keep one")
    try:
        if "messages" in obj:
            ids, mask = chat_doc(tok, obj["messages"], where)
            p.add(ids, mask, chat=True)
        elif "text" in obj:
            if not isinstance(obj["text"], str):
                fail(f"{where}: \"text\" must be a string")
            if obj["text"] == "":
                p.empty += 1  # no document (a lone EOS would be trained)
                return
            ids, mask = text_doc(tok, obj["text"])
            p.add(ids, mask)
        else:
            fail(f"{where}: the object has neither \"text\" nor \"messages\" (keys: "
                 f"{', '.join(list(obj)[:10])})")
    except (TypeError, ValueError, RecursionError) as e:  # the tokenizer's (a lone surrogate) and the like
        fail(f"{where}: {type(e).__name__}: {e}")


def add_inputs(a, tok, p):
    """Every input file, document by document, into the packer."""
    for path in a.inputs:
        if not os.path.isfile(path):
            fail(f"{path}: not a regular file")
        suffix = os.path.splitext(path)[1].lower()
        fmt = a.format if a.format != "auto" else {".jsonl": "jsonl", ".json": "json"}.get(suffix, "text")
        if fmt == "text":
            try:
                with open(path, encoding="utf-8", newline="") as f:  # "\r\n" kept, as the tokenizer sees it
                    text = f.read()
            except UnicodeDecodeError as e:
                fail(f"{path}: not UTF-8 text ({e})")
            if text == "":
                p.empty += 1
                continue
            try:
                ids, mask = text_doc(tok, text)
            except (TypeError, ValueError) as e:
                fail(f"{path}: {type(e).__name__}: {e}")
            p.add(ids, mask)
            continue
        if fmt == "json":  # one record, or an array of records (a Hugging Face dataset's to_json)
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except UnicodeDecodeError as e:
                fail(f"{path}: not UTF-8 ({e})")
            except json.JSONDecodeError as e:
                if e.msg != "Extra data":
                    fail(f"{path}: not JSON: {type(e).__name__}: {e}")
                data = None  # JSON lines (datasets' to_json writes them by default): read below
            except RecursionError as e:
                fail(f"{path}: not JSON: {type(e).__name__}: {e}")
            if data is not None:
                for i, obj in enumerate(data if isinstance(data, list) else [data]):
                    add_record(tok, p, obj, f"{path}[{i}]" if isinstance(data, list) else path)
                continue
        with open(path, "rb") as f:
            for n, line in enumerate(_lines(f, path), 1):
                where = f"{path}:{n}"
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except (json.JSONDecodeError, RecursionError) as e:
                    fail(f"{where}: not JSON: {type(e).__name__}: {e}")
                add_record(tok, p, obj, where)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="model directory with the tokenizer files")
    ap.add_argument("--out", required=True, help="output prefix: PREFIX.u32, PREFIX.mask, PREFIX.docs, PREFIX.json")
    ap.add_argument("--format", choices=["auto", "text", "jsonl", "json"], default="auto",
                    help="auto: *.jsonl is JSON lines, *.json one JSON record or an array of them (any case), "
                         "anything else text")
    ap.add_argument("--no-eos", action="store_true", help="no EOS after text documents")
    ap.add_argument("inputs", nargs="+")
    a = ap.parse_args()

    tok, tf_version = load_tokenizer(a.tokenizer)
    eos = None
    if not a.no_eos:
        eos = tok.eos_token_id
        if eos is None:
            fail(f"{a.tokenizer}: the tokenizer has no EOS token to put between documents (pass --no-eos to "
                 f"pack without one)")
    out_dir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(out_dir, exist_ok=True)
    tmp = f".tmp.{os.getpid()}"
    exts = (".u32", ".mask", ".docs", ".json")
    temps = [a.out + ext + tmp for ext in exts]

    def cleanup():
        for t in temps:
            try:
                os.unlink(t)
            except FileNotFoundError:
                pass

    import atexit
    atexit.register(cleanup)  # an error (fail() exits) leaves no partial output
    with open(temps[0], "wb") as ids_file, open(temps[1], "wb") as mask_file, open(temps[2], "wb") as docs_file:
        p = Packer(eos, ids_file, mask_file, docs_file)
        add_inputs(a, tok, p)
        p.flush()
    if p.tokens == 0:
        fail("no tokens: the inputs are empty")
    meta = {
        "tokenizer": os.path.abspath(a.tokenizer),
        "vocab_size": len(tok),
        "eos_token_id": eos,
        "documents": p.docs,
        "tokens": p.tokens,
        "trained_tokens": p.trained,
        "inputs": [os.path.abspath(x) for x in a.inputs],
        "transformers": tf_version,
        "files": {"tokens": os.path.basename(a.out) + ".u32", "mask": os.path.basename(a.out) + ".mask",
                  "documents": os.path.basename(a.out) + ".docs"},
        "finetune": f"--data {a.out}.u32 --data-format u32 --loss-mask {a.out}.mask --documents {a.out}.docs",
    }
    with open(temps[3], "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    for ext, t in zip(exts, temps):
        os.replace(t, a.out + ext)
    skipped = f" ({p.empty} empty documents skipped)" if p.empty else ""
    print(f"prepare_data: {p.docs} documents{skipped}, {p.tokens} tokens ({p.trained} trained on) -> {a.out}.u32, "
          f"{a.out}.mask, {a.out}.docs; then: strata finetune {meta['finetune']} (drop --documents to pack documents "
          f"into full windows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
