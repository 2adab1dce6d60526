"""Needle in a haystack: can the model still find a fact in its context when the cache is compressed?

Grid: context lengths x needle depths x needle kinds, --trials prompts per cell. A prompt is a
chat (the tokenizer's chat template, when it has one: SmolLM2-135M-Instruct is an instruct model):
  system   : what to look for and how to answer ("...a pass key hidden in it. Answer with the pass
             key only.")
  user     : a haystack cut from the eval text (Wikipedia articles by default) with the needle
             inserted at `depth` (snapped forward to the next sentence end), then the question
  assistant: the answer's start ("The pass key is"), which the model completes.
Needle kinds:
  passkey : a paragraph of its own, "The pass key is 48213. The pass key is 48213. The pass key is
            48213. Remember it. 48213 is the pass key." (a random 5-digit key per prompt)
            -> correct if the key appears in the answer.
  sentence: a fact sentence ("The secret ingredient of grandmother's soup is smoked paprika.")
            -> correct if every key phrase appears in the answer (case-insensitive).
Why this framing (fp16 SmolLM2-135M-Instruct, Wikipedia haystack, depths 0.1/0.5/0.9): as plain
text (instruction, haystack, "What is the pass key? The pass key is") fp16 found the key in 1 of 9
prompts at 1k-4k tokens and mostly went on about music; the chat template with the default
system turn and the task in the user turn found 0 of 8 at 1k-2k. Stating the task in the system
turn, giving the needle its own paragraph and asking about "the text above" found 6/6 at 1k and
6/6 at 2k but 1/3 at 4k; saying the key three times found 3/3 at 4k and 1/3 at 8184 tokens
(only depth 0.9: the needle ~800 tokens back). Beyond ~4k tokens of distance this model does
not retrieve (a banner line, the task stated before the haystack too, or an answer start that
repeats the banner did not help at 8k either); eval/results/needle_k8v4 has fp16 at 12/12 for
1k, 2k and 4k tokens and 2/12 at 8184.

What reads the cache: the context (system turn + user turn up to the end of the haystack) is
prefilled into a fresh cache of the kind under test, then generate() runs greedily from the
question ("What is ...?", the end of the user turn, the assistant turn and the answer's start).
So the question and every answer token attend over what the cache stored for the context: for
TurboQuantCache its compressed pool (exact prefill only covers the context's own first forward).
Shared prefill (the default with --prefill-attention exact): with exact prefill attention every
cache's first forward attends its own exact K/V, so every layer sees the fp16 model's inputs and
writes the fp16 model's K/V into its cache. The context is therefore run through the model once
per prompt, and its per-layer K/V are written into each fresh cache under test through that
cache's own update() -- the call the model's prefill makes (tests/eval/test_needle.py checks the
two paths agree). --prefill-per-cache runs the model's prefill forward for every cache instead
(forced with --prefill-attention compressed, where the prefill itself reads the compressed K/V).

Per cache: accuracy per cell, overall accuracy, and parity vs fp16 = the fraction of prompts
fp16 answers correctly that this cache also answers correctly (1.0 = identical retrieval).
Writes OUT/results.json, OUT/table.md and OUT/needle_<cache>.png (accuracy heatmap).
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import common
from .plots import accuracy_heatmap

DEFAULT_CACHES = "fp16,4bit,k8v4,k3v4,3bit,quanto-int4,hqq-int4,naive-int4,hadamard-int4"
PASSKEY_SYSTEM = "The user gives you a long text with a pass key hidden in it. Answer with the pass key only."
PASSKEY_NEEDLE = ("\n\nThe pass key is {key}. The pass key is {key}. The pass key is {key}. Remember it. "
                  "{key} is the pass key.\n\n")
PASSKEY_QUESTION = ("What is the pass key in the text above?", "The pass key is")
SENTENCE_SYSTEM = ("The user gives you a long text with one out-of-place fact hidden in it. "
                   "Answer the question about that fact in a few words.")
# (needle sentence, question, the answer's start, key phrases the answer must contain)
SENTENCE_NEEDLES = [
    ("The secret ingredient of grandmother's soup is smoked paprika.",
     "What is the secret ingredient of grandmother's soup?", "The secret ingredient of grandmother's soup is",
     ["paprika"]),
    ("The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
     "What is the best thing to do in San Francisco?", "The best thing to do in San Francisco is",
     ["sandwich"]),
    ("The name of the lighthouse keeper's cat is Captain Whiskers.",
     "What is the name of the lighthouse keeper's cat?", "The name of the lighthouse keeper's cat is",
     ["whiskers"]),
]
NEEDLES = ("passkey", "sentence")
HAYSTACK_MARK = "\x00HAYSTACK\x00"  # where the user turn's text goes in the rendered chat template


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.needle", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_and_text_args(p, "the haystack")
    p.add_argument("--presets", default=DEFAULT_CACHES,
                   help=f"comma-separated caches (fp16 always runs as the reference); known: "
                        f"{', '.join(common.cache_names())}")
    p.add_argument("--lengths", default="1024,2048,4096",
                   help="comma-separated prompt lengths in tokens, question included (SmolLM2's context is "
                        "8192: leave room for --max-new-tokens)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="comma-separated needle depths in [0, 1]")
    p.add_argument("--needles", default="passkey,sentence", help=f"comma-separated needle kinds: {', '.join(NEEDLES)}")
    p.add_argument("--trials", type=int, default=1, help="prompts per cell and needle kind (different needles)")
    p.add_argument("--max-new-tokens", type=int, default=10)
    p.add_argument("--prefill-attention", default="exact", choices=["exact", "compressed"])
    p.add_argument("--prefill-per-cache", action="store_true",
                   help="run the model's prefill forward for every cache (default: once per prompt, its K/V "
                        "written into each cache; see the module docstring)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads (1 is much faster on a busy machine)")
    p.add_argument("--out", default="eval/results/needle", help="output folder")
    args = p.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
        args.depths = [float(x) for x in args.depths.split(",")]
    except ValueError:
        p.error("--lengths takes integers and --depths numbers, comma-separated")
    args.needles = [n.strip() for n in args.needles.split(",") if n.strip()]
    if bad := [n for n in args.needles if n not in NEEDLES]:
        p.error(f"unknown needle kinds {bad}; supported: {', '.join(NEEDLES)}")
    if any(not 0 <= d <= 1 for d in args.depths) or min(args.lengths) < 64 or args.trials < 1:
        p.error("depths must lie in [0, 1], lengths be >= 64 tokens, trials >= 1")
    args.shared_prefill = not args.prefill_per_cache and args.prefill_attention == "exact"
    return args


class Prompt:
    """One haystack prompt: context ids (prefilled), question ids, and how to judge an answer."""

    def __init__(self, context: list[int], question: list[int], keys: list[str], needle: str):
        self.context, self.question, self.keys, self.needle = context, question, keys, needle

    def judge(self, answer: str) -> bool:
        text = answer.lower()
        return all(k.lower() in text for k in self.keys)


def chat_frame(tokenizer, system: str, question: str, answer_start: str) -> tuple[str, str]:
    """(text before the haystack, text after it): the chat template's system turn and the user
    turn's start, then the question, the turn's end, the assistant turn and the answer's start.
    A tokenizer without a chat template gets plain text: system line, haystack, question."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": HAYSTACK_MARK}],
            tokenize=False, add_generation_prompt=True)
        before, after = rendered.split(HAYSTACK_MARK)
        return before, f"\n\n{question}{after}{answer_start}"
    return f"{system}\n\n", f"\n\n{question} {answer_start}"


def sentence_end_after(tokenizer, hay: list[int], index: int, search: int = 64) -> int:
    """The first index >= `index` right after a token ending a sentence (else `index`)."""
    for i in range(index, min(index + search, len(hay))):
        if re.search(r"[.!?\n]\s*$", tokenizer.decode(hay[i : i + 1])):
            return i + 1
    return index


def build_prompt(tokenizer, hay_ids: list[int], length: int, depth: float, kind: str, trial: int,
                 rng: random.Random) -> Prompt:
    """A prompt of `length` tokens (context + question) with the needle at `depth` of the haystack."""
    enc = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    if kind == "passkey":
        key = str(rng.randint(10000, 99999))
        needle, keys = PASSKEY_NEEDLE.format(key=key), [key]
        intro, question = chat_frame(tokenizer, PASSKEY_SYSTEM, *PASSKEY_QUESTION)
    else:
        sentence, q, start, keys = SENTENCE_NEEDLES[trial % len(SENTENCE_NEEDLES)]
        needle = f" {sentence} "
        intro, question = chat_frame(tokenizer, SENTENCE_SYSTEM, q, start)
    head, mid, tail = enc(intro), enc(needle), enc(question)
    budget = length - len(head) - len(mid) - len(tail)
    if budget < 16:
        raise ValueError(f"context length {length} is too short for the {kind} needle")
    start = rng.randrange(0, max(1, len(hay_ids) - budget))
    hay = hay_ids[start : start + budget]
    if len(hay) < budget:
        raise ValueError(f"the text has {len(hay_ids)} tokens: too few for a {length}-token haystack")
    cut = {0.0: 0, 1.0: budget}.get(depth) if depth in (0.0, 1.0) else sentence_end_after(tokenizer, hay, round(depth * budget))
    return Prompt(head + hay[:cut] + mid + hay[cut:], tail, keys, needle.strip())


@torch.inference_mode()
def context_kv(model, prompt: Prompt, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) of the context, from one forward of the model with an fp16 cache."""
    from transformers import DynamicCache

    common.set_attention(model, "sdpa")
    cache = DynamicCache()
    model(input_ids=torch.tensor([prompt.context], device=device), use_cache=True, **common.with_cache(model, cache))
    return [(layer.keys, layer.values) for layer in cache.layers]


@torch.inference_mode()
def prefilled_cache(model, prompt: Prompt, spec: common.CacheSpec, device: str,
                    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
    """A fresh cache of `spec` holding the context: written from `kv` through the cache's update()
    when given (the exact-prefill shortcut), else by the model's prefill forward."""
    common.set_attention(model, spec.attn_implementation)
    cache = spec.build(model.config)
    if kv is None:
        model(input_ids=torch.tensor([prompt.context], device=device), use_cache=True,
              **common.with_cache(model, cache))
    else:
        for layer_idx, (keys, values) in enumerate(kv):  # clones: a cache may keep or tag what it is given
            cache.update(keys.clone(), values.clone(), layer_idx)
    return cache


@torch.inference_mode()
def answer(model, tokenizer, prompt: Prompt, spec: common.CacheSpec, max_new_tokens: int, device: str,
           kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> str:
    """Prefill the context into a fresh cache, then greedy generate() from the question."""
    cache = prefilled_cache(model, prompt, spec, device, kv)
    full = torch.tensor([prompt.context + prompt.question], device=device)
    out = model.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=tokenizer.eos_token_id, **common.with_cache(model, cache))
    return tokenizer.decode(out[0, full.shape[1] :], skip_special_tokens=True)


def run_grid(model, tokenizer, hay_ids: list[int], specs, args) -> list[dict]:
    """Every (length, depth, needle, trial) prompt through every cache; one record per prompt."""
    rng = random.Random(args.seed)
    jobs = [(n, d, k, t) for n in args.lengths for d in args.depths for k in args.needles for t in range(args.trials)]
    records = []
    bar = tqdm(total=len(jobs) * len(specs), desc="needle", unit="query")
    for length, depth, kind, trial in jobs:
        prompt = build_prompt(tokenizer, hay_ids, length, depth, kind, trial, rng)
        record = {"length": length, "depth": depth, "needle": kind, "trial": trial, "needle_text": prompt.needle,
                  "tokens": len(prompt.context) + len(prompt.question), "answers": {}, "correct": {}}
        kv = context_kv(model, prompt, args.device) if args.shared_prefill else None
        for spec in specs:
            bar.set_postfix_str(f"{length} tok, depth {depth}, {spec.name}")
            text = answer(model, tokenizer, prompt, spec, args.max_new_tokens, args.device, kv)
            record["answers"][spec.name], record["correct"][spec.name] = text, prompt.judge(text)
            bar.update()
        del kv
        records.append(record)
    bar.close()
    return records


def summarize(records: list[dict], specs, lengths: list[int], depths: list[float]) -> list[dict]:
    """Per cache: accuracy overall, per needle kind, per length and per (depth, length) cell; parity vs fp16."""
    ref = specs[0].name
    rows = []
    for spec in specs:
        name = spec.name
        grid = [[_mean([r["correct"][name] for r in records if r["length"] == n and r["depth"] == d])
                 for n in lengths] for d in depths]
        by_needle = {k: _mean([r["correct"][name] for r in records if r["needle"] == k])
                     for k in dict.fromkeys(r["needle"] for r in records)}
        by_length = {str(n): _mean([r["correct"][name] for r in records if r["length"] == n]) for n in lengths}
        parity_by_length = {str(n): _parity([r for r in records if r["length"] == n], name, ref) for n in lengths}
        rows.append({
            "preset": name, "family": spec.family, "description": spec.description,
            "accuracy": _mean([r["correct"][name] for r in records]), "accuracy_by_needle": by_needle,
            "accuracy_by_length": by_length, "parity_vs_fp16": _parity(records, name, ref),
            "parity_vs_fp16_by_length": parity_by_length,
            "same_outcome_as_fp16": _mean([r["correct"][name] == r["correct"][ref] for r in records]),
            "grid": grid,
        })
    return rows


def _parity(records: list[dict], name: str, ref: str) -> float | None:
    """Share of the prompts `ref` got right that `name` also got right (None if `ref` got none)."""
    ref_ok = [r for r in records if r["correct"][ref]]
    return _mean([r["correct"][name] for r in ref_ok]) if ref_ok else None


def _mean(values: list) -> float:
    return sum(map(float, values)) / len(values) if values else float("nan")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def write_outputs(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "results.json", report)
    rows, g = report["results"], report["grid"]
    needles, lengths = g["needles"], [str(n) for n in g["lengths"]]
    table = common.markdown_table(
        ["cache", "accuracy", *[f"{k} acc." for k in needles], "parity vs fp16", "same outcome as fp16"],
        [[r["preset"], f"{r['accuracy']:.2f}", *[f"{r['accuracy_by_needle'][k]:.2f}" for k in needles],
          "n/a (fp16 found none)" if r["parity_vs_fp16"] is None else f"{r['parity_vs_fp16']:.2f}",
          f"{r['same_outcome_as_fp16']:.2f}"] for r in rows],
    )
    per_length = len(report["records"]) // len(lengths)
    table += (f"\nPer length ({per_length} prompts each): accuracy / parity vs fp16 (n/a: fp16 found none)\n\n"
              + common.markdown_table(
                  ["cache", *[f"{n} tok" for n in lengths]],
                  [[r["preset"], *[f"{r['accuracy_by_length'][n]:.2f} / {_fmt(r['parity_vs_fp16_by_length'][n])}"
                                   for n in lengths]] for r in rows]))
    head = common.md_header(
        "Needle in a haystack", report["meta"]["command"], f"model: {report['model']}", f"text: {report['text']}",
        f"grid: lengths {g['lengths']} x depths {g['depths']} x needles {needles}, {g['trials']} trial(s) each; "
        f"{len(report['records'])} prompts per cache", f"method: {report['method']}")
    common.write_table_md(out / "table.md", head, table, report["skipped"])
    for r in rows:
        accuracy_heatmap(out / f"needle_{r['preset']}.png", r["grid"], g["lengths"], g["depths"],
                         f"{r['preset']}: needle accuracy ({', '.join(needles)})\n{report['model']}")


def method(args) -> str:
    """One paragraph for table.md: how prompts are built and what reads the cache."""
    prefill = ("the context run through the model once per prompt (fp16 cache) and its per-layer K/V written "
               "into each fresh cache under test through the cache's update() (exact prefill: what the model's "
               "own prefill would write)" if args.shared_prefill else
               f"the context prefilled into each fresh cache under test by the model's forward "
               f"({args.prefill_attention} prefill attention)")
    return ("chat-template prompt: system turn states the task, user turn = haystack with the needle + question, "
            f"assistant turn = the answer's start; {prefill}; then greedy generate() of {args.max_new_tokens} tokens "
            "from the question, so the question and answer read the cache's stored K/V; parity = share of "
            "fp16-correct prompts the cache also gets right")


def check_fits(config, lengths: list[int], max_new_tokens: int) -> None:
    """Refuse prompts the model's context cannot hold with their answer (positions past it are untrained)."""
    limit = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit is not None and max(lengths) + max_new_tokens > limit:
        raise ValueError(f"length {max(lengths)} + --max-new-tokens {max_new_tokens} exceeds the model's context of "
                         f"{limit} tokens; use lengths up to {limit - max_new_tokens}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    meta = common.start_run("eval.needle", argv, args.threads)
    specs, skipped = common.resolve_caches(args.presets, args.prefill_attention)
    model, tokenizer, model_desc = common.load_model(args.model, device=args.device)
    check_fits(model.config, args.lengths, args.max_new_tokens)
    text, text_desc = common.load_text(args.dataset, args.text_file)
    hay_ids = tokenizer(text[: 8 * max(args.lengths) * 4 + 1000], add_special_tokens=False).input_ids
    records = run_grid(model, tokenizer, hay_ids, specs, args)
    report = {
        "meta": meta, "model": model_desc, "text": text_desc,
        "grid": {"lengths": args.lengths, "depths": args.depths, "needles": args.needles, "trials": args.trials},
        "method": method(args), "skipped": skipped,
        "results": summarize(records, specs, args.lengths, args.depths),
        "records": records,
    }
    write_outputs(Path(args.out), report)
    print((Path(args.out) / "table.md").read_text())
    return report


if __name__ == "__main__":
    main()
