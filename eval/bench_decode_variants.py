"""Decode kernel variants side by side: tile shapes (--sweep tiles) or format levers (--sweep levers).

For each (B, S) at 32/8/128 (or each --shape), times fp16 SDPA and every variant of the decode (CUDA-graph replays,
L2 flushed, medians). tiles: KV tile length x warps over the same pool, each output checked
against the launcher's defaults (max |diff|: only the summation order differs). levers: the
plain 4-bit format, then key centering + value rotation, the 4 exact leading tokens and the
128-token exact ring (the "4bit" preset's defaults), alone and together: what each costs.
splits: the split count of the split-KV decode with 128/256-token tiles (short walks at small B).
warps, warps2: 1, 2, 4 or 8 warps per program x KV tile x the launcher's split count scaled 1-4x; narrow: the
mid-batch rule (2-warp programs on 128-token tiles, twice the splits) against the rule before it, on the plain
format and with all levers. lookups: the 4-bit key lookup's variants (KV tile lengths, register caps), each
output checked against the launcher's defaults. --variants takes any set of tuning dicts, alternated --rounds
times on one pool (how a kernel change is A/B-timed). Writes OUT/results.json and OUT/table.md.

    python -m eval.bench_decode_variants --out eval/results/decode_variants
    python -m eval.bench_decode_variants --sweep levers
    python -m eval.bench_decode_variants --sweep warps2 --points 1x32768,2x32768,4x32768,8x32768 --presets 4bit,k8v4
    python -m eval.bench_decode_variants --sweep narrow --points 2x32768,4x32768,8x32768
    python -m eval.bench_decode_variants --sweep lookups --points 16x32768,1x32768,4x32768
    python -m eval.bench_decode_variants --presets 4bit,k8v4 --rounds 2 --variants "{'default': {}, 'no bt': {'bt_next': False}}"
"""

from __future__ import annotations

import argparse
import ast
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from eval.bench_kernels import _fill_pool, _flush_buffer, _key_offset, forward_buffers, make_config, parse_shape, time_ms
from eval.common import markdown_table, md_header, run_metadata

VARIANTS = {  # name -> unified_attention tuning
    "launcher defaults": {},
    "BLOCK_N 128, 4 warps": {"block_n": 128, "num_warps": 4},
    "BLOCK_N 128, 8 warps": {"block_n": 128, "num_warps": 8},
    "BLOCK_N 256, 8 warps": {"block_n": 256, "num_warps": 8},
    "BLOCK_N 64, 4 warps": {"block_n": 64, "num_warps": 4},
}

SPLITS = {  # name -> split count (unified_attention's num_splits) and tuning: short split walks at small B
    "launcher defaults": {},
    **{f"{n} splits, BLOCK_N {bn}": {"num_splits": n, "block_n": bn} for bn in (128, 256) for n in (8, 16, 32, 64, 128)},
}

WARPS = {  # name -> tuning (+ split_factor: the launcher's split count scaled): warps per program x KV tile x splits
    "launcher defaults": {},
    **{f"{nw} warps, BLOCK_N {bn}": {"num_warps": nw, "block_n": bn} for nw, bn in ((2, 128), (2, 64), (1, 64), (1, 32))},
    **{f"{nw} warps, BLOCK_N {bn}, no register cap": {"num_warps": nw, "block_n": bn, "maxnreg": 0}
       for nw, bn in ((2, 128), (1, 64))},
    **{f"{nw} warps, BLOCK_N {bn}, 2x splits": {"num_warps": nw, "block_n": bn, "split_factor": 2}
       for nw, bn in ((2, 128), (1, 64))},
    "launcher defaults (again)": {},
}

WARPS2 = {  # the second round: where fewer warps with more splits gained (B=4 4bit, B=1 k8v4), what gains
    "launcher defaults": {},
    **{f"{nw} warps, BLOCK_N {bn}, {f}x splits": {"num_warps": nw, "block_n": bn, "split_factor": f}
       for nw, bn, f in ((4, 128, 2), (2, 128, 2), (2, 128, 4), (2, 64, 2), (1, 64, 2), (1, 64, 4), (8, 256, 1),
                         (8, 128, 1), (8, 256, 2))},
    "launcher defaults (again)": {},
}

NARROW = {  # name -> tuning, with and without the levers: the mid-batch 2-warp rule against the rule before it
    "launcher defaults": {},
    "before: 4 warps, BLOCK_N 256": {"num_warps": 4, "block_n": 256},
    "before: 4 warps, BLOCK_N 128": {"num_warps": 4, "block_n": 128},
    "launcher defaults (again)": {},
}

LOOKUPS = {  # name -> unified_attention tuning: 4-bit key decoding (key_lut) x KV tile x register cap (maxnreg)
    "gather, BLOCK_N 256 (before)": {"key_lut": False, "block_n": 256, "maxnreg": 0},
    "prmt, BLOCK_N 256": {"key_lut": True, "block_n": 256, "maxnreg": 0},
    "prmt, BLOCK_N 128": {"key_lut": True, "block_n": 128, "maxnreg": 0},
    "prmt, BLOCK_N 128, maxnreg 168": {"key_lut": True, "block_n": 128, "maxnreg": 168},
    "prmt, BLOCK_N 128, maxnreg 128": {"key_lut": True, "block_n": 128, "maxnreg": 128},
    "prmt, BLOCK_N 256, maxnreg 128": {"key_lut": True, "block_n": 256, "maxnreg": 128},
    "prmt, BLOCK_N 64, maxnreg 128": {"key_lut": True, "block_n": 64, "maxnreg": 128},
    "launcher defaults": {},
    "launcher defaults, value codes as bytes": {"value_words": False},
}

LEVERS = {  # name -> (config overrides, exact prefix tokens, ring tokens)
    "plain (no levers)": ({}, 0, 0),
    "+ centering + value rotation": ({"key_centering": True, "value_rotation": True}, 0, 0),
    "+ 4 exact leading tokens": ({}, 4, 0),
    "+ 128-token exact ring": ({}, 0, 128),
    "all (4bit defaults + centering)": ({"key_centering": True, "value_rotation": True}, 4, 128),
}


def _lever_call(q, layout, b: int, s: int, prefix: int, ring: int, device: str = "cuda", tuning: dict | None = None,
                num_splits: int | None = None):
    """(call, pool) for one lever variant: pool of s random tokens plus the exact side buffers."""
    from tq_hf.kernels import unified_attention

    hk, d = layout.num_kv_heads, layout.head_dim
    mu = torch.randn(hk, d, device=device) if layout.config.key_centering else None
    pool, table = _fill_pool(layout, b, s, device=device, key_offset=mu)
    seq = torch.full((b,), s, device=device, dtype=torch.int32)
    extra = forward_buffers(layout, b, q.shape[2], prefix, ring, device)
    out = torch.full_like(q, float("nan"))

    def call():
        return unified_attention(q, pool, layout, table, seq, 1 / math.sqrt(d), max_seq_len=s, out=out,
                                 key_offset=mu, launch=_launch_config(tuning), num_splits=num_splits, **extra)
    return call, out


def _time_against(call, out, baseline, reps: int, flush):
    """Run `call` once, compare its `out` with `baseline` (None: this run is the baseline), time it.
    Returns (ms, max |diff|, baseline)."""
    call()
    torch.cuda.synchronize()
    baseline = out.clone() if baseline is None else baseline
    diff = float((out.float() - baseline.float()).abs().max())
    return time_ms(call, reps, True, flush), diff, baseline


def causal_mask(queries: int, s: int, device: str = "cuda"):
    """The boolean mask of `queries` new tokens at the end of s (None for one query: nothing to mask)."""
    if queries == 1:
        return None
    return torch.ones(queries, s, device=device, dtype=torch.bool).tril(s - queries)


def _launch_config(tuning: dict | None):
    """A variant's overrides (a dict, as the results record them) as unified_attention's LaunchConfig."""
    from tq_hf.kernels import LaunchConfig

    return LaunchConfig(**tuning) if tuning else None


def _default_splits(q, pool, layout, table, seq, s: int) -> int:
    """The split count unified_attention's launcher picks for these arguments (its plan's scalars)."""
    from tq_hf.kernels import plan_attention

    return plan_attention(q, pool, layout, table, seq, 1 / math.sqrt(q.shape[-1]), max_seq_len=s).scalars[1]


def _row(b: int, s: int, preset: str, variant: str, tuning: dict, ms: float, diff: float, sdpa: float,
         cbytes: int, out) -> dict:
    return {"B": b, "S": s, "preset": preset, "variant": variant, "tuning": tuning, "ms": ms, "sdpa_fp16_ms": sdpa,
            "ratio_vs_fp16": ms / sdpa, "GBps": cbytes / ms / 1e6, "max_abs_diff_vs_first": diff,
            "finite": bool(torch.isfinite(out).all())}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval.bench_decode_variants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="16x32768,1x32768", help="comma-separated BxS")
    ap.add_argument("--presets", default="4bit", help="comma-separated presets (4-bit codebook keys use the lookup); "
                                                      "bench_kernels' suffixes +opts / +defaults (the exact buffers too)")
    ap.add_argument("--sweep", choices=["tiles", "levers", "lookups", "splits", "warps", "warps2", "narrow"], default="tiles")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", default="eval/results/decode_variants")
    ap.add_argument("--variants", help="tiles sweep: a Python dict literal {name: tuning} instead of VARIANTS, "
                                       "e.g. \"{'default': {}, 'no bt': {'bt_next': False}}\"")
    ap.add_argument("--rounds", type=int, default=1, help="tiles sweep: time the variants this many times, alternated")
    ap.add_argument("--shape", nargs="+", type=parse_shape, default=[(32, 8, 128)],
                    help="query heads / KV heads / head_dim, e.g. 9/3/64 (SmolLM2's); several: each in turn")
    ap.add_argument("--queries", type=int, default=1, help="new queries per row (a verification forward: 5-10); the "
                                                           "fp16 baseline attends them causally, lower-right")
    return ap


def _shape_rows(args, variants: dict, hq: int, hk: int, d: int, flush) -> list[dict]:
    """The timed rows of one head shape: fp16 SDPA and every variant at each (B, S) point."""
    from tq_hf.config import TurboQuantConfig
    from tq_hf.kernels import unified_attention
    from tq_hf.layout import BlockLayout

    shape = f"{hq}/{hk}/{d}"
    rows = []
    for point in args.points.split(","):
        b, s = (int(x) for x in point.split("x"))
        q = torch.randn(b, hq, args.queries, d, device="cuda", dtype=torch.float16)
        k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16)
        v = torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16)
        mask = causal_mask(args.queries, s)
        sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), args.reps, True,
                       flush)
        del k, v
        if args.sweep in ("lookups", "narrow"):
            for lever in ("plain (no levers)", "all (4bit defaults + centering)"):
                overrides, prefix, ring = LEVERS[lever]
                options = {"key_centering": False, "value_rotation": False, **overrides}
                cfg = TurboQuantConfig.from_preset("4bit", block_size=16, exact_prefix_tokens=prefix, recent_window=ring,
                                                   **options)
                layout = BlockLayout(cfg, hk, d)
                baseline = None
                torch.manual_seed(0)
                for name, tuning in (LOOKUPS if args.sweep == "lookups" else NARROW).items():
                    torch.manual_seed(0)  # the same pool and side buffers for every variant
                    try:
                        call, out = _lever_call(q, layout, b, s, prefix, ring, tuning=tuning)
                        ms, diff, baseline = _time_against(call, out, baseline, args.reps, flush)
                    except Exception as exc:  # reported, not fatal
                        rows.append({"B": b, "S": s, "preset": "4bit", "variant": f"{lever}: {name}",
                                     "error": f"{type(exc).__name__}: {exc}"[:300]})
                        print(f"{shape} B={b} S={s} {lever}: {name}: {rows[-1]['error']}", flush=True)
                        continue
                    rows.append(_row(b, s, "4bit", f"{lever}: {name}", tuning, ms, diff, sdpa,
                                     b * hk * s * cfg.token_head_bytes(d), out))
                    print(f"{shape} B={b} S={s} {lever}: {name}: {ms:.4f} ms = x{ms / sdpa:.2f} fp16 ({sdpa:.4f}), "
                          f"max|diff| {diff:.2e}, finite {rows[-1]['finite']}", flush=True)
                    torch.cuda.empty_cache()
            continue
        if args.sweep == "levers":
            for name, (overrides, prefix, ring) in LEVERS.items():
                options = {"key_centering": False, "value_rotation": False, **overrides}
                cfg = TurboQuantConfig.from_preset("4bit", block_size=16, exact_prefix_tokens=prefix, recent_window=ring,
                                                   **options)
                layout = BlockLayout(cfg, hk, d)
                call, out = _lever_call(q, layout, b, s, prefix, ring)
                call()
                torch.cuda.synchronize()
                ms = time_ms(call, args.reps, True, flush)
                cbytes = b * hk * s * cfg.token_head_bytes(d)
                rows.append({"B": b, "S": s, "preset": "4bit", "variant": name, "ms": ms, "sdpa_fp16_ms": sdpa,
                             "ratio_vs_fp16": ms / sdpa, "GBps": cbytes / ms / 1e6, "max_abs_diff_vs_first": float("nan"),
                             "finite": bool(torch.isfinite(out).all())})
                print(f"{shape} B={b} S={s} 4bit {name}: {ms:.4f} ms = x{ms / sdpa:.2f} fp16 ({sdpa:.4f}), finite "
                      f"{rows[-1]['finite']}", flush=True)
                torch.cuda.empty_cache()
            continue
        for preset in args.presets.split(","):
            layout = BlockLayout(make_config(preset), hk, d)
            mu = _key_offset(layout)
            pool, table = _fill_pool(layout, b, s, key_offset=mu)
            extra = forward_buffers(layout, b, args.queries)  # +defaults
            seq = torch.full((b,), s, device="cuda", dtype=torch.int32)
            scale = 1 / math.sqrt(d)
            baseline = None
            sweep = {"splits": SPLITS, "warps": WARPS, "warps2": WARPS2}.get(args.sweep, variants)
            for rnd, (name, variant) in ((r, nv) for r in range(args.rounds) for nv in sweep.items()):
                out = torch.full_like(q, float("nan"))  # poisoned: unwritten rows show
                tuning = {k: v for k, v in variant.items() if k not in ("num_splits", "split_factor")}
                if "split_factor" in variant:  # the launcher's split count for these arguments, scaled
                    variant = {**variant, "num_splits": max(1, int(_default_splits(q, pool, layout, table, seq, s)
                                                                   * variant["split_factor"]))}
                try:
                    call = lambda: unified_attention(q, pool, layout, table, seq, scale, max_seq_len=s, out=out,  # noqa: E731
                                                     launch=_launch_config(tuning), num_splits=variant.get("num_splits"), key_offset=mu,
                                                     **extra)
                    ms, diff, baseline = _time_against(call, out, baseline, args.reps, flush)
                except Exception as exc:  # a variant that does not compile or fit is reported, not fatal
                    rows.append({"B": b, "S": s, "preset": preset, "variant": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
                    print(f"{shape} B={b} S={s} {preset} {name}: {rows[-1]['error']}", flush=True)
                    continue
                cbytes = b * hk * s * layout.config.token_head_bytes(d)
                rows.append(_row(b, s, preset, name if args.rounds == 1 else f"{name} (round {rnd + 1})", variant, ms,
                                 diff, sdpa, cbytes, out))
                print(f"{shape} B={b} S={s} {preset} {name}: {ms:.4f} ms = x{ms / sdpa:.2f} fp16 ({sdpa:.4f}), "
                      f"{cbytes / ms / 1e6:.0f} GB/s, max|diff| {diff:.2e}", flush=True)
            del pool, table
            torch.cuda.empty_cache()
    for row in rows:
        row["shape"] = shape
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    variants = ast.literal_eval(args.variants) if args.variants else VARIANTS
    flush = _flush_buffer()
    # every shape in one process: one CUDA context, one kernel cache
    rows = [row for hq, hk, d in args.shape for row in _shape_rows(args, variants, hq, hk, d, flush)]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = run_metadata("eval.bench_decode_variants", argv)
    shapes = ["/".join(map(str, x)) for x in args.shape]
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "shapes": shapes, "rows": rows}, indent=1))
    table_rows = [[r["shape"], r["B"], r["S"], r["preset"], r["variant"],
                   f"{r['ms']:.4f}" if "ms" in r else r["error"][:60],
                   f"{r['ratio_vs_fp16']:.2f}" if "ms" in r else "", f"{r['GBps']:.0f}" if "ms" in r else "",
                   f"{r['max_abs_diff_vs_first']:.1e}" if "ms" in r else ""] for r in rows]
    text = markdown_table(["Hq/Hk/D", "B", "S", "preset", "variant", "ms", "x fp16", "GB/s", "max|diff|"], table_rows)
    head = md_header("Decode kernel variants", meta["command"], f"GPU: {meta['machine']['cuda_device']}",
                     f"{args.queries} new queries per row; ms are medians of CUDA-graph replays, L2 flushed")
    (out_dir / "table.md").write_text(f"{head}\n{text}")
    print(text)


if __name__ == "__main__":
    main()
