"""generate() speed and KV memory: decode ms/token, prefill time and peak memory vs context and batch.

Caches: fp16 DynamicCache + sdpa (the reference), HF QuantizedCache int4 (quanto, hqq; when
installed; a failure inside one is recorded on its row) and TurboQuantCache presets with every layer
compressed ("<preset>-all"; the model is random-init, so keeping boundary layers exact would only measure a
dense cache twice). A name ending in "+compile" is the compiled counterpart: "fp16+compile" a StaticCache,
"<preset>-all+compile" a TurboQuantCache with max_cache_len, each sized for the run (S + new tokens) and reused
across its runs (reset between them), with which generate() compiles the decode step by itself (on CUDA:
inductor, mode="reduce-overhead", i.e. CUDA graphs; on CPU dynamo's eager backend, which only exercises the path).
Ratios: decode vs fp16 (DynamicCache) and vs fp16+compile (StaticCache) at the same point. Model:
a random-init Llama with Llama-3.1-8B attention and MLP shapes (32 query / 8 KV heads, head_dim
128, hidden 4096) and few layers (--model random:llama-3.1-8b,layers=8).

One measurement = a fresh cache, then generate() of 1 + --new-tokens tokens from a random
prompt of S tokens per row (batch B), greedy, no early stop. A logits processor stamps the time
(after a device sync) at every step: prefill = first stamp - start; decode ms/token = median of
the step-to-step gaps. Warm-up: --warmup identical runs first, over exactly the lengths timed
(the first decode at a new KV length can cost ~40 ms while cuDNN SDPA plans that shape); they warm
the CUDA allocator too, which is emptied once per cache and point, not before each run. The
figures are the minimum over --repeats runs. Peak KV-side memory = peak allocated during the run
minus what was allocated before it (weights), so it includes prefill activations; cache bytes =
what the cache holds at the end (TurboQuantCache.memory_footprint, or the stored tensors).

--turn2-tokens N adds a chat's next turn to every run: the same cache, the conversation so far plus N new
tokens per row, one more generate() step; "turn 2 s" = its time to the first token (the N tokens' forward over
the S + 1 + new-tokens history), with its ratio to fp16's. --prompt-lookup K adds a run of generate() with
prompt_lookup_num_tokens=K (assisted decoding's verification forwards of up to K + 1 tokens) over the same
prompt made repetitive (its first quarter repeated), reported as tokens/s and its ratio to fp16's (batch 1 only:
transformers' assisted decoding takes one sequence; not for its QuantizedCache, which it cannot crop).
--prefill-chunk C prefills every run's prompt in chunks of C tokens per row (every cache alike, its last token
by generate()): the decode steps read the same history, and the prompt's activations shrink to a chunk's (at
B=16, S=32k fp16's one-forward prefill needs ~45 GiB of MLP activations beside its 16 GiB of KV, more than an
80 GB GPU holds). --generate-chunks C prefills through generate(prefill_chunk_size=C) instead, as a user would:
generate() compiles a fixed-capacity cache's chunks.

--preset-set full (GPU, ~6 min on an H200): (B=16, S=32k), (B=1, S=32k), (B=8, S=8k) first, then
a context sweep for the plots; --time-budget skips what would not fit. --preset-set tiny: a
seconds-long CPU run on random:tiny (used by the tests). Writes OUT/results.json, OUT/table.md and,
when some cache was timed at two or more contexts, OUT/decode_ms.png and OUT/memory.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
import traceback
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import common
from .plots import lines_vs_context

DEFAULT_CACHES = ("fp16,fp16+compile,quanto-int4,hqq-int4,4bit-all,4bit-all+compile,k8v4-all,k8v4-all+compile,"
                  "k3v4-all,k3v4-all+compile,3bit-all,3bit-all+compile")
COMPILED = "+compile"  # name suffix: the compileable counterpart of a cache, decoded by generate()'s compiled forward
STATIC_REFERENCE = common.REFERENCE + COMPILED
# (batch, context) in run order: the headline points first, so a time budget cuts the sweep only.
PRESET_SETS = {
    "full": dict(model="random:llama-3.1-8b,layers=8", new_tokens=32, repeats=2,
                 points=[(16, 32768), (1, 32768), (8, 8192), (1, 4096), (1, 16384), (16, 4096), (16, 16384)]),
    "headline": dict(model="random:llama-3.1-8b,layers=8", new_tokens=32, repeats=2,
                     points=[(1, 4096), (1, 32768), (16, 32768)]),
    "quick": dict(model="random:llama-3.1-8b,layers=4", new_tokens=16, repeats=1,
                  points=[(1, 4096), (16, 4096), (1, 16384)]),
    "tiny": dict(model="random:tiny", new_tokens=4, repeats=1, points=[(1, 32), (2, 32), (1, 64)]),
}
GIB = 2**30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset-set", default="full", choices=list(PRESET_SETS),
                   help="model, (batch, context) points, steps and repeats; flags below override")
    p.add_argument("--model", help="random:<shape> or an HF id/path (default: the preset set's)")
    p.add_argument("--points", help="override the (batch x context) points, e.g. 1x4096,16x32768")
    p.add_argument("--caches", default=DEFAULT_CACHES,
                   help=f"comma-separated caches (fp16 always runs); known: {', '.join(common.cache_names())}, and "
                        f"fp16{COMPILED} or a TurboQuantCache name + {COMPILED!r} (compiled decode)")
    p.add_argument("--new-tokens", type=int, help="timed decode steps per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed identical runs before the timed ones")
    p.add_argument("--repeats", type=int, help="timed runs; figures are the minimum")
    p.add_argument("--time-budget", type=float, default=330.0,
                   help="seconds; points not started within it are skipped (recorded as such)")
    p.add_argument("--turn2-tokens", type=int, default=0,
                   help="time a second turn of this many new tokens per row over each run's cache (0: off)")
    p.add_argument("--prompt-lookup", type=int, default=0,
                   help="also time generate(prompt_lookup_num_tokens=K) per point and cache (0: off)")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="prefill prompts in chunks of this many tokens per row, every cache alike (0: one forward)")
    p.add_argument("--generate-chunks", type=int, default=0,
                   help="prefill through generate(prefill_chunk_size=C), which compiles a fixed-capacity cache's "
                        "chunks (0: off)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                   help="model dtype (default float16 on GPU, float32 on CPU)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", default="eval/results/speed", help="output folder")
    args = p.parse_args(argv)
    preset = PRESET_SETS[args.preset_set]
    args.model = args.model or preset["model"]
    args.new_tokens = args.new_tokens or preset["new_tokens"]
    args.repeats = args.repeats or preset["repeats"]
    try:
        args.points = ([tuple(int(v) for v in x.lower().split("x")) for x in args.points.split(",")]
                       if args.points else preset["points"])
    except ValueError:
        p.error("--points takes BxS pairs, e.g. 1x4096,16x32768")
    if any(len(pt) != 2 or min(pt) < 1 for pt in args.points) or args.new_tokens < 2 or args.repeats < 1:
        p.error("points must be positive BxS pairs, --new-tokens >= 2, --repeats >= 1")
    if args.prefill_chunk < 0:
        p.error(f"--prefill-chunk takes tokens per chunk (0: one prefill), got {args.prefill_chunk}")
    if args.generate_chunks < 0 or args.generate_chunks and args.prefill_chunk:
        p.error(f"--generate-chunks takes tokens per chunk (0: off), not with --prefill-chunk; got "
                f"{args.generate_chunks} and --prefill-chunk {args.prefill_chunk}")
    args.dtype = getattr(torch, args.dtype) if args.dtype else (torch.float16 if args.device != "cpu" else torch.float32)
    return args


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class StepClock:
    """A logits processor that records a (synchronized) timestamp at every generation step."""

    def __init__(self, device: str):
        self.device, self.stamps = device, []

    def __call__(self, input_ids, scores):
        synchronize(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def tensor_bytes(obj, seen: set | None = None) -> int:
    """Bytes of every tensor reachable from obj (tensor subclasses via their inner tensors)."""
    seen = set() if seen is None else seen
    if obj is None or id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, n), seen) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o, seen) for o in obj.values())
    return 0


def cache_bytes(cache) -> int:
    """What the cache holds now: memory_footprint() if it reports one, else its stored tensors."""
    reported = common.footprint(cache)
    if reported is not None:
        return reported
    fields = ("keys", "values", "_quantized_keys", "_quantized_values")
    return sum(tensor_bytes(getattr(layer, f, None)) for layer in cache.layers for f in fields)


def compiled_spec(spec: common.CacheSpec) -> common.CacheSpec:
    """The compileable counterpart of `spec` (fp16: StaticCache; TurboQuantCache: max_cache_len); its build takes
    (config, capacity in tokens per row)."""
    from transformers import StaticCache

    def build(config, capacity: int):
        if spec.family == "reference":
            return StaticCache(config=config, max_cache_len=capacity)
        from tq_hf import TurboQuantCache

        return TurboQuantCache(config, tq_config=spec.build(config).tq_config, max_cache_len=capacity)

    kind = "StaticCache" if spec.family == "reference" else "max_cache_len"
    return dataclasses.replace(spec, name=spec.name + COMPILED, build=build,
                               description=f"{spec.description}; {kind} + generate()'s compiled decode step")


def resolve_caches(names: str) -> tuple[list[common.CacheSpec], dict[str, str]]:
    """common.resolve_caches plus the "+compile" counterparts; fp16 first, the requested order kept."""
    wanted = [n.strip() for n in common.split_top_level(names) if n.strip()]
    wanted = [common.REFERENCE] + [n for n in dict.fromkeys(wanted) if n != common.REFERENCE]
    bases = [n.removesuffix(COMPILED) for n in wanted]
    for name, base in zip(wanted, bases):
        if name.endswith(COMPILED) and not (base == common.REFERENCE or base.split("@")[0].removesuffix("-all")
                                            in common.TURBOQUANT_PRESETS):
            raise ValueError(f"{name!r}: only fp16 and TurboQuantCache presets have a {COMPILED} counterpart")
    specs, skipped = common.resolve_caches(list(dict.fromkeys(bases)))
    by_name = {spec.name: spec for spec in specs}
    out = []
    for name, base in zip(wanted, bases):
        if base in skipped:
            skipped[name] = skipped[base]
        elif name.endswith(COMPILED):
            out.append(compiled_spec(by_name[base]))
        else:
            out.append(by_name[base])
    return out, {name: why for name, why in skipped.items() if name in wanted}


def compile_config(device: str):
    """None on CUDA (generate()'s default: inductor with CUDA graphs); elsewhere dynamo's eager backend, which
    generate() only uses when told to compile on any device (the CPU run exercises the path, it is no speed-up)."""
    if device.startswith("cuda"):
        return None
    from transformers import CompileConfig

    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True
    return config


def one_run(model, spec, prompt: torch.Tensor, new_tokens: int, device: str, cache=None, turn2_tokens: int = 0,
            lookup: int = 0, prefill_chunk: int = 0, generate_chunks: int = 0) -> dict:
    """One generate() over a fresh cache (or `cache`, reset first); returns prefill s, decode ms/token, memory;
    prefill_chunk: the prompt but its last token fed in forwards of this many tokens first (0: generate()'s one
    prefill); generate_chunks: generate()'s own prefill_chunk_size; with turn2_tokens, the time to the first token of
    a next turn over the same cache; with lookup, tokens/s of a prompt-lookup generate() over a fresh cache."""
    from transformers import LogitsProcessorList

    if cache is None:
        cache = spec.build(model.config)
        extra = {}
    else:
        cache.reset()
        extra = {"compile_config": compile_config(device)} if compile_config(device) is not None else {}
    clock = StepClock(device)
    if device.startswith("cuda"):  # (the allocator stays warm: a user's next generate() finds its blocks cached)
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
    synchronize(device)
    start = time.perf_counter()
    if prefill_chunk:
        prefill_in_chunks(model, cache, prompt[:, :-1], prefill_chunk)
    sequences = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens + 1,
                               do_sample=False, logits_processor=LogitsProcessorList([clock]), pad_token_id=0,
                               eos_token_id=None, **common.with_cache(model, cache), **extra,
                               **({"prefill_chunk_size": generate_chunks} if generate_chunks else {}))
    gaps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
    result = {
        "prefill_s": clock.stamps[0] - start,
        "decode_ms_per_token": 1e3 * statistics.median(gaps),
        "decode_ms_mean": 1e3 * statistics.fmean(gaps),
        # fake-quant peers store floats; count the packed bytes they stand for
        "cache_bytes": (prompt.numel() + prompt.shape[0] * (new_tokens + 1)) * spec.bytes_per_token(model.config)
        if spec.family == "fake-quant peer" else cache_bytes(cache),
        "peak_kv_side_bytes": (torch.cuda.max_memory_allocated() - before) if device.startswith("cuda") else None,
    }
    if turn2_tokens:
        result["turn2_s"] = next_turn_seconds(model, cache, sequences, turn2_tokens, device, extra)
    if lookup:
        result["lookup_tokens_per_s"] = lookup_tokens_per_second(model, spec, prompt, new_tokens, lookup, device)
    del cache
    return result


def prefill_in_chunks(model, cache, tokens: torch.Tensor, chunk: int) -> None:
    """Feed `tokens` to `cache` in forwards of `chunk` tokens per row, outside any compiled call: generate()'s own
    prefill_chunk_size runs its chunks through the compiled forward of a compileable cache, where transformers 5.17's
    StaticCache allocates its buffers inside the captured graph and fails ("accessing tensor output of CUDAGraphs
    that has been overwritten")."""
    from eval.chunked import feed_bounds

    for start, end in feed_bounds(tokens.shape[1], str(chunk)):
        model(input_ids=tokens[:, start:end], attention_mask=torch.ones_like(tokens[:, :end]), use_cache=True,
              logits_to_keep=1, **common.with_cache(model, cache))


def next_turn_seconds(model, cache, sequences: torch.Tensor, tokens: int, device: str, extra: dict) -> float:
    """A chat's next turn: the conversation so far plus `tokens` new ones per row, through the same cache;
    seconds to its first token (one forward of the new tokens over the history)."""
    from transformers import LogitsProcessorList

    g = torch.Generator().manual_seed(sequences.shape[1])
    turn = torch.randint(3, model.config.get_text_config(decoder=True).vocab_size, (sequences.shape[0], tokens), generator=g)
    conversation = torch.cat([sequences, turn.to(sequences.device)], 1)
    clock = StepClock(device)
    synchronize(device)
    start = time.perf_counter()
    model.generate(conversation, attention_mask=torch.ones_like(conversation), max_new_tokens=1, do_sample=False,
                   logits_processor=LogitsProcessorList([clock]), pad_token_id=0, eos_token_id=None,
                   **common.with_cache(model, cache), **extra)
    return clock.stamps[0] - start


def lookup_tokens_per_second(model, spec, prompt: torch.Tensor, new_tokens: int, lookup: int, device: str) -> float:
    """Tokens per second of generate(prompt_lookup_num_tokens=lookup) over a fresh cache and a repetitive prompt
    (its first quarter repeated): verification forwards of up to lookup + 1 tokens instead of one-token steps."""
    quarter = prompt[:, : max(1, prompt.shape[1] // 4)]
    repeats = -(-prompt.shape[1] // quarter.shape[1])
    repetitive = quarter.repeat(1, repeats)[:, : prompt.shape[1]]
    synchronize(device)
    start = time.perf_counter()
    out = model.generate(repetitive, attention_mask=torch.ones_like(repetitive), max_new_tokens=new_tokens,
                         do_sample=False, prompt_lookup_num_tokens=lookup, pad_token_id=0, eos_token_id=None,
                         **common.with_cache(model, spec.build(model.config)))
    synchronize(device)
    return (out.shape[1] - repetitive.shape[1]) / (time.perf_counter() - start)


def measure(model, spec, batch: int, context: int, args) -> dict:
    """Warm-up runs, then the minimum of --repeats timed runs, for one (cache, B, S)."""
    common.set_attention(model, spec.attn_implementation)
    g = torch.Generator().manual_seed(batch * 100003 + context)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    prompt = torch.randint(0, vocab, (batch, context), generator=g).to(args.device)
    cache = None
    if args.device.startswith("cuda"):  # what earlier caches and points left cached goes back first
        torch.cuda.empty_cache()
    if spec.name.endswith(COMPILED):  # one cache for every run (static addresses); graphs from other points dropped
        torch._dynamo.reset()
        turn2 = args.turn2_tokens + 1 if args.turn2_tokens else 0  # a next turn's tokens and its answer
        cache = spec.build(model.config, context + args.new_tokens + 1 + turn2)
    # prompt lookup builds caches of its own size (timed for the growing caches only); transformers' assisted
    # decoding takes one sequence, and cannot crop its QuantizedCache (5.17 fails inside crop(), later versions refuse)
    cannot_crop = spec.family == "hf-quantized"
    lookup = 0 if spec.name.endswith(COMPILED) or batch > 1 or cannot_crop else args.prompt_lookup
    extra = dict(turn2_tokens=args.turn2_tokens, lookup=lookup, prefill_chunk=args.prefill_chunk,
                 generate_chunks=args.generate_chunks)
    with torch.inference_mode():
        for _ in range(args.warmup):
            one_run(model, spec, prompt, args.new_tokens, args.device, cache, **extra)
        runs = [one_run(model, spec, prompt, args.new_tokens, args.device, cache, **extra) for _ in range(args.repeats)]
    best = {k: min(r[k] for r in runs) if runs[0][k] is not None else None for k in runs[0]}
    if "lookup_tokens_per_s" in best:  # a rate: the best run is the fastest
        best["lookup_tokens_per_s"] = max(r["lookup_tokens_per_s"] for r in runs)
    fp16_kv = batch * (context + args.new_tokens + 1) * common.cache_spec(common.REFERENCE).bytes_per_token(model.config)
    best["cache_vs_fp16"] = best["cache_bytes"] / fp16_kv
    return best


PEER_FAMILIES = ("hf-quantized",)  # other projects' caches (transformers' QuantizedCache), measured beside these


def run_points(model, specs, args, checkpoint=None) -> list[dict]:
    """Every (point, cache) run in order; `checkpoint(rows)` after each, so a killed run keeps its figures."""
    rows, started = [], time.perf_counter()
    bar = tqdm(total=len(args.points) * len(specs), desc="speed", unit="run")
    for batch, context in args.points:
        for spec in specs:
            row = {"cache": spec.name, "family": spec.family, "batch": batch, "context": context}
            bar.set_postfix_str(f"B={batch} S={context} {spec.name}")
            if time.perf_counter() - started > args.time_budget:
                row["skipped"] = f"time budget of {args.time_budget:.0f} s spent"
            else:
                try:
                    row.update(measure(model, spec, batch, context, args))
                except torch.cuda.OutOfMemoryError as exc:
                    # torch's message up to what it asked and what was free (its advice runs on for lines)
                    row["skipped"] = f"out of memory: {str(exc).splitlines()[0].split('. Including')[0]}"
                    torch.cuda.empty_cache()
                except Exception as exc:
                    if spec.family not in PEER_FAMILIES:
                        raise
                    # a peer's failure (its library, or transformers' support of it) is its row's result, not the
                    # end of the run; this project's own caches fail loudly
                    traceback.print_exc()
                    row["skipped"] = f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            rows.append(row)
            bar.update()
            if checkpoint is not None:
                checkpoint(rows)
    bar.close()
    return rows


def add_ratios(rows: list[dict]) -> None:
    """decode and memory ratios vs fp16 (DynamicCache), and decode vs fp16+compile (StaticCache), at the same (B, S)."""
    def by_point(name):
        return {(r["batch"], r["context"]): r for r in rows if r["cache"] == name and "skipped" not in r}

    ref, static = by_point(common.REFERENCE), by_point(STATIC_REFERENCE)
    for r in rows:
        if "skipped" in r:
            continue
        base = ref.get((r["batch"], r["context"]))
        if base:
            r["decode_vs_fp16"] = r["decode_ms_per_token"] / base["decode_ms_per_token"]
            if r["peak_kv_side_bytes"] is not None:
                r["peak_vs_fp16"] = r["peak_kv_side_bytes"] / base["peak_kv_side_bytes"]
        compiled = static.get((r["batch"], r["context"]))
        if compiled:
            r["decode_vs_fp16_compiled"] = r["decode_ms_per_token"] / compiled["decode_ms_per_token"]
        if base and base.get("turn2_s") and r.get("turn2_s") is not None:
            r["turn2_vs_fp16"] = r["turn2_s"] / base["turn2_s"]
        if base and base.get("lookup_tokens_per_s") and r.get("lookup_tokens_per_s") is not None:
            r["lookup_vs_fp16"] = r["lookup_tokens_per_s"] / base["lookup_tokens_per_s"]


def write_outputs(out: Path, report: dict, plots: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "results.json", report)
    rows = report["results"]

    def fmt(r, key, f):
        return f.format(r[key]) if r.get(key) is not None else "-"

    turns = any(r.get("turn2_s") is not None for r in rows)
    lookups = any(r.get("lookup_tokens_per_s") is not None for r in rows)
    table = common.markdown_table(
        ["B", "S", "cache", "decode ms/token", "vs fp16", "vs fp16+compile", "prefill s", "peak KV-side GiB",
         "cache GiB", "cache vs fp16"] + (["turn 2 s", "vs fp16"] if turns else [])
        + (["lookup tokens/s", "vs fp16"] if lookups else []),
        [[r["batch"], r["context"], r["cache"], r.get("skipped") or fmt(r, "decode_ms_per_token", "{:.3f}"),
          fmt(r, "decode_vs_fp16", "{:.2f}x"), fmt(r, "decode_vs_fp16_compiled", "{:.2f}x"), fmt(r, "prefill_s", "{:.3f}"),
          "-" if r.get("peak_kv_side_bytes") is None else f"{r['peak_kv_side_bytes'] / GIB:.2f}",
          "-" if r.get("cache_bytes") is None else f"{r['cache_bytes'] / GIB:.3f}",
          fmt(r, "cache_vs_fp16", "{:.3f}")]
         + ([fmt(r, "turn2_s", "{:.4f}"), fmt(r, "turn2_vs_fp16", "{:.2f}x")] if turns else [])
         + ([fmt(r, "lookup_tokens_per_s", "{:.1f}"), fmt(r, "lookup_vs_fp16", "{:.2f}x")] if lookups else [])
         for r in rows],
    )
    head = common.md_header("generate() speed and KV memory", report["meta"]["command"],
                            f"model: {report['model']} ({report['dtype']})",
                            f"device: {report['meta']['machine']['cuda_device'] or 'CPU'}", f"method: {report['method']}")
    common.write_table_md(out / "table.md", head, table, report["skipped"], label="skipped caches")
    if not plots:
        return

    def series(key, scale=1.0):
        out_series: dict[str, list] = {}
        for r in rows:
            if "skipped" not in r and r.get(key) is not None:
                out_series.setdefault(f"{r['cache']} B={r['batch']}", []).append((r["context"], r[key] * scale))
        return out_series

    decode = series("decode_ms_per_token")
    if max(map(len, decode.values()), default=0) < 2:
        return  # one context per cache: no curve to draw, the table says it all
    lines_vs_context(out / "decode_ms.png", decode, "decode ms/token", f"generate() decode, {report['model']}")
    memory_key = "peak_kv_side_bytes" if any(r.get("peak_kv_side_bytes") for r in rows) else "cache_bytes"
    lines_vs_context(out / "memory.png", series(memory_key, 1 / GIB), memory_key.replace("_", " ") + " (GiB)",
                     f"KV memory, {report['model']}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    meta = common.start_run("eval.speed", argv, args.threads)
    specs, skipped = resolve_caches(args.caches)
    model, _, model_desc = common.load_model(args.model, dtype=args.dtype, device=args.device)
    model.generation_config.eos_token_id = None  # never stop early: every run decodes the same steps
    report = {
        "meta": meta, "model": model_desc, "dtype": str(args.dtype), "points": args.points,
        "new_tokens": args.new_tokens, "warmup": args.warmup, "repeats": args.repeats,
        "method": (f"generate() of 1 + {args.new_tokens} tokens per run from a random prompt, fresh cache per run; "
                   f"{args.warmup} warm-up run(s) of identical lengths, min over {args.repeats} timed run(s); decode "
                   "ms/token = median step gap (synchronized); peak KV-side = peak allocated minus weights"
                   + (f"; prompts prefilled in chunks of {args.prefill_chunk} tokens per row" if args.prefill_chunk
                      else "")
                   + (f"; prompts prefilled by generate(prefill_chunk_size={args.generate_chunks})"
                      if args.generate_chunks else "")),
        "skipped": skipped, "results": [],
    }

    def checkpoint(rows: list[dict]) -> None:  # results so far (JSON + table), rewritten after every run
        add_ratios(rows)
        write_outputs(Path(args.out), {**report, "results": rows, "partial": True}, plots=False)

    report["results"] = run_points(model, specs, args, checkpoint)
    add_ratios(report["results"])
    write_outputs(Path(args.out), report)
    print((Path(args.out) / "table.md").read_text())
    return report


if __name__ == "__main__":
    main()
