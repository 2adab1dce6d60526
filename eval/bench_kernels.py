"""Time the TurboQuant kernels next to fp16 torch SDPA (enable_gqa=True) on the same shapes.

One run on a CUDA GPU: decode attention over the compressed pool (B in {1, 16}, S up to 128k,
(Hq, Hk, D) in DECODE_SHAPES: 32/8/128, 9/3/64, 32/8/64, 8/4/256, 32/16/256; presets 4bit/k8v4/k3v4/3bit),
causal prefill of 8k/16k prompts (the cache's exact mode: SDPA + store; and its compressed mode: store +
attention over the pool), and the cost of storing one decode step's tokens.
Times are medians of CUDA-graph replays (decode) or eager calls (prefill) with the L2 cache
flushed before each; GB/s counts the cache bytes the kernel must read (decode_read_bytes: the pool's
positions as the layout stores them, plus the exact prefix and ring a preset with its levers reads).
Each decode point also gets its byte floor: those bytes (fp16 K+V for SDPA) over the bandwidth of a
1 GiB device-to-device copy, counted as read + write (2 x bytes / time), and the measured time over it.

    python -m eval.bench_kernels [--quick] [--out-dir eval/results]
    python -m eval.bench_kernels --batches 1 16 --lengths 32768 --presets 4bit+defaults k8v4+defaults \
        k3v4+defaults 3bit+defaults --skip prefill store tune --tag kernels_bench_defaults   # a targeted subset

Writes OUT_DIR/TAG.json and TAG.md (the command at the top) and, when a preset was timed at two or more cache
lengths or batch sizes, TAG.png: decode time as a ratio to fp16 SDPA over that axis.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tq_hf.layout import ring_record_bytes
from tq_hf.reference import encode_ring

from .common import split_overrides, without_out_dir

DECODE_SHAPES = [(32, 8, 128), (9, 3, 64), (32, 8, 64), (8, 4, 256), (32, 16, 256)]  # (Hq, Hk, D); --quick: the first
PRESETS = ["4bit", "k8v4", "k3v4", "3bit"]
MAX_FP16_KV_BYTES = 40 * 2**30  # skip shapes whose fp16 K+V alone would exceed this
EXACT_DTYPE = torch.float16  # the exact prefix and ring buffers the decode reads (exact_buffers)
COPY_BYTES = 2**30  # the device copy whose bandwidth sets the byte floor
COPY_CONVENTION = "device-to-device copy of 1 GiB, counted as read + write: 2 x bytes / time"


OPTIONS_SUFFIX = "+opts"  # a preset name ending in this also turns on key_centering and value_rotation
DEFAULTS_SUFFIX = "+defaults"  # ... the preset as TurboQuantCache uses it: every lever at its default (exact prefix, ring)


def make_config(name: str, block_size: int | None = None):
    """TurboQuantConfig for a preset name, optionally suffixed with OPTIONS_SUFFIX or DEFAULTS_SUFFIX (else the
    plain format: no centering, value rotation, exact prefix or ring), then optionally with field overrides as
    eval.common.split_overrides reads them ('k3v4+defaults@recent_window=256')."""
    from tq_hf.config import TurboQuantConfig

    name, overrides = split_overrides(name)
    overrides.setdefault("block_size", block_size)  # a name's '@block_size=...' wins over the argument
    if name.endswith(DEFAULTS_SUFFIX):
        return TurboQuantConfig.from_preset(name[: -len(DEFAULTS_SUFFIX)], **overrides)
    opts = name.endswith(OPTIONS_SUFFIX)
    preset = name[: -len(OPTIONS_SUFFIX)] if opts else name
    plain = dict(key_centering=opts, value_rotation=opts, exact_prefix_tokens=0, recent_window=0)
    return TurboQuantConfig.from_preset(preset, **{**plain, **overrides})


def exact_buffers(layout, b: int, prefix: int, ring: int, device="cuda", ring_records: bool | None = None) -> dict:
    """unified_attention's exact side buffers (random fp16): `prefix` leading tokens and a ring of `ring` recent
    ones per row and KV head (none where 0), the ring as the cache keeps it (int8 records with recent_format "int8";
    ring_records=False: fp16, as a multi-token forward's own window)."""
    hk, d = layout.num_kv_heads, layout.head_dim
    extra = {}
    if prefix:
        pk = torch.randn(b, hk, prefix, d, device=device, dtype=EXACT_DTYPE)
        extra.update(prefix_keys=pk, prefix_values=torch.randn_like(pk))
    if ring:
        rk, rv = (torch.randn(b, hk, ring, d, device=device, dtype=EXACT_DTYPE) for _ in range(2))
        if layout.config.ring_records if ring_records is None else ring_records:
            rk, rv = encode_ring(rk), encode_ring(rv)
        extra.update(recent_keys=rk, recent_values=rv, recent_from=0)
    return extra


def forward_buffers(layout, b: int, queries: int, prefix: int | None = None, ring: int | None = None,
                    device="cuda", prefill: bool = False) -> dict:
    """exact_buffers as the cache hands them to a forward of `queries` new tokens per row (prefix and ring: the
    config's by default). A decode step (or a compressed prefill) reads the layer's ring; a forward of several
    tokens reads its own dense window of the ring's W positions plus its new tokens (TurboQuantLayer.forward_window:
    W + queries slots in the model's dtype, whatever recent_format)."""
    cfg = layout.config
    prefix = cfg.exact_prefix_tokens if prefix is None else prefix
    ring = cfg.recent_window if ring is None else ring
    if queries > 1 and not prefill:
        return exact_buffers(layout, b, prefix, ring + queries, device, ring_records=False)
    return exact_buffers(layout, b, prefix, ring, device)


def fp16_kv_bytes(b: int, s: int, hk: int, d: int) -> int:
    """fp16 K+V of b rows x s tokens x hk heads: what fp16 SDPA's decode reads (its byte floor's numerator)."""
    return 2 * b * hk * s * d * torch.float16.itemsize


def read_positions(s: int, prefix: int, ring: int) -> tuple[int, int, int]:
    """(pool, prefix, ring) positions per row and KV head a decode at cache length s reads from each source.

    As unified_attention with recent_from=0: the ring holds [max(0, s - ring), s) and wins over the prefix and
    the pool there; the prefix holds the first `prefix` positions below that; the pool the rest."""
    ring_lo = max(0, s - ring)
    from_prefix = min(prefix, ring_lo)
    return ring_lo - from_prefix, from_prefix, s - ring_lo


def decode_read_bytes(layout, b: int, s: int, prefix: int = 0, ring: int = 0) -> int:
    """Cache bytes one decode step over b rows of s tokens reads: each pool position at the layout's bytes per
    (token, KV head), each exact prefix position as fp16 K and V, each ring position as the cache keeps it (two
    int8 records, or fp16 K and V).

    The floor counts only what grows with the cache: query, output, block table and per-head constants (KBs
    against the MBs here) are left out, as fp16_kv_bytes leaves out SDPA's query and output. Pure arithmetic,
    so it is checked on CPU."""
    pool, from_prefix, from_ring = read_positions(s, prefix, ring)
    pool_token = layout.plane_bytes // layout.block_size  # key codes + value codes + metadata of one (token, head)
    exact_token = 2 * layout.head_dim * EXACT_DTYPE.itemsize  # K and V
    ring_token = 2 * ring_record_bytes(layout.head_dim) if layout.config.ring_records else exact_token
    return b * layout.num_kv_heads * (pool * pool_token + from_prefix * exact_token + from_ring * ring_token)


def floor_fields(nbytes: int, ms: float, copy_gbps: float, key_prefix: str = "") -> dict:
    """The bytes read, their floor in ms at the copy bandwidth, and the measured time over that floor."""
    floor = nbytes / copy_gbps / 1e6
    return {f"{key_prefix}bytes": nbytes, f"{key_prefix}floor_ms": floor, f"{key_prefix}ratio_vs_floor": ms / floor}


def _flush_buffer() -> torch.Tensor:
    return torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")


def time_ms(fn, reps: int, graph: bool, flush: torch.Tensor) -> float:
    """Median ms of `fn` over `reps` runs, L2 flushed before each; CUDA-graph replays if graph."""
    fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up on the capture stream
            with torch.cuda.graph(g, stream=stream):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        run = g.replay
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_bandwidth(reps: int, flush: torch.Tensor, nbytes: int = COPY_BYTES) -> float:
    """GB/s of a device-to-device copy of nbytes, counted as read + write (2 x nbytes): the rate a kernel that
    only streams memory reaches, so bytes / this is a time no decode can beat."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), reps, False, flush)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / ms / 1e6


def _key_offset(layout):
    """A key_centering mean when the layout's config centres keys, else None."""
    if not layout.config.key_centering:
        return None
    return torch.randn(layout.num_kv_heads, layout.head_dim, device="cuda")


def _fill_pool(layout, b: int, s: int, device="cuda", key_offset=None):
    """Pool + block table holding s random tokens per row (stored by the store kernel)."""
    from tq_hf.kernels import store_kv

    t = layout.block_size
    nb_row = -(-s // t)
    pool = layout.allocate(b * nb_row, device)
    table = torch.randperm(b * nb_row, device=device, dtype=torch.int64).view(b, nb_row).to(torch.int32)
    chunk = max(1, (1 << 20) // s)  # rows per store call, ~1M tokens
    for r0 in range(0, b, chunk):
        rows = range(r0, min(b, r0 + chunk))
        pos = torch.arange(s, device=device)
        slots = torch.cat([table[r].long()[pos // t] * t + pos % t for r in rows])
        n = slots.numel()
        k = torch.randn(n, layout.num_kv_heads, layout.head_dim, device=device, dtype=torch.float16)
        v = torch.randn(n, layout.num_kv_heads, layout.head_dim, device=device, dtype=torch.float16)
        store_kv(pool, layout, k, v, slots, key_offset=key_offset)
    return pool, table


def decode_grid(args) -> tuple[list[tuple[int, int, int]], list[int], list[int], list[str]]:
    """(shapes, batches, lengths, presets) of the decode section: the options given, else the defaults (--quick:
    the first shape, S 4k/32k, 4bit/k8v4)."""
    batches = args.batches or [1, 16]
    lengths = args.lengths or ([4096, 32768] if args.quick else [1024, 4096, 16384, 32768, 131072])
    shapes = args.shapes or (DECODE_SHAPES[:1] if args.quick else DECODE_SHAPES)
    presets = args.presets or (["4bit", "k8v4"] if args.quick else PRESETS)
    return shapes, batches, lengths, presets


def decode_points(shapes, batches, lengths, skipped: list[str]):
    """Yield (Hq, Hk, D, B, S) over the grid, leaving out (and noting in `skipped`) the points whose fp16 K+V
    alone exceed MAX_FP16_KV_BYTES: SDPA's reference would not fit next to the compressed pool."""
    for hq, hk, d in shapes:
        for b in batches:
            for s in lengths:
                kv_bytes = fp16_kv_bytes(b, s, hk, d)
                if kv_bytes > MAX_FP16_KV_BYTES:
                    skipped.append(f"decode B={b} S={s} {hq}/{hk}/{d}: fp16 K+V {kv_bytes / 2**30:.0f} GiB")
                    continue
                yield hq, hk, d, b, s


def _time_preset(args, preset: str, q: torch.Tensor, s: int, hk: int, sdpa: float, copy_gbps: float,
                 flush: torch.Tensor) -> dict:
    """One decode cell: `preset`'s unified_attention over b rows of s random tokens (with the exact prefix and ring
    its levers keep), next to fp16 SDPA's `sdpa` ms and the byte floor at `copy_gbps`."""
    from tq_hf.kernels import unified_attention
    from tq_hf.layout import BlockLayout

    b, d = q.shape[0], q.shape[-1]
    cfg = make_config(preset, args.block_size)
    layout = BlockLayout(cfg, hk, d)
    mu = _key_offset(layout)
    pool, table = _fill_pool(layout, b, s, key_offset=mu)
    seq = torch.full((b,), s, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(d)
    extra = exact_buffers(layout, b, cfg.exact_prefix_tokens, cfg.recent_window)
    ms = time_ms(lambda: unified_attention(q, pool, layout, table, seq, scale, max_seq_len=s, out=out,
                                           key_offset=mu, **extra),
                 args.reps, True, flush)
    cbytes = decode_read_bytes(layout, b, s, cfg.exact_prefix_tokens, cfg.recent_window)
    return {"ms": ms, "ratio_vs_fp16": ms / sdpa, "GBps": cbytes / ms / 1e6, **floor_fields(cbytes, ms, copy_gbps)}


def bench_decode(args, flush, results, checkpoint=None):
    """Every decode point; `checkpoint()` after each, so a run cut short keeps what it timed."""
    shapes, batches, lengths, presets = decode_grid(args)
    gbps = copy_bandwidth(max(5, args.reps // 2), flush)
    results.update(copy_GBps=gbps, copy_convention=COPY_CONVENTION)
    print(f"copy bandwidth {gbps:.0f} GB/s ({COPY_CONVENTION})", flush=True)
    for hq, hk, d, b, s in decode_points(shapes, batches, lengths, results["skipped"]):
        kv_bytes = fp16_kv_bytes(b, s, hk, d)
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
        k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16)
        v = torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16)
        sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), args.reps, True, flush)
        del k, v
        row = {"kind": "decode", "B": b, "S": s, "Hq": hq, "Hk": hk, "D": d, "sdpa_fp16_ms": sdpa,
               "sdpa_fp16_GBps": kv_bytes / sdpa / 1e6, **floor_fields(kv_bytes, sdpa, gbps, "fp16_")}
        print(f"decode B={b:2d} S={s:6d} {hq}/{hk}/{d}: sdpa fp16 {sdpa:.4f} ms  floor "
              f"{row['fp16_floor_ms']:.4f} ms x{row['fp16_ratio_vs_floor']:.2f}", flush=True)
        for preset in presets:
            cell = row[preset] = _time_preset(args, preset, q, s, hk, sdpa, gbps, flush)
            print(f"    {preset:5s} {cell['ms']:.4f} ms  x{cell['ratio_vs_fp16']:.2f} fp16  {cell['GBps']:7.0f} GB/s  "
                  f"floor {cell['floor_ms']:.4f} ms x{cell['ratio_vs_floor']:.2f}", flush=True)
        results["decode"].append(row)
        torch.cuda.empty_cache()
        if checkpoint is not None:
            checkpoint()


def bench_prefill(args, flush, results):
    """Causal prefill of one prompt, B=1, 32/8/128, in the cache's two modes.

    exact (the default): torch SDPA over the prompt's own fp16 K/V, then store_kv compresses them;
    compressed: store_kv, then unified_attention reads the compressed cache.
    """
    from tq_hf.kernels import store_kv, unified_attention
    from tq_hf.kernels import StoreLaunchConfig
    from tq_hf.layout import BlockLayout

    hq, hk, d = 32, 8, 128
    lengths = args.prefill_lengths or ([8192] if args.quick else [4096, 8192, 16384])
    reps = max(5, args.reps // 4)
    for s in lengths:
        q = torch.randn(1, hq, s, d, device="cuda", dtype=torch.float16)
        k = torch.randn(1, hk, s, d, device="cuda", dtype=torch.float16)
        v = torch.randn(1, hk, s, d, device="cuda", dtype=torch.float16)

        def sdpa_fn():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        sdpa = time_ms(sdpa_fn, reps, False, flush)
        row = {"kind": "prefill", "B": 1, "S": s, "Hq": hq, "Hk": hk, "D": d, "sdpa_fp16_ms": sdpa}
        print(f"prefill S={s}: sdpa fp16 causal {sdpa:.3f} ms", flush=True)
        kt = k[0].transpose(0, 1).contiguous()  # [S, Hk, D] as the cache receives them
        vt = v[0].transpose(0, 1).contiguous()
        for preset in args.prefill_presets or (["4bit"] if args.quick else ["4bit", "k8v4"]):
            layout = BlockLayout(make_config(preset, args.block_size), hk, d)
            nb = -(-s // layout.block_size)
            pool = layout.allocate(nb, "cuda")
            table = torch.arange(nb, device="cuda", dtype=torch.int32)[None]
            slots = torch.arange(s, device="cuda")
            seq = torch.tensor([s], device="cuda", dtype=torch.int32)
            out = torch.empty_like(q)
            scale = 1 / math.sqrt(d)

            def exact_fn():
                sdpa_fn()
                store_kv(pool, layout, kt, vt, slots)

            st = time_ms(lambda: store_kv(pool, layout, kt, vt, slots), reps, False, flush)
            ex = time_ms(exact_fn, reps, False, flush)
            at = time_ms(lambda: unified_attention(q, pool, layout, table, seq, scale, max_seq_len=s, out=out),
                         reps, False, flush)
            row[preset] = {"store_ms": st, "attention_ms": at, "total_ms": st + at, "ratio_vs_fp16": (st + at) / sdpa,
                           "exact_ms": ex, "exact_ratio_vs_fp16": ex / sdpa, "store_fraction_of_sdpa": st / sdpa}
            print(f"    {preset:5s} store {st:.3f} ms ({100 * st / sdpa:.1f}% of fp16 SDPA); exact mode (SDPA + store) "
                  f"{ex:.3f} ms = x{ex / sdpa:.2f}; compressed mode store + attention {at:.3f} ms = x{(st + at) / sdpa:.2f}",
                  flush=True)
        if args.store_sweep:
            for preset in ("4bit", "k3v4"):
                layout = BlockLayout(make_config(preset, args.block_size), hk, d)
                pool = layout.allocate(-(-s // layout.block_size), "cuda")
                slots = torch.arange(s, device="cuda")
                for block_t in (16, 32, 64, 128):
                    for warps in (4, 8):
                        tun = {"block_t": block_t, "num_warps": warps}
                        try:
                            ms = time_ms(lambda: store_kv(pool, layout, kt, vt, slots, launch=StoreLaunchConfig(**tun)), reps,
                                         False, flush)
                        except Exception as exc:  # noqa: BLE001 - report configs that fail to compile
                            print(f"store sweep S={s} {preset} {tun}: failed {type(exc).__name__}", flush=True)
                            continue
                        results["tune"].append({"store": s, "preset": preset, **tun, "ms": ms})
                        print(f"store sweep S={s} {preset} {tun}: {ms:.4f} ms", flush=True)
        results["prefill"].append(row)
        del q, k, v
        torch.cuda.empty_cache()


def bench_store_step(args, flush, results):
    """Store of one decode step's tokens (one per sequence) vs that step's attention, B=16, S=32k."""
    from tq_hf.config import TurboQuantConfig
    from tq_hf.kernels import store_kv, unified_attention
    from tq_hf.layout import BlockLayout

    b, s, (hq, hk, d) = 16, 32768, DECODE_SHAPES[0]
    for preset in args.prefill_presets or ["4bit", "k8v4"]:
        layout = BlockLayout(TurboQuantConfig.from_preset(preset, block_size=args.block_size), hk, d)
        pool, table = _fill_pool(layout, b, s)
        k = torch.randn(b, hk, d, device="cuda", dtype=torch.float16)
        slots = table[:, -1].long() * layout.block_size + layout.block_size - 1
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
        seq = torch.full((b,), s, device="cuda", dtype=torch.int32)
        out = torch.empty_like(q)
        st = time_ms(lambda: store_kv(pool, layout, k, k, slots), args.reps, True, flush)
        at = time_ms(lambda: unified_attention(q, pool, layout, table, seq, 0.088, max_seq_len=s, out=out),
                     args.reps, True, flush)
        results["store_step"].append({"preset": preset, "B": b, "S": s, "store_ms": st, "decode_ms": at,
                                      "store_fraction": st / at})
        print(f"store step {preset}: {st * 1000:.1f} us vs decode {at * 1000:.1f} us = {100 * st / at:.1f}%", flush=True)
        del pool, table


def bench_tune(args, flush, results):
    """Sweep launch parameters of the decode kernel at the target shapes (B=16/1, S=32k, 32/8/128)."""
    from tq_hf.config import TurboQuantConfig
    from tq_hf.kernels import LaunchConfig, unified_attention
    from tq_hf.layout import BlockLayout

    hq, hk, d, s = 32, 8, 128, 32768
    for b in (16, 1):
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
        for preset in ("4bit", "k8v4"):
            layout = BlockLayout(TurboQuantConfig.from_preset(preset, block_size=args.block_size), hk, d)
            pool, table = _fill_pool(layout, b, s)
            seq = torch.full((b,), s, device="cuda", dtype=torch.int32)
            out = torch.empty_like(q)
            for splits in ((4, 8) if b == 16 else (32, 64)):
                for block_n in (64, 128, 256):
                    for warps in (2, 4):
                        for stages in (2, 3):
                            tun = {"block_n": block_n, "num_warps": warps, "num_stages": stages}
                            try:
                                ms = time_ms(lambda: unified_attention(q, pool, layout, table, seq, 0.088, max_seq_len=s,
                                                                       out=out, num_splits=splits,
                                                                       launch=LaunchConfig(**tun)),
                                             20, True, flush)
                            except Exception as exc:  # noqa: BLE001 - report configs that fail to compile
                                print(f"tune B={b} {preset} splits={splits} {tun}: failed {type(exc).__name__}", flush=True)
                                continue
                            results["tune"].append({"B": b, "preset": preset, "splits": splits, **tun, "ms": ms})
                            print(f"tune B={b} {preset} splits={splits} {tun}: {ms:.4f} ms", flush=True)
            del pool, table
    # causal prefill, 8k, attention only
    s = 8192
    layout = BlockLayout(TurboQuantConfig.from_preset("4bit", block_size=args.block_size), hk, d)
    pool, table = _fill_pool(layout, 1, s)
    q = torch.randn(1, hq, s, d, device="cuda", dtype=torch.float16)
    seq = torch.tensor([s], device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    for block_m, block_n, warps, stages in [(64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2), (128, 64, 4, 2),
                                            (64, 128, 4, 2), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3)]:
        tun = {"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages}
        try:
            ms = time_ms(lambda: unified_attention(q, pool, layout, table, seq, 0.088, out=out, launch=LaunchConfig(**tun)), 5, False, flush)
        except Exception as exc:  # noqa: BLE001
            print(f"tune prefill {tun}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        results["tune"].append({"prefill": s, **tun, "ms": ms})
        print(f"tune prefill 8k 4bit {tun}: {ms:.3f} ms", flush=True)


def _block_label(results) -> str:
    size = results.get("block_size", 16)  # results without the field were measured over 16-token blocks
    return f"{size} tokens" if size else "the layout's default size (64 tokens at head_dim 128, 16 elsewhere)"


def _floor_cell(ms: float, floor_ms: float, ratio: float) -> str:
    return f"{ms:.4f} / {floor_ms:.4f} (x{ratio:.2f})"


def floor_table(results, presets: list[str]) -> list[str]:
    """Markdown lines of the decode rows' byte floors, fp16 SDPA's beside each preset's; none for a report
    measured before the floor was recorded."""
    rows = [r for r in results["decode"] if "fp16_floor_ms" in r]
    if not rows or "copy_GBps" not in results:
        return []
    lines = ["", f"## Decode byte floor: bytes read / copy bandwidth {results['copy_GBps']:.0f} GB/s "
             f"({results.get('copy_convention', COPY_CONVENTION)})", "",
             "Cells: measured ms / floor ms (x measured over floor). Bytes: fp16 K+V for SDPA; the pool's positions "
             "as the layout stores them plus the exact prefix and ring (fp16 K+V) for a preset.", "",
             "| B | S | Hq/Hk/D | fp16 SDPA | " + " | ".join(presets) + " |",
             "|---|---|---|---|" + "---|" * len(presets)]
    for r in rows:
        cells = [_floor_cell(r[p]["ms"], r[p]["floor_ms"], r[p]["ratio_vs_floor"])
                 if "floor_ms" in r.get(p, {}) else "-" for p in presets]
        fp16 = _floor_cell(r["sdpa_fp16_ms"], r["fp16_floor_ms"], r["fp16_ratio_vs_floor"])
        lines.append(f"| {r['B']} | {r['S']} | {r['Hq']}/{r['Hk']}/{r['D']} | {fp16} | " + " | ".join(cells) + " |")
    return lines


def markdown(results) -> str:
    lines = [f"# Kernel benchmark ({results['gpu']})", "", f"Command: `{results['command']}`  ",
             f"torch {results['torch']}, triton {results['triton']}, python {results['python']}, "
             f"cache blocks of {_block_label(results)}", "",
             "## Decode (one query per sequence): ms, ratio to fp16 SDPA, GB/s of the cache bytes read", ""]
    presets = list(dict.fromkeys(p for r in results["decode"] for p in r if isinstance(r[p], dict)))
    lines.append("| B | S | Hq/Hk/D | fp16 SDPA ms | " + " | ".join(presets) + " |")
    lines.append("|---|---|---|---|" + "---|" * len(presets))
    for r in results["decode"]:
        cells = [f"{r[p]['ms']:.4f} (x{r[p]['ratio_vs_fp16']:.2f}, {r[p]['GBps']:.0f} GB/s)" if p in r else "-"
                 for p in presets]
        lines.append(f"| {r['B']} | {r['S']} | {r['Hq']}/{r['Hk']}/{r['D']} | {r['sdpa_fp16_ms']:.4f} | " + " | ".join(cells) + " |")
    lines += floor_table(results, presets)
    if results["prefill"]:  # (sections a run skipped are left out)
        lines += ["", "## Causal prefill incl. store (B=1, 32/8/128)", "",
                  "exact mode (the cache's default): fp16 SDPA over the prompt's own K/V + store_kv; "
                  "compressed mode: store_kv + unified_attention over the compressed cache.", "",
                  "| S | fp16 SDPA ms | preset | mode | store ms | attention ms | total ms | total / fp16 |",
                  "|---|---|---|---|---|---|---|---|"]
    for r in results["prefill"]:
        for p in PRESETS:
            if p in r:
                x = r[p]
                lines.append(f"| {r['S']} | {r['sdpa_fp16_ms']:.3f} | {p} | prefill, exact mode: SDPA + store | "
                             f"{x['store_ms']:.3f} | (SDPA) | {x['exact_ms']:.3f} | x{x['exact_ratio_vs_fp16']:.2f} |")
                lines.append(f"| {r['S']} | {r['sdpa_fp16_ms']:.3f} | {p} | prefill, compressed mode | {x['store_ms']:.3f} | "
                             f"{x['attention_ms']:.3f} | {x['total_ms']:.3f} | x{x['ratio_vs_fp16']:.2f} |")
    if results["store_step"]:
        lines += ["", "## Store of one decode step (B=16, S=32k, 32/8/128)", ""]
    for r in results["store_step"]:
        lines.append(f"- {r['preset']}: store {r['store_ms'] * 1000:.1f} us, decode attention {r['decode_ms'] * 1000:.1f} us "
                     f"({100 * r['store_fraction']:.1f}%)")
    if results["skipped"]:
        lines += ["", "Skipped: " + "; ".join(results["skipped"])]
    return "\n".join(lines) + "\n"


def decode_plot(path: Path, results) -> bool:
    """Decode time / fp16 SDPA per preset and shape over the cache length (or, with one length, the batch size).

    Returns False (and writes nothing) when no series has two points: a single point is no curve."""
    rows = results["decode"]
    by_length = len({r["S"] for r in rows}) > 1
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        for preset, cell in r.items():
            if isinstance(cell, dict):
                label = f"{preset} {r['Hq']}/{r['Hk']}/{r['D']}" + (f" B={r['B']}" if by_length else f" S={r['S']}")
                series.setdefault(label, []).append((r["S"] if by_length else r["B"], cell["ratio_vs_fp16"]))
    if max(map(len, series.values()), default=0) < 2:
        return False
    from .plots import lines_vs_context

    lines_vs_context(path, series, "decode time / fp16 SDPA", f"Decode attention over the compressed cache, {results['gpu']}",
                     xlabel="cache length (tokens)" if by_length else "batch size")
    return True


def parse_shape(text: str) -> tuple[int, int, int]:
    """"Hq/Hk/D" -> (Hq, Hk, D), with Hq a multiple of Hk."""
    try:
        hq, hk, d = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a head shape is query heads/KV heads/head_dim, e.g. 32/8/128; got {text!r}")
    if min(hq, hk, d) < 1 or hq % hk:
        raise argparse.ArgumentTypeError(f"query heads must be a positive multiple of KV heads; got {text!r}")
    return hq, hk, d


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; separate from main so that it is checked without a GPU."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few shapes only (S 4k/32k, 32/8/128, 4bit/k8v4)")
    ap.add_argument("--tune", action="store_true", help="first sweep decode launch parameters (slow)")
    ap.add_argument("--reps", type=int, default=40, help="timed repetitions per measurement (median reported)")
    ap.add_argument("--out-dir", default="eval/results", help="where kernels_bench.json / .md are written")
    ap.add_argument("--shapes", type=parse_shape, nargs="*",
                    help="decode head shapes as query heads/KV heads/head_dim, e.g. 8/4/256 (default: DECODE_SHAPES)")
    ap.add_argument("--batches", type=int, nargs="*", help="decode batch sizes (default 1 16)")
    ap.add_argument("--lengths", type=int, nargs="*", help="decode cache lengths")
    ap.add_argument("--presets", nargs="*", help=f"decode presets (the plain format); suffix {OPTIONS_SUFFIX} adds key_centering + "
                    f"value_rotation, {DEFAULTS_SUFFIX} takes every lever's default (+ the exact prefix and ring)")
    ap.add_argument("--prefill-lengths", type=int, nargs="*", help="prefill prompt lengths")
    ap.add_argument("--prefill-presets", nargs="*", choices=PRESETS,
                    help="presets of the prefill and decode-step store sections (default 4bit k8v4)")
    ap.add_argument("--store-sweep", action="store_true", help="sweep store_kv tile sizes at each prefill length")
    ap.add_argument("--block-size", type=int, choices=[16, 32, 64],
                    help="tokens per cache block (default: the layout's per head_dim, layout.default_block_size)")
    ap.add_argument("--tag", help="output file stem (default kernels_bench, kernels_bench_quick with --quick)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["decode", "prefill", "store", "tune"], help="sections to skip")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA GPU")
    import triton

    torch.manual_seed(0)
    results = {"command": "python -m eval.bench_kernels " + " ".join(without_out_dir(argv if argv is not None else sys.argv[1:])),
               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "python": platform.python_version(), "block_size": args.block_size, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "timing": "median of CUDA-graph replays (decode, store step) or eager calls (prefill), L2 flushed",
               "decode": [], "prefill": [], "store_step": [], "skipped": [], "tune": []}
    flush = _flush_buffer()
    t0 = time.time()
    out, tag = Path(args.out_dir), args.tag or ("kernels_bench_quick" if args.quick else "kernels_bench")
    if args.tune:
        bench_tune(args, flush, results)
    if "decode" not in args.skip:
        bench_decode(args, flush, results,
                     lambda: write_report(out, tag, results, markdown(results), decode_plot, echo=False))
    if "prefill" not in args.skip:
        bench_prefill(args, flush, results)
    if "store" not in args.skip:
        bench_store_step(args, flush, results)
    results["wall_s"] = time.time() - t0
    write_report(out, tag, results, markdown(results), decode_plot)


def write_report(out: Path, tag: str, results: dict, md: str, plot, echo: bool = True) -> None:
    """OUT/TAG.json (every figure), TAG.md (the table) and TAG.png (plot(path, results), where it draws one); the
    table printed unless echo=False (a checkpoint of a run still going)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps(results, indent=1))
    (out / f"{tag}.md").write_text(md)
    plot(out / f"{tag}.png", results)
    if echo:
        print(md)


if __name__ == "__main__":
    main()
