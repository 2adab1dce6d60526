"""Needle in a haystack: can the model still find a fact in its context when the cache is compressed?

Grid: context lengths x needle depths x needle kinds, --trials prompts per cell. A prompt is an
instruction, a haystack cut from the eval text (the Wikipedia articles by default) with the
needle sentence inserted at `depth` (snapped forward to the next sentence end), then a question.
  passkey : "The pass key is 48213. Remember it. 48213 is the pass key."  -> correct if the
            5-digit key appears in the answer.
  sentence: a fact sentence ("The secret ingredient of the soup is smoked paprika.") -> correct
            if every key phrase appears in the answer (case-insensitive).
With the cache under test, the context (instruction + haystack + needle) is prefilled as one
forward, then generate() runs greedily from the question. So the question and every answer
token attend over what the cache stored for the context: for TurboQuantCache its compressed pool
(the exact-prefill option only covers the context's own first forward).

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
PASSKEY_INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
SENTENCE_INTRO = "Read the following text carefully. A question about it follows.\n\n"
# (needle sentence, question ending in the answer's start, key phrases the answer must contain)
SENTENCE_NEEDLES = [
    ("The secret ingredient of grandmother's soup is smoked paprika.",
     "What is the secret ingredient of grandmother's soup? The secret ingredient of grandmother's soup is",
     ["paprika"]),
    ("The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
     "What is the best thing to do in San Francisco? The best thing to do in San Francisco is",
     ["sandwich"]),
    ("The name of the lighthouse keeper's cat is Captain Whiskers.",
     "What is the name of the lighthouse keeper's cat? The name of the lighthouse keeper's cat is",
     ["whiskers"]),
]
NEEDLES = ("passkey", "sentence")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.needle", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2 (default), an HF id/path, or random:<shape>")
    p.add_argument("--dataset", default="wiki", choices=["wiki", "wikitext"], help="haystack text source")
    p.add_argument("--text-file", help="haystack from this UTF-8 text file instead")
    p.add_argument("--presets", default=DEFAULT_CACHES,
                   help=f"comma-separated caches (fp16 always runs as the reference); known: "
                        f"{', '.join(common.cache_names())}")
    p.add_argument("--lengths", default="1024,2048,4096",
                   help="comma-separated context lengths in tokens (SmolLM2's context is 8192)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="comma-separated needle depths in [0, 1]")
    p.add_argument("--needles", default="passkey,sentence", help=f"comma-separated needle kinds: {', '.join(NEEDLES)}")
    p.add_argument("--trials", type=int, default=1, help="prompts per cell and needle kind (different needles)")
    p.add_argument("--max-new-tokens", type=int, default=10)
    p.add_argument("--prefill-attention", default="exact", choices=["exact", "compressed"])
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
    return args


class Prompt:
    """One haystack prompt: context ids (prefilled), question ids, and how to judge an answer."""

    def __init__(self, context: list[int], question: list[int], keys: list[str], needle: str):
        self.context, self.question, self.keys, self.needle = context, question, keys, needle

    def judge(self, answer: str) -> bool:
        text = answer.lower()
        return all(k.lower() in text for k in self.keys)


def sentence_end_after(tokenizer, hay: list[int], index: int, search: int = 64) -> int:
    """The first index >= `index` right after a token ending a sentence (else `index`)."""
    for i in range(index, min(index + search, len(hay))):
        if re.search(r"[.!?\n]\s*$", tokenizer.decode(hay[i : i + 1])):
            return i + 1
    return index


def build_prompt(tokenizer, hay_ids: list[int], length: int, depth: float, kind: str, trial: int,
                 rng: random.Random) -> Prompt:
    """A prompt of about `length` tokens with the needle at `depth` of the haystack."""
    enc = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    if kind == "passkey":
        key = str(rng.randint(10000, 99999))
        intro, needle = PASSKEY_INTRO, f" The pass key is {key}. Remember it. {key} is the pass key. "
        question, keys = PASSKEY_QUESTION, [key]
    else:
        sentence, q, keys = SENTENCE_NEEDLES[trial % len(SENTENCE_NEEDLES)]
        intro, needle, question = SENTENCE_INTRO, f" {sentence} ", f"\n\n{q}"
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
def answer(model, tokenizer, prompt: Prompt, spec: common.CacheSpec, max_new_tokens: int, device: str) -> str:
    """Prefill the context into a fresh cache, then greedy generate() from the question."""
    common.set_attention(model, spec.attn_implementation)
    cache = spec.build(model.config)
    context = torch.tensor([prompt.context], device=device)
    model(input_ids=context, use_cache=True, **common.with_cache(model, cache))
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
        for spec in specs:
            bar.set_postfix_str(f"{length} tok, depth {depth}, {spec.name}")
            text = answer(model, tokenizer, prompt, spec, args.max_new_tokens, args.device)
            record["answers"][spec.name], record["correct"][spec.name] = text, prompt.judge(text)
            bar.update()
        records.append(record)
    bar.close()
    return records


def summarize(records: list[dict], specs, lengths: list[int], depths: list[float]) -> list[dict]:
    ref = specs[0].name
    rows = []
    for spec in specs:
        name = spec.name
        grid = [[_mean([r["correct"][name] for r in records if r["length"] == n and r["depth"] == d])
                 for n in lengths] for d in depths]
        ref_ok = [r for r in records if r["correct"][ref]]
        by_needle = {k: _mean([r["correct"][name] for r in records if r["needle"] == k])
                     for k in dict.fromkeys(r["needle"] for r in records)}
        rows.append({
            "preset": name, "family": spec.family, "description": spec.description,
            "accuracy": _mean([r["correct"][name] for r in records]), "accuracy_by_needle": by_needle,
            "parity_vs_fp16": _mean([r["correct"][name] for r in ref_ok]) if ref_ok else None,
            "same_outcome_as_fp16": _mean([r["correct"][name] == r["correct"][ref] for r in records]),
            "grid": grid,
        })
    return rows


def _mean(values: list) -> float:
    return sum(map(float, values)) / len(values) if values else float("nan")


def write_outputs(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "results.json", report)
    rows, needles = report["results"], report["grid"]["needles"]
    table = common.markdown_table(
        ["cache", "accuracy", *[f"{k} acc." for k in needles], "parity vs fp16", "same outcome as fp16"],
        [[r["preset"], f"{r['accuracy']:.2f}", *[f"{r['accuracy_by_needle'][k]:.2f}" for k in needles],
          "n/a (fp16 found none)" if r["parity_vs_fp16"] is None else f"{r['parity_vs_fp16']:.2f}",
          f"{r['same_outcome_as_fp16']:.2f}"] for r in rows],
    )
    g = report["grid"]
    head = (f"# Needle in a haystack\n\n- model: {report['model']}\n- text: {report['text']}\n"
            f"- grid: lengths {g['lengths']} x depths {g['depths']} x needles {needles}, {g['trials']} trial(s) "
            f"each; {len(report['records'])} prompts per cache\n- method: {report['method']}\n"
            f"- command: `{report['meta']['command']}`\n")
    common.write_table_md(out / "table.md", head, table, report["skipped"])
    for r in rows:
        accuracy_heatmap(out / f"needle_{r['preset']}.png", r["grid"], g["lengths"], g["depths"],
                         f"{r['preset']}: needle accuracy ({', '.join(needles)})\n{report['model']}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    meta = common.start_run("eval.needle", argv, args.threads)
    specs, skipped = common.resolve_caches(args.presets, args.prefill_attention)
    model, tokenizer, model_desc = common.load_model(args.model, device=args.device)
    text, text_desc = common.load_text(args.dataset, args.text_file)
    hay_ids = tokenizer(text[: 8 * max(args.lengths) * 4 + 1000], add_special_tokens=False).input_ids
    records = run_grid(model, tokenizer, hay_ids, specs, args)
    report = {
        "meta": meta, "model": model_desc, "text": text_desc,
        "grid": {"lengths": args.lengths, "depths": args.depths, "needles": args.needles, "trials": args.trials},
        "method": ("context (instruction + haystack + needle) prefilled into a fresh cache in one forward, then "
                   f"greedy generate() of {args.max_new_tokens} tokens from the question; the question and answer "
                   "read the cache's stored K/V; parity = share of fp16-correct prompts the cache also gets right"),
        "skipped": skipped,
        "results": summarize(records, specs, args.lengths, args.depths),
        "records": records,
    }
    write_outputs(Path(args.out), report)
    print((Path(args.out) / "table.md").read_text())
    return report


if __name__ == "__main__":
    main()
