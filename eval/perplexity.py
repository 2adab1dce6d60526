"""Sliding-window perplexity with the KV cache in the loop, plus KL and top-1 agreement vs fp16.

How a window is scored (the same for every cache): a fresh cache is built, the window's first
--prefill tokens go through the model as one forward (the prefill), then the rest follows in
forwards of --chunk tokens through the same cache. A token predicted in a later chunk therefore
attends over keys/values the cache stored (compressed, for a compressed cache) for every earlier
chunk. TurboQuantCache reads its compressed pool for every chunk after the first; its first
forward attends its own exact K/V (prefill_attention="exact", the default; pass
--prefill-attention compressed to make it read the pool too). The peers follow the same rule
(HF QuantizedCache also keeps its last <= 128 tokens unquantized, by its design).

Per cache: perplexity over the scored tokens; delta % vs the fp16 reference; the mean per-token
KL(p_fp16 || p_cache) of the next-token distributions; top-1 agreement with fp16's argmax. All
caches run window by window in one process, so KL compares the same tokens.

Writes OUT/results.json, OUT/table.md and OUT/perplexity.png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import common
from .plots import quality_bars

DEFAULT_CACHES = "fp16,4bit,k8v4,k3v4,3bit,quanto-int4,hqq-int4,naive-int4,hadamard-int4"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.perplexity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_and_text_args(p, "the text scored")
    p.add_argument("--presets", default=DEFAULT_CACHES,
                   help=f"comma-separated caches (fp16 is always run first as the reference); known: "
                        f"{', '.join(common.cache_names())}")
    p.add_argument("--max-tokens", type=int, default=49152, help="use the first N tokens of the text")
    p.add_argument("--window", type=int, default=1024, help="tokens per window")
    p.add_argument("--stride", type=int, help="window start step (default: --window, i.e. disjoint windows)")
    p.add_argument("--prefill", type=int, help="tokens of the first forward of each window (default: --chunk)")
    p.add_argument("--chunk", type=int, default=128, help="tokens per later forward through the cache")
    p.add_argument("--prefill-attention", default="exact", choices=["exact", "compressed"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="model dtype (default float32 on CPU, float16 on GPU)")
    p.add_argument("--threads", type=int, help="torch CPU threads (1 is much faster on a busy machine)")
    p.add_argument("--out", default="eval/results/perplexity", help="output folder")
    args = p.parse_args(argv)
    args.stride = args.stride or args.window
    args.prefill = args.prefill or args.chunk
    for name in ("max_tokens", "window", "stride", "prefill", "chunk"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.stride > args.window:
        p.error("--stride must be <= --window")
    return args


def chunk_bounds(length: int, prefill: int, chunk: int) -> list[tuple[int, int]]:
    """[(start, end)] of the forwards that feed a window of `length` tokens."""
    bounds = [(0, min(prefill, length))]
    while bounds[-1][1] < length:
        start = bounds[-1][1]
        bounds.append((start, min(start + chunk, length)))
    return bounds


@torch.inference_mode()
def window_logprobs(model, ids: torch.Tensor, cache, prefill: int, chunk: int) -> torch.Tensor:
    """Next-token log-probabilities [L, V] (float32) of a [1, L] window fed through `cache` in chunks."""
    out = []
    for start, end in chunk_bounds(ids.shape[1], prefill, chunk):
        logits = model(input_ids=ids[:, start:end], use_cache=True, **common.with_cache(model, cache)).logits
        out.append(torch.log_softmax(logits[0].float(), -1))
    return torch.cat(out)


class Tally:
    """Running sums of one cache's scores."""

    def __init__(self) -> None:
        self.nll = self.kl = 0.0
        self.top1 = self.tokens = 0
        self.seconds = 0.0
        self.footprint: tuple[int, int] | None = None  # (bytes, tokens) at the end of a window
        self.dense_by_check: set[int] = set()  # TurboQuantCache layers its first-prefill check kept dense
        self.fp8_keys_by_check: set[int] = set()  # ... or gave FP8 keys (in some window)
        self.dense_extra_bytes = 0  # what those layers add per token over their compressed form

    def add(self, logp: torch.Tensor, targets: torch.Tensor, ref: torch.Tensor) -> None:
        self.nll -= logp.gather(-1, targets[:, None]).sum().item()
        self.kl += (ref.exp() * (ref - logp)).sum().item()
        self.top1 += (logp.argmax(-1) == ref.argmax(-1)).sum().item()
        self.tokens += targets.numel()


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """[(begin, end, first scored index within the window)]: every token after the first is scored once."""
    out, prev_end = [], 0
    for begin in range(0, num_tokens - 1, stride):
        end = min(begin + window, num_tokens)
        first = max(1, prev_end - begin)
        if end - begin >= 2 and first < end - begin:
            out.append((begin, end, first))
        prev_end = end
        if end == num_tokens:
            break
    return out


def evaluate(model, token_ids: torch.Tensor, specs: list[common.CacheSpec], args,
             on_window=None) -> dict[str, Tally]:
    """Score every cache on every window; the reference (specs[0]) first within each window.

    on_window(windows_done, tallies), if given, runs after each window (partial results)."""
    tallies = {s.name: Tally() for s in specs}
    plan = windows(token_ids.numel(), args.window, args.stride)
    bar = tqdm(total=len(plan) * len(specs), desc="perplexity", unit="window")
    for done, (begin, end, first) in enumerate(plan, 1):
        ids = token_ids[begin:end][None].to(args.device)
        targets = ids[0, first:]
        ref = None
        for spec in specs:
            bar.set_postfix_str(spec.name)
            common.set_attention(model, spec.attn_implementation)
            cache = spec.build(model.config)
            t0 = time.perf_counter()
            logp = window_logprobs(model, ids, cache, args.prefill, args.chunk)[first - 1 : -1]
            tally = tallies[spec.name]
            tally.seconds += time.perf_counter() - t0
            ref = logp if ref is None else ref
            tally.add(logp, targets, ref)
            size = common.footprint(cache)
            if size is not None:
                tally.footprint = (size, end - begin)
            if getattr(cache, "dense_by_check", None) or getattr(cache, "fp8_keys_by_check", None):
                tally.dense_by_check.update(cache.dense_by_check)
                tally.fp8_keys_by_check.update(cache.fp8_keys_by_check)
                tally.dense_extra_bytes = (
                    common.dense_layer_extra_bytes(model.config, cache.tq_config, len(tally.dense_by_check))
                    + common.fp8_key_layer_extra_bytes(model.config, cache.tq_config, len(tally.fp8_keys_by_check)))
            del cache
            bar.update()
        if on_window is not None:
            on_window(done, tallies)
    bar.close()
    return tallies


def summarize(specs, tallies: dict[str, Tally], config, first_scored_after_prefill: int) -> list[dict]:
    ref = tallies[specs[0].name]
    ref_ppl = torch.tensor(ref.nll / ref.tokens).exp().item()
    dense = common.cache_spec(common.REFERENCE).bytes_per_token(config)
    rows = []
    for spec in specs:
        t = tallies[spec.name]
        ppl = torch.tensor(t.nll / t.tokens).exp().item()
        row = {
            "preset": spec.name, "family": spec.family, "description": spec.description,
            "ppl": ppl, "delta_pct": 100.0 * (ppl / ref_ppl - 1.0),
            "kl": t.kl / t.tokens, "top1": t.top1 / t.tokens, "tokens": t.tokens,
            "tokens_reading_cache": first_scored_after_prefill,
            "kv_bytes_per_token": spec.bytes_per_token(config) + t.dense_extra_bytes,
            "kv_vs_fp16": (spec.bytes_per_token(config) + t.dense_extra_bytes) / dense,
            "dense_by_check": sorted(t.dense_by_check),
            "fp8_keys_by_check": sorted(t.fp8_keys_by_check),
            "seconds": round(t.seconds, 2),
        }
        if t.footprint:
            row["footprint_bytes"], row["footprint_tokens"] = t.footprint
        rows.append(row)
    return rows


def checked_note(row: dict) -> str:
    """What the first prefill's check did to a TurboQuantCache's layers, for the table ("" where nothing)."""
    notes = [f"layers {row[key]} {what}" for key, what in (("dense_by_check", "kept dense"),
                                                             ("fp8_keys_by_check", "given FP8 keys"))
             if row.get(key)]
    return f"; {' and '.join(notes)} by the first prefill's check" if notes else ""


def write_outputs(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "results.json", report)
    rows = report["results"]
    table = common.markdown_table(
        ["cache", "PPL", "delta vs fp16", "mean KL", "top-1 agree", "KV bytes/token", "vs fp16", "what"],
        [[r["preset"], f"{r['ppl']:.3f}", f"{r['delta_pct']:+.2f}%", f"{r['kl']:.4g}", f"{r['top1']:.2%}",
          f"{r['kv_bytes_per_token']:.0f}", f"{r['kv_vs_fp16']:.3f}",
          r["description"] + checked_note(r)] for r in rows],
    )
    head = common.md_header(
        "Perplexity with the KV cache in the loop", report["meta"]["command"], f"model: {report['model']}",
        f"text: {report['text']}",
        f"tokens: {report['tokens']} ({rows[0]['tokens']} scored; {report['tokens_reading_cache']} of them predicted "
        "by forwards after the prefill, reading the cache)", f"method: {report['method']}")
    common.write_table_md(out / "table.md", head, table, report["skipped"])
    quality_bars(out / "perplexity.png", [r["preset"] for r in rows], [r["delta_pct"] for r in rows],
                 [r["kl"] for r in rows], f"{report['model']}\n{rows[0]['tokens']} tokens, window {report['window']}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    meta = common.start_run("eval.perplexity", argv, args.threads)
    specs, skipped = common.resolve_caches(args.presets, args.prefill_attention)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model, tokenizer, model_desc = common.load_model(args.model, dtype=dtype, device=args.device)
    text, text_desc = common.load_text(args.dataset, args.text_file)
    # Tokenize a prefix generous enough for max_tokens (about 4.5 characters per token here).
    token_ids = tokenizer(text[: 8 * args.max_tokens + 1000], return_tensors="pt").input_ids[0][: args.max_tokens]
    plan = windows(token_ids.numel(), args.window, args.stride)
    if not plan:
        raise ValueError(f"the text has {token_ids.numel()} tokens: too few for one window")
    reading_cache = sum(max(0, (e - b) - max(f, args.prefill + 1)) for b, e, f in plan)
    report = {
        "meta": meta, "model": model_desc, "model_dtype": str(model.dtype), "text": text_desc,
        "tokens": int(token_ids.numel()), "window": args.window, "stride": args.stride, "prefill": args.prefill,
        "chunk": args.chunk, "prefill_attention": args.prefill_attention, "tokens_reading_cache": reading_cache,
        "method": (f"each window fed as a {args.prefill}-token prefill then {args.chunk}-token chunks through a fresh "
                   f"cache; tokens predicted after the prefill attend over the cache's stored K/V; KL(fp16 || cache) "
                   f"and top-1 agreement over the same scored tokens; fp16 = uncompressed DynamicCache in "
                   f"{model.dtype}"),
        "skipped": skipped,
    }

    def save_partial(done: int, tallies: dict[str, Tally]) -> None:
        partial = dict(report, partial=f"{done}/{len(plan)} windows",
                       results=summarize(specs, tallies, model.config, reading_cache))
        common.write_json(Path(args.out) / "results.json", partial)

    tallies = evaluate(model, token_ids, specs, args, on_window=save_partial)
    report["results"] = summarize(specs, tallies, model.config, reading_cache)
    write_outputs(Path(args.out), report)
    print((Path(args.out) / "table.md").read_text())
    return report


if __name__ == "__main__":
    main()
