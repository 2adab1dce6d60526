"""Time forwards of several queries over a compressed history next to fp16 SDPA with the same causal mask.

A chat's next turn, a prefill chunk and assisted decoding's verification are Lq new queries over S tokens of
history plus themselves. Each point times, on one CUDA GPU and in one run:
- fp16 SDPA over dense K/V with the bottom-right causal mask, as transformers' sdpa attention runs it with a
  mask (K/V repeated to the query heads, a boolean mask): what fp16 users get;
- fp16 flash attention over the same K/V with torch's causal_lower_right bias (no mask tensor): the fastest
  dense attention torch has for this shape;
- each preset as TurboQuantCache runs it (every lever at its default, the forward's own tokens in its ring of
  recent_window + Lq exact tokens) by its two routes: the unified kernel, and the dense route (kernels/history.py:
  the history dequantized once, then flash attention), which the cache takes for forwards of many queries over
  unpadded rows (history.dense_history_serves); with the largest relative difference between the two, and each
  route's host time per call (the GPU kept busy), which decides where the dense route pays.
And the compressed-mode causal prefill (prefill_attention="compressed": store, then attend over the pool),
against fp16 causal SDPA.

    python -m eval.bench_chunks [--points 1x32768x64 ...] [--prefill-lengths 8192] [--presets 4bit k8v4]
                                [--time-budget 300]

Writes OUT_DIR/TAG.json and TAG.md (the command at the top) and TAG.png: time over masked fp16 SDPA against
the query count at the first point's batch and history length; rewritten after every point, so a run cut short
keeps what it timed.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .bench_kernels import PRESETS, _fill_pool, _flush_buffer, forward_buffers, make_config, time_ms, write_report
from .common import without_out_dir

SHAPE = (32, 8, 128)  # Hq, Hk, D: Llama-3.1-8B
# over 32k, then where the two routes cross at shorter histories and at B=4 (history.dense_history_serves)
DEFAULT_POINTS = ["1x32768x1", "1x32768x8", "1x32768x16", "1x32768x32", "1x32768x48", "1x32768x64", "1x32768x96",
                  "1x32768x128", "1x32768x256", "1x32768x512", "4x16384x256", "1x16384x2048", "1x4096x64",
                  "1x4096x256", "4x8192x64", "4x8192x128"]


def parse_point(text: str) -> tuple[int, int, int]:
    """"BxSxLq" -> (B, S, Lq): B rows of S history tokens, Lq new queries each."""
    try:
        b, s, lq = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a point is rows x history x queries, e.g. 1x32768x64; got {text!r}")
    if b < 1 or s < 0 or lq < 1:
        raise argparse.ArgumentTypeError(f"rows and queries must be >= 1 and the history >= 0; got {text!r}")
    return b, s, lq


def sdpa_baselines(b: int, s: int, lq: int, reps: int, flush) -> tuple[float, float]:
    """(masked SDPA ms, flash causal_lower_right ms) over fp16 K/V of s + lq positions."""
    from torch.nn.attention.bias import causal_lower_right

    hq, hk, d = SHAPE
    total = s + lq
    q = torch.randn(b, hq, lq, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, hq, total, d, device="cuda", dtype=torch.float16)  # repeated K/V, as with a mask
    v = torch.randn_like(k)
    mask = (torch.arange(total, device="cuda")[None] <= torch.arange(lq, device="cuda")[:, None] + s)
    mask = mask[None, None].expand(b, 1, lq, total)
    masked = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), reps, False, flush)
    kk, vv = k[:, :hk].contiguous(), v[:, :hk].contiguous()
    del k, v
    bias = causal_lower_right(lq, total)
    flash = time_ms(lambda: F.scaled_dot_product_attention(q, kk, vv, attn_mask=bias, enable_gqa=True), reps, False,
                    flush)
    return masked, flash


def host_ms(fn, reps: int, keep_busy=None) -> float:
    """Median host time of fn() in ms, the device kept busy meanwhile (by default a ~1 ms sleep kernel queued
    before each call), so no launch waits on it: what a call costs the CPU, which decides where the dense route pays
    (history.dense_history_serves)."""
    if keep_busy is None:
        keep_busy = lambda: torch.cuda._sleep(2_000_000)  # noqa: E731
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    synchronize()
    times = []
    for _ in range(reps):
        keep_busy()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        synchronize()
    return 1e3 * statistics.median(times)


def _figure(value) -> str:
    """A cell's value for the progress lines: figures to 4 decimals, words (the cache's route) as they are."""
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def time_routes(preset: str, b: int, s: int, lq: int, reps: int, flush, prefill: bool = False) -> dict:
    """One preset's unified and dense routes at a point (the store included for a compressed prefill)."""
    from tq_hf.kernels import dense_history_attention, dense_history_serves, store_kv, unified_attention
    from tq_hf.layout import BlockLayout

    hq, hk, d = SHAPE
    cfg = make_config(preset + "+defaults")
    layout = BlockLayout(cfg, hk, d)
    mu = torch.randn(hk, d, device="cuda") if cfg.key_centering else None
    total = s + lq
    pool, table = _fill_pool(layout, b, total, key_offset=mu)
    seq = torch.full((b,), total, device="cuda", dtype=torch.int32)
    extra = forward_buffers(layout, b, lq, prefill=prefill)  # a compressed prefill reads the layer's ring
    q = torch.randn(b, hq, lq, d, device="cuda", dtype=torch.float16)
    scale = 1 / math.sqrt(d)
    outs = {}

    def unified():
        outs["unified"] = unified_attention(q, pool, layout, table, seq, scale, max_seq_len=total, key_offset=mu,
                                            **extra)

    def dense():
        outs["dense"] = dense_history_attention(q, pool, layout, table, seq, scale, total, key_offset=mu, **extra)

    cell = {"unified_ms": time_ms(unified, reps, lq <= 8, flush),
            "cache_route": "dense" if dense_history_serves(q, layout, total, **extra) else "unified"}
    if lq > 1:
        cell["dense_ms"] = time_ms(dense, reps, False, flush)
        cell["unified_host_ms"], cell["dense_host_ms"] = host_ms(unified, reps), host_ms(dense, reps)
        a, c = outs["unified"].float(), outs["dense"].float()
        cell["dense_vs_unified_rel"] = float((a - c).norm() / a.norm())
    if prefill:
        kt = torch.randn(total, hk, d, device="cuda", dtype=torch.float16)
        slots = torch.arange(total, device="cuda")
        cell["store_ms"] = time_ms(lambda: store_kv(pool, layout, kt, kt, slots, key_offset=mu), reps, False, flush)
    del pool, table
    torch.cuda.empty_cache()
    return cell


def run(args, checkpoint=None) -> dict:
    """Every point, then every prefill length, in order; `checkpoint(results)` after each, so a killed run keeps its
    figures. Those not started within args.time_budget seconds are listed as skipped."""
    import triton

    started = time.perf_counter()

    def budget_spent() -> bool:
        return args.time_budget is not None and time.perf_counter() - started > args.time_budget

    flush = _flush_buffer()
    results = {"command": "python -m eval.bench_chunks " + " ".join(args.argv), "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
               "shape": "/".join(map(str, SHAPE)), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "timing": "median of eager calls (CUDA-graph replays for Lq <= 8), L2 flushed", "points": [],
               "prefill": [], "skipped": [], "time_budget_s": args.time_budget}
    for b, s, lq in args.points:
        if budget_spent():
            results["skipped"].append(f"{b}x{s}x{lq}")
            continue
        masked, flash = sdpa_baselines(b, s, lq, args.reps, flush)
        row = {"B": b, "S": s, "Lq": lq, "sdpa_masked_ms": masked, "flash_lower_right_ms": flash}
        print(f"B={b} S={s} Lq={lq}: fp16 SDPA masked {masked:.4f} ms, flash lower-right {flash:.4f} ms", flush=True)
        for preset in args.presets:
            row[preset] = cell = time_routes(preset, b, s, lq, args.reps, flush)
            print(f"    {preset:5s} " + "  ".join(f"{k} {_figure(v)}" for k, v in cell.items()), flush=True)
        results["points"].append(row)
        if checkpoint is not None:
            checkpoint(results)
    for s in args.prefill_lengths:
        if budget_spent():
            results["skipped"].append(f"prefill {s}")
            continue
        hq, hk, d = SHAPE
        q = torch.randn(1, hq, s, d, device="cuda", dtype=torch.float16)
        k = torch.randn(1, hk, s, d, device="cuda", dtype=torch.float16)
        causal = time_ms(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True), args.reps,
                         False, flush)
        del q, k
        row = {"S": s, "sdpa_causal_ms": causal}
        print(f"compressed prefill S={s}: fp16 causal SDPA {causal:.4f} ms", flush=True)
        for preset in args.presets:
            row[preset] = cell = time_routes(preset, 1, 0, s, args.reps, flush, prefill=True)
            print(f"    {preset:5s} " + "  ".join(f"{k} {_figure(v)}" for k, v in cell.items()), flush=True)
        results["prefill"].append(row)
        if checkpoint is not None:
            checkpoint(results)
    return results


def markdown(results: dict) -> str:
    presets = [p for p in PRESETS if any(p in r for r in results["points"] + results["prefill"])]
    lines = [f"# Forwards of several queries over a compressed history ({results['gpu']})", "",
             f"Command: `{results['command']}`  ", f"torch {results['torch']}, triton {results['triton']}, "
             f"Hq/Hk/D {results['shape']}, fp16; {results['timing']}", "",
             "Cells: ms (x over fp16 SDPA with the mask). Presets with every lever at its default; the forward's "
             "own tokens exact. unified: the unified kernel; dense: the history dequantized once, then flash "
             "attention (kernels/history.py). In bold the route TurboQuantCache takes (history.dense_history_serves: "
             "the dense one for enough queries x history over unpadded rows).", "",
             "| B | S | Lq | fp16 SDPA masked | fp16 flash lower-right | " +
             " | ".join(f"{p} unified | {p} dense" for p in presets) + " |",
             "|---|---|---|---|---|" + "---|---|" * len(presets)]
    for r in results["points"]:
        base = r["sdpa_masked_ms"]
        lines.append(f"| {r['B']} | {r['S']} | {r['Lq']} | {base:.4f} | {_cell(r['flash_lower_right_ms'], base)} | "
                     + " | ".join(_route_cells(r, presets, base)) + " |")
    hosted = [r for r in results["points"] if any("dense_host_ms" in r.get(p, {}) for p in presets)]
    if hosted:
        lines += ["", "Host time per call, ms (the GPU kept busy, so no launch waits): unified / dense. The dense "
                  "route pays where its device time saved exceeds the difference.", "",
                  "| B | S | Lq | " + " | ".join(presets) + " |", "|---|---|---|" + "---|" * len(presets)]
        for r in hosted:
            cells = [f"{r[p]['unified_host_ms']:.3f} / {r[p]['dense_host_ms']:.3f}" if "dense_host_ms" in r.get(p, {})
                     else "-" for p in presets]
            lines.append(f"| {r['B']} | {r['S']} | {r['Lq']} | " + " | ".join(cells) + " |")
    if results["prefill"]:
        lines += ["", "## Compressed-mode causal prefill (B=1): store + attention over the pool", "",
                  "| S | fp16 causal SDPA | " + " | ".join(f"{p} unified | {p} dense" for p in presets) + " |",
                  "|---|---|" + "---|---|" * len(presets)]
        for r in results["prefill"]:
            base = r["sdpa_causal_ms"]
            lines.append(f"| {r['S']} | {base:.4f} | " + " | ".join(_route_cells(r, presets, base, "store_ms")) + " |")
    diffs = [r[p]["dense_vs_unified_rel"] for r in results["points"] + results["prefill"] for p in presets
             if "dense_vs_unified_rel" in r.get(p, {})]
    if diffs:
        lines += ["", f"Largest relative difference between the two routes' outputs: {max(diffs):.2e}"]
    if results.get("skipped"):
        lines += ["", f"Not timed (time budget of {results['time_budget_s']:.0f} s spent): " + ", ".join(results["skipped"])]
    return "\n".join(lines) + "\n"


def _route_cells(row: dict, presets: list[str], base: float, plus: str | None = None) -> list[str]:
    """Each preset's unified and dense cells of a row ('-' where not timed); `plus`: a field added to both."""
    cells = []
    for p in presets:
        c = row.get(p, {})
        for route in ("unified", "dense"):
            cell = _cell(c[f"{route}_ms"] + (c[plus] if plus else 0.0), base) if f"{route}_ms" in c else "-"
            cells.append(f"**{cell}**" if c.get("cache_route") == route else cell)
    return cells


def _cell(ms: float | None, base: float) -> str:
    return "-" if ms is None else f"{ms:.4f} (x{ms / base:.2f})"


def plot(path: Path, results: dict) -> bool:
    """Time over masked fp16 SDPA against Lq at the first point's (B, S), per preset and route; False (nothing
    written) with fewer than two such points."""
    if not results["points"]:
        return False
    b, s = results["points"][0]["B"], results["points"][0]["S"]
    rows = [r for r in results["points"] if (r["B"], r["S"]) == (b, s)]
    if len(rows) < 2:
        return False
    series: dict[str, list[tuple[int, float]]] = {
        "fp16 flash lower-right": [(r["Lq"], r["flash_lower_right_ms"] / r["sdpa_masked_ms"]) for r in rows]}
    for p in PRESETS:
        for route in ("unified", "dense"):
            pts = [(r["Lq"], r[p][f"{route}_ms"] / r["sdpa_masked_ms"]) for r in rows if f"{route}_ms" in r.get(p, {})]
            if len(pts) > 1:
                series[f"{p} {route}"] = pts
    from .plots import lines_vs_context

    lines_vs_context(path, series, "time / fp16 SDPA with the mask",
                     f"Lq queries over B={b}, S={s} of history, {results['gpu']}", xlabel="new queries per row (Lq)")
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=parse_point, nargs="*", default=[parse_point(p) for p in DEFAULT_POINTS],
                    help="BxSxLq points (default: " + " ".join(DEFAULT_POINTS) + ")")
    ap.add_argument("--prefill-lengths", type=int, nargs="*", default=[8192], help="compressed-mode prefill lengths")
    ap.add_argument("--presets", nargs="*", default=PRESETS, choices=PRESETS)
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per measurement (median reported)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds; points (then prefill lengths) not started within it are skipped and listed")
    ap.add_argument("--out-dir", default="eval/results")
    ap.add_argument("--tag", default="chunks_bench", help="output file stem")
    args = ap.parse_args(argv)
    args.argv = without_out_dir(list(argv if argv is not None else sys.argv[1:]))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_chunks needs a CUDA GPU")
    torch.manual_seed(0)
    out = Path(args.out_dir)
    results = run(args, lambda partial: write_report(out, args.tag, partial, markdown(partial), plot, echo=False))
    write_report(out, args.tag, results, markdown(results), plot)


if __name__ == "__main__":
    main()
