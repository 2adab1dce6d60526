"""Chunked prefill and multi-turn cache reuse: does feeding a prompt in pieces cost quality?

An uncompressed DynamicCache gives the same logits however a prompt is fed (one forward, or
chunks through the cache). A compressed cache need not: a forward after the first may attend over
what the cache stored for the earlier tokens. This eval measures that, against the fp16 reference
fed the same way, through the public API only (model forwards and generate() with a cache).

Chunked prompt (the main table): the first --prompt-tokens tokens of the text are fed to a fresh
cache in one of several ways (--feeds), then --decode-steps one-token forwards follow, teacher-
forced on the text's next tokens. Per (cache, feed): the mean KL(fp16 || cache) of the decode
steps' next-token distributions and top-1 agreement with fp16's argmax; also the same over the
prompt positions predicted by forwards after the first one (they read the cache too). The fp16
row compares each feed with fp16's own one-prefill run: ~0, the reference is exact under chunking.
--prompts P repeats this on P consecutive slices of the text and pools the scores: one prompt's
decode steps are few, and at small KLs their spread can hide or fake a ratio of 1.2x.
Feeds: "one" (the whole prompt in one forward), "C" (chunks of C tokens; "1" is token by token,
about 1000 decode-sized forwards per cache: only with --all or when named), "A+rest" (a first
forward of A tokens, then the rest in one forward).

generate() check: greedy generate() of --generate-tokens tokens from the same prompt, once with
one prefill and once with generate(prefill_chunk_size=C) for each C in --generate-chunks. Each run
follows its own greedy tokens, so it is scored against one fp16 forward over exactly the tokens it
generated: KL(fp16 || cache) of the generated steps' logits, and top-1 agreement.

Multi-turn check (cache reuse the way transformers' docs show it: the same cache object given the
longer conversation): turn 1 = a chat prompt around --turn1-tokens tokens of text, answered by
fp16's greedy --answer-tokens tokens; turn 2 = the conversation extended by a user turn around
--turn2-tokens more tokens of text. "reused": turn 1's prompt in one forward, the answer fed one
token at a time (as generate() does), then turn 2's new tokens in one forward through the same
cache. "fresh": a fresh cache given the whole conversation in one forward. Both then take
--decode-steps one-token forwards teacher-forced on fp16's greedy turn-2 answer; KL(fp16 || cache)
and top-1 over those steps.

The target: a chunked feed's decode KL at most 1.2x the one-prefill KL for every preset.
Writes OUT/results.json and OUT/table.md.
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import common

DEFAULT_PRESETS = "4bit,k8v4,k3v4,3bit"
DEFAULT_FEEDS = "one,32,256,32+rest,1+rest"
TOKEN_BY_TOKEN = "1"  # added by --all: one forward per prompt token
RATIO_TARGET = 1.2
FEED_PATTERN = re.compile(r"^(one|\d+|\d+\+rest)$")


# ---- how a prompt is fed ---------------------------------------------------------------------
def check_feed(feed: str) -> str:
    """`feed` if it names a way to feed a prompt, else a ValueError naming the supported forms."""
    if not FEED_PATTERN.match(feed) or feed.split("+")[0] == "0":
        raise ValueError(f"unknown feed {feed!r}; supported: 'one', 'C' (chunks of C >= 1 tokens) or "
                         "'A+rest' (A >= 1 tokens, then the rest)")
    return feed


def feed_bounds(length: int, feed: str) -> list[tuple[int, int]]:
    """[(start, end)] of the forwards that feed a `length`-token prompt the way `feed` says."""
    check_feed(feed)
    if feed == "one":
        return [(0, length)]
    if feed.endswith("+rest"):
        first = min(int(feed.split("+")[0]), length)
        return [(0, first)] + ([(first, length)] if first < length else [])
    chunk = int(feed)
    return [(s, min(s + chunk, length)) for s in range(0, length, chunk)]


def feed_label(feed: str) -> str:
    return {"one": "one prefill"}.get(feed, feed if "+" in feed else f"chunks of {feed}")


# ---- logits and their comparison -------------------------------------------------------------
@dataclass
class FedLogits:
    """Next-token log-probabilities [*, V] (float32) of one run through a cache."""

    prompt: torch.Tensor  # every prompt position
    decode: torch.Tensor  # the teacher-forced one-token forwards after the prompt
    first_forward: int  # prompt positions computed by the first forward (no cache to read)
    dense_by_check: list[int] = field(default_factory=list)
    seconds: float = 0.0


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[0].float(), -1)


@torch.inference_mode()
def forward(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Log-probabilities [L, V] of the [1, L] ids fed through `cache` in one forward."""
    return _logprobs(model(input_ids=ids, use_cache=True, **common.with_cache(model, cache)).logits)


@torch.inference_mode()
def decode_steps(model, tokens: torch.Tensor, cache) -> torch.Tensor:
    """Log-probabilities [K, V] of one-token forwards feeding tokens [1, K] one at a time."""
    return torch.cat([forward(model, tokens[:, i : i + 1], cache) for i in range(tokens.shape[1])])


def fed_logits(model, spec: common.CacheSpec, ids: torch.Tensor, bounds: list[tuple[int, int]]) -> FedLogits:
    """A fresh cache of `spec` fed ids[:, :bounds[-1][1]] in the forwards `bounds` lists, then the rest of
    `ids` as teacher-forced one-token decode steps."""
    common.set_attention(model, spec.attn_implementation)
    cache = spec.build(model.config)
    t0 = time.perf_counter()
    prompt = torch.cat([forward(model, ids[:, s:e], cache) for s, e in bounds])
    decode = decode_steps(model, ids[:, bounds[-1][1] :], cache)
    return FedLogits(prompt, decode, bounds[0][1], sorted(getattr(cache, "dense_by_check", ()) or ()),
                     time.perf_counter() - t0)


def compare(ref: torch.Tensor, other: torch.Tensor) -> dict:
    """Mean KL(ref || other) over rows of log-probabilities [n, V], and top-1 agreement; n = 0 gives Nones."""
    if ref.shape != other.shape:
        raise ValueError(f"log-probabilities to compare differ in shape: {list(ref.shape)} vs {list(other.shape)}")
    if ref.shape[0] == 0:
        return {"kl": None, "top1": None, "count": 0}
    kl = (ref.exp() * (ref - other)).sum(-1)
    return {"kl": kl.mean().item(), "top1": (ref.argmax(-1) == other.argmax(-1)).float().mean().item(),
            "count": ref.shape[0]}


def score(ref: FedLogits, run: FedLogits) -> dict:
    """What a row of the chunked table records: decode-step scores, and those of the prompt positions
    after the first forward (the ones whose forwards could read the cache)."""
    start = run.first_forward
    return {"decode": compare(ref.decode, run.decode), "prompt": compare(ref.prompt[start:], run.prompt[start:]),
            "dense_by_check": run.dense_by_check, "seconds": round(run.seconds, 2)}


def evaluate_feeds(model, ids: torch.Tensor, prompt_tokens: int, specs: list[common.CacheSpec],
                   feeds: list[str], on_row=None) -> list[dict]:
    """One row per (cache, feed). ids [1, prompt_tokens + K]: the prompt, then the K decode tokens.
    specs[0] is the reference: fed each way, compared with its own one-forward run; every other cache is
    compared with the reference fed the same way. on_row(rows), if given, runs after each row."""
    ref_spec, others = specs[0], specs[1:]
    rows = []
    bar = tqdm(total=len(feeds) * len(specs), desc="chunked", unit="run")
    one = None
    for feed in feeds:
        bounds = feed_bounds(prompt_tokens, feed)
        bar.set_postfix_str(f"{ref_spec.name} {feed}")
        ref = fed_logits(model, ref_spec, ids, bounds)
        if one is None:
            one = ref if feed == "one" else fed_logits(model, ref_spec, ids, feed_bounds(prompt_tokens, "one"))
        rows.append({"preset": ref_spec.name, "feed": feed, "forwards": len(bounds),
                     **score(one, ref)})
        bar.update()
        for spec in others:
            bar.set_postfix_str(f"{spec.name} {feed}")
            rows.append({"preset": spec.name, "feed": feed, "forwards": len(bounds),
                         **score(ref, fed_logits(model, spec, ids, bounds))})
            bar.update()
            if on_row is not None:
                on_row(rows)
        del ref
    bar.close()
    return rows


def merge_rows(per_prompt: list[list[dict]]) -> list[dict]:
    """evaluate_feeds' rows of several prompts as one set: scores weighted by their counts, seconds summed."""
    merged = []
    for rows in zip(*per_prompt):
        row = dict(rows[0], seconds=round(sum(r["seconds"] for r in rows), 2),
                   dense_by_check=sorted(set().union(*(r["dense_by_check"] for r in rows))))
        for part in ("decode", "prompt"):
            count = sum(r[part]["count"] for r in rows)
            if rows[0][part]["kl"] is None:
                continue
            row[part] = {key: sum(r[part][key] * r[part]["count"] for r in rows) / count for key in ("kl", "top1")}
            row[part]["count"] = count
        merged.append(row)
    return merged


# ---- generate(prefill_chunk_size=...) ----------------------------------------------------------
def generate_supports_chunked_prefill() -> str | None:
    """None when generate() takes prefill_chunk_size, else why not."""
    from transformers import GenerationConfig

    if hasattr(GenerationConfig(), "prefill_chunk_size"):
        return None
    import transformers

    return f"transformers {transformers.__version__} has no generate(prefill_chunk_size=...)"


@torch.inference_mode()
def generated_logits(model, spec: common.CacheSpec, prompt: torch.Tensor, new_tokens: int,
                     chunk: int | None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(sequence [1, N + T], log-probabilities [T, V] of the generated steps, seconds) of a greedy
    generate() through a fresh cache of `spec`, with prefill_chunk_size=chunk (None: one prefill)."""
    common.set_attention(model, spec.attn_implementation)
    cache = spec.build(model.config)
    t0 = time.perf_counter()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, prefill_chunk_size=chunk, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=model.config.eos_token_id,
                         **common.with_cache(model, cache))
    seconds = time.perf_counter() - t0
    return out.sequences, torch.cat([_logprobs(step[None]) for step in out.logits]), seconds


@torch.inference_mode()
def reference_logits(model, spec: common.CacheSpec, sequence: torch.Tensor, prompt_tokens: int) -> torch.Tensor:
    """The reference's log-probabilities of the steps that generated sequence[:, prompt_tokens:],
    from one forward over the whole sequence."""
    common.set_attention(model, spec.attn_implementation)
    return forward(model, sequence[:, :-1], spec.build(model.config))[prompt_tokens - 1 :]


def evaluate_generate(model, prompt: torch.Tensor, specs: list[common.CacheSpec], new_tokens: int,
                      chunks: list[int]) -> list[dict]:
    """One row per (cache, prefill_chunk_size or None): each run scored on its own greedy tokens."""
    rows = []
    modes = [None, *chunks]
    bar = tqdm(total=len(modes) * len(specs), desc="generate", unit="run")
    for spec in specs:
        for chunk in modes:
            bar.set_postfix_str(f"{spec.name} chunk {chunk}")
            sequence, logp, seconds = generated_logits(model, spec, prompt, new_tokens, chunk)
            ref = reference_logits(model, specs[0], sequence, prompt.shape[1])
            rows.append({"preset": spec.name, "prefill_chunk_size": chunk, **compare(ref, logp),
                         "generated": sequence[0, prompt.shape[1] :].tolist(), "seconds": round(seconds, 2)})
            bar.update()
    bar.close()
    return rows


# ---- multi-turn cache reuse ------------------------------------------------------------------
@dataclass
class Conversation:
    """Token ids of a two-turn chat: turn 1's prompt, its answer, turn 2's prompt (the whole conversation),
    and turn 2's answer (the decode steps' teacher-forced tokens)."""

    turn1: list[int]
    answer1: list[int]
    turn2: list[int]
    answer2: list[int]


def chat_prefix(tokenizer, messages: list[dict]) -> str:
    """The conversation rendered up to the assistant's next answer (plain text without a chat template)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(m["content"] + "\n\n" for m in messages)


def answer_tokens(model, tokenizer, ids: list[int], new_tokens: int) -> list[int]:
    """fp16's greedy answer to `ids` (the caller set the reference attention), end-of-turn tokens dropped."""
    from transformers import DynamicCache

    prompt = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id,
                             **common.with_cache(model, DynamicCache()))
    answer = out[0, prompt.shape[1] :].tolist()
    while answer and answer[-1] in (tokenizer.eos_token_id, tokenizer.pad_token_id):
        answer.pop()
    if not answer:
        raise ValueError("the reference answered turn 1 with an end-of-turn token only; use other text")
    return answer


def build_conversation(model, tokenizer, ref: common.CacheSpec, text_ids: list[int], turn1_tokens: int,
                       turn2_tokens: int, answer_tokens_: int, decode_steps_: int) -> Conversation:
    """Two user turns around consecutive slices of the text, answered by the reference greedily. Turn 2's
    ids extend turn 1's prompt + answer token for token, as the cache reused across turns holds them."""
    common.set_attention(model, ref.attn_implementation)
    text1 = tokenizer.decode(text_ids[:turn1_tokens])
    text2 = tokenizer.decode(text_ids[turn1_tokens : turn1_tokens + turn2_tokens])
    user1 = {"role": "user", "content": f"{text1}\n\nWhat is the text above about?"}
    rendered1 = chat_prefix(tokenizer, [user1])
    turn1 = tokenizer(rendered1, add_special_tokens=False).input_ids
    answer1 = answer_tokens(model, tokenizer, turn1, answer_tokens_)
    said = tokenizer.decode(answer1)
    user2 = {"role": "user", "content": f"Here is more of it:\n\n{text2}\n\nAnd what is this part about?"}
    rendered2 = chat_prefix(tokenizer, [user1, {"role": "assistant", "content": said}, user2])
    if not rendered2.startswith(rendered1 + said):
        raise ValueError("the chat template does not render turn 1 and its answer as a prefix of turn 2; "
                         "the multi-turn check needs a template that does (ChatML does)")
    turn2 = turn1 + answer1 + tokenizer(rendered2[len(rendered1 + said) :], add_special_tokens=False).input_ids
    answer2 = answer_tokens(model, tokenizer, turn2, decode_steps_)
    if len(answer2) < decode_steps_:
        answer2 += [tokenizer.eos_token_id] * (decode_steps_ - len(answer2))
    return Conversation(turn1, answer1, turn2, answer2)


def conversation_logits(model, spec: common.CacheSpec, conv: Conversation, reuse: bool) -> FedLogits:
    """Turn 2 through a fresh cache of `spec`: reused across turns (turn 1's prompt, then its answer one token
    at a time as generate() feeds it, then turn 2's new tokens) or given the whole conversation at once."""
    common.set_attention(model, spec.attn_implementation)
    cache = spec.build(model.config)
    t0 = time.perf_counter()
    turn2 = torch.tensor([conv.turn2])
    if reuse:
        n1 = len(conv.turn1)
        forward(model, turn2[:, :n1], cache)
        decode_steps(model, turn2[:, n1 : n1 + len(conv.answer1) - 1], cache)
        prompt = forward(model, turn2[:, cache.get_seq_length() :], cache)
    else:
        prompt = forward(model, turn2, cache)
    decode = decode_steps(model, torch.tensor([conv.answer2]), cache)
    return FedLogits(prompt, decode, 0,
                     sorted(getattr(cache, "dense_by_check", ()) or ()), time.perf_counter() - t0)


def evaluate_turns(model, conv: Conversation, specs: list[common.CacheSpec]) -> list[dict]:
    """Per cache: turn 2's decode steps with the cache reused across turns and with a fresh one, against
    the reference given the whole conversation at once (the reference's reused run: ~0)."""
    ref = conversation_logits(model, specs[0], conv, reuse=False)
    rows = []
    for spec in tqdm(specs, desc="multi-turn", unit="cache"):
        row = {"preset": spec.name}
        for mode in ("fresh", "reused"):
            reuse = mode == "reused"
            run = ref if spec is specs[0] and not reuse else conversation_logits(model, spec, conv, reuse)
            new = run.prompt.shape[0]  # turn 2's positions this run's last prompt forward computed
            row[mode] = {"decode": compare(ref.decode, run.decode),
                         "turn2_prompt": compare(ref.prompt[-new:], run.prompt),
                         "dense_by_check": run.dense_by_check, "seconds": round(run.seconds, 2)}
        rows.append(row)
    return rows


# ---- tables ----------------------------------------------------------------------------------
def cell(scores: dict) -> str:
    """'KL (top-1 %)' of a compare() result."""
    if scores["kl"] is None:
        return "-"
    return f"{scores['kl']:.4g} ({100 * scores['top1']:.1f}%)"


def ratio(chunked: float | None, single: float | None) -> float | None:
    if chunked is None or single is None:
        return None
    return chunked / single if single > 0 else float("inf") if chunked > 0 else 1.0


def chunked_tables(rows: list[dict], feeds: list[str]) -> str:
    """Decode KL (top-1) per preset and feed; the ratio to one prefill; the prompt positions' KL."""
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    at = {(r["preset"], r["feed"]): r for r in rows}
    chunked = [f for f in feeds if f != "one"]
    decode = common.markdown_table(
        ["preset", *[feed_label(f) for f in feeds]],
        [[p, *[cell(at[p, f]["decode"]) for f in feeds]] for p in presets])
    ratios = []
    for p in presets[1:]:
        rs = [ratio(at[p, f]["decode"]["kl"], at[p, "one"]["decode"]["kl"]) if "one" in feeds else None
              for f in chunked]
        worst = max((r for r in rs if r is not None), default=None)
        verdict = "-" if worst is None else "yes" if worst <= RATIO_TARGET else "no"
        ratios.append([p, *[_x(r) for r in rs], _x(worst), verdict])
    ratio_table = common.markdown_table(
        ["preset", *[feed_label(f) for f in chunked], "worst", f"<= {RATIO_TARGET}x"], ratios)
    prompt = common.markdown_table(
        ["preset", *[f"{feed_label(f)} ({at[presets[0], f]['prompt']['count']} pos.)" for f in chunked]],
        [[p, *[cell(at[p, f]["prompt"]) for f in chunked]] for p in presets])
    dense = [f"{p} {feed_label(f)}: {at[p, f]['dense_by_check']}" for p in presets for f in feeds
             if at[p, f]["dense_by_check"]]
    return ("### Decode steps: mean KL(fp16 || cache) (top-1 agreement)\n\n" + decode +
            "\n### Decode KL, chunked / one prefill\n\n" + ratio_table +
            "\n### Prompt positions after the first forward: KL (top-1)\n\n" + prompt +
            ("\nLayers kept dense by the first prefill's check: " + "; ".join(dense) + "\n" if dense else ""))


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def generate_table(rows: list[dict], chunks: list[int]) -> str:
    """KL (top-1) of generate() with one prefill and with each prefill_chunk_size; no ratio for the reference
    (a ratio of rounding noise)."""
    at = {(r["preset"], r["prefill_chunk_size"]): r for r in rows}
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    body = [[p, cell(at[p, None]), *[f"{cell(at[p, c])}, {_x(ratio(at[p, c]['kl'], at[p, None]['kl']) if i else None)}"
                                      for c in chunks]] for i, p in enumerate(presets)]
    return common.markdown_table(["preset", "generate(), one prefill",
                                  *[f"prefill_chunk_size={c} (ratio)" for c in chunks]], body)


def turns_table(rows: list[dict]) -> str:
    """Turn 2's decode KL (top-1) with a fresh and a reused cache, and its prompt positions'; rows[0]: the reference."""
    body = [[r["preset"], cell(r["fresh"]["decode"]), cell(r["reused"]["decode"]),
             _x(ratio(r["reused"]["decode"]["kl"], r["fresh"]["decode"]["kl"]) if i else None),
             cell(r["fresh"]["turn2_prompt"]), cell(r["reused"]["turn2_prompt"])] for i, r in enumerate(rows)]
    return common.markdown_table(["preset", "fresh cache, whole conversation", "cache reused across turns",
                                  "reused / fresh", "turn-2 prompt, fresh", "turn-2 new tokens, reused"], body)


# ---- the command -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.chunked", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_and_text_args(p, "the prompts' text")
    p.add_argument("--presets", default=DEFAULT_PRESETS,
                   help=f"comma-separated caches (fp16 always runs first as the reference); known: "
                        f"{', '.join(common.cache_names())}")
    p.add_argument("--feeds", default=DEFAULT_FEEDS,
                   help="comma-separated ways to feed the prompt: one, C (chunks of C tokens), A+rest")
    p.add_argument("--all", action="store_true", help=f"also feed the prompt token by token (feed '{TOKEN_BY_TOKEN}')")
    p.add_argument("--prompts", type=int, default=1,
                   help="consecutive text slices to pool the chunked-prompt scores over (generate() uses the first)")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--decode-steps", type=int, default=64, help="teacher-forced one-token forwards after a prompt")
    p.add_argument("--generate-tokens", type=int, default=32, help="greedy tokens of the generate() check (0: skip)")
    p.add_argument("--generate-chunks", default="256", help="comma-separated prefill_chunk_size values to check")
    p.add_argument("--turn1-tokens", type=int, default=600, help="text tokens in turn 1 (0: skip the multi-turn check)")
    p.add_argument("--turn2-tokens", type=int, default=300, help="text tokens in turn 2")
    p.add_argument("--answer-tokens", type=int, default=24, help="greedy tokens of turn 1's answer")
    p.add_argument("--prefill-attention", default="exact", choices=["exact", "compressed"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="model dtype (default float32 on CPU, float16 on GPU)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", default="eval/results/chunked_smollm2", help="output folder")
    args = p.parse_args(argv)
    try:
        args.feeds = [check_feed(f.strip()) for f in args.feeds.split(",") if f.strip()]
        args.generate_chunks = [int(c) for c in args.generate_chunks.split(",") if c.strip()]
    except ValueError as exc:
        p.error(f"{exc} (--feeds), or --generate-chunks is not comma-separated integers")
    if args.all and TOKEN_BY_TOKEN not in args.feeds:
        args.feeds.append(TOKEN_BY_TOKEN)
    args.feeds = list(dict.fromkeys(args.feeds))
    for name in ("prompts", "prompt_tokens", "decode_steps", "answer_tokens", "turn2_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.generate_tokens < 0 or args.turn1_tokens < 0 or any(c < 1 for c in args.generate_chunks):
        p.error("--generate-tokens and --turn1-tokens must be >= 0, --generate-chunks >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    meta = common.start_run("eval.chunked", argv, args.threads)
    specs, skipped = common.resolve_caches(args.presets, args.prefill_attention)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model, tokenizer, model_desc = common.load_model(args.model, dtype=dtype, device=args.device)
    text, text_desc = common.load_text(args.dataset, args.text_file)
    n, k = args.prompt_tokens, args.decode_steps
    text_ids = tokenizer(text[: 8 * (args.prompts * (n + k) + args.turn1_tokens + args.turn2_tokens) + 1000],
                         add_special_tokens=False).input_ids
    used = args.prompts * (n + k)  # consecutive, disjoint slices of the text: prompt + decode tokens each
    if len(text_ids) < used + args.turn1_tokens + args.turn2_tokens:
        raise ValueError(f"the text has {len(text_ids)} tokens: fewer than --prompts x (--prompt-tokens + "
                         f"--decode-steps) + --turn1-tokens + --turn2-tokens = "
                         f"{used + args.turn1_tokens + args.turn2_tokens}")
    windows = [torch.tensor([text_ids[i : i + n + k]], device=args.device) for i in range(0, used, n + k)]
    out = Path(args.out)
    report = {
        "meta": meta, "model": model_desc, "model_dtype": str(model.dtype), "text": text_desc,
        "prompts": args.prompts, "prompt_tokens": n, "decode_steps": k,
        "feeds": {f: feed_bounds(n, f) for f in args.feeds}, "prefill_attention": args.prefill_attention,
        "ratio_target": RATIO_TARGET, "skipped": dict(skipped),
        "method": ((f"the text's first {n} tokens" if args.prompts == 1 else
                    f"each of the text's first {args.prompts} slices of {n + k} tokens: its first {n} tokens")
                   + f" fed to a fresh cache one of several ways, then {k} one-token "
                   f"forwards teacher-forced on its next tokens; KL(fp16 || cache) and top-1 agreement of the "
                   f"decode steps against fp16 (uncompressed DynamicCache in {model.dtype}) fed the same way"),
    }

    def save_partial(rows: list[dict]) -> None:
        common.write_json(out / "results.json", dict(report, partial=f"{len(rows)} rows", chunked=rows))

    per_prompt = []
    for ids in windows:
        per_prompt.append(evaluate_feeds(model, ids, n, specs, args.feeds,
                                         on_row=lambda rows: save_partial(merge_rows([*per_prompt, rows]))))
    report["chunked"] = merge_rows(per_prompt)
    unsupported = generate_supports_chunked_prefill()
    if args.generate_tokens and unsupported:
        report["skipped"]["generate check"] = unsupported
    elif args.generate_tokens:
        report["generate"] = evaluate_generate(model, windows[0][:, :n], specs, args.generate_tokens,
                                               args.generate_chunks)
        save_partial(report["chunked"])
    if args.turn1_tokens:
        conv = build_conversation(model, tokenizer, specs[0], text_ids[used:], args.turn1_tokens,
                                  args.turn2_tokens, args.answer_tokens, k)
        report["conversation"] = {"turn1_tokens": len(conv.turn1), "answer1_tokens": len(conv.answer1),
                                  "turn2_tokens": len(conv.turn2), "decode_steps": len(conv.answer2),
                                  "answer1": tokenizer.decode(conv.answer1), "answer2": tokenizer.decode(conv.answer2)}
        report["multi_turn"] = evaluate_turns(model, conv, specs)
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    write_outputs(out, report)
    print((out / "table.md").read_text())
    return report


def write_outputs(out: Path, report: dict) -> None:
    """results.json and table.md; the table from the report alone, so a saved results.json can be re-rendered."""
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "results.json", report)
    n, k = report["prompt_tokens"], report["decode_steps"]
    head = common.md_header(
        "Chunked prefill and multi-turn cache reuse", report["meta"]["command"], f"model: {report['model']}",
        f"text: {report['text']}", f"method: {report['method']}",
        f"target: every chunked feed's decode KL <= {RATIO_TARGET}x the one-prefill KL, per preset",
        f"run time: {report['seconds']} s on " + (report["meta"]["machine"]["cuda_device"] or
                                                  f"{report['meta']['machine']['cpus']} CPUs"))
    prompts = report.get("prompts", 1)
    what = f"A {n}-token prompt" if prompts == 1 else f"{prompts} prompts of {n} tokens (scores pooled)"
    body = (f"## {what} fed in pieces, then {k} decode steps\n\n"
            + chunked_tables(report["chunked"], list(report["feeds"])))
    if "generate" in report:
        rows = report["generate"]
        chunks = list(dict.fromkeys(r["prefill_chunk_size"] for r in rows if r["prefill_chunk_size"] is not None))
        body += (f"\n## generate(prefill_chunk_size=...): {rows[0]['count']} greedy tokens, each run scored on "
                 "its own tokens against one fp16 forward over them (so the ratio also moves with the tokens each "
                 "run chose)\n\n" + generate_table(rows, chunks))
    if "multi_turn" in report:
        c = report["conversation"]
        body += (f"\n## Multi-turn: turn 1 {c['turn1_tokens']} tokens + a {c['answer1_tokens']}-token answer, turn 2 "
                 f"{c['turn2_tokens']} tokens in all; {c['decode_steps']} decode steps of turn 2's answer\n\n"
                 + turns_table(report["multi_turn"]))
    common.write_table_md(out / "table.md", head, body, report["skipped"])


if __name__ == "__main__":
    main()
