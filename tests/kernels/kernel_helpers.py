"""Shared builders and checks for the kernel tests (not a test module)."""

from __future__ import annotations

import math

import torch

from tq_hf import reference
from tq_hf.config import TurboQuantConfig
from tq_hf.layout import KEY_SCALE, VALUE_MID, VALUE_SCALE, BlockLayout, key_planes, value_planes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BOUNDARY_RTOL = 1e-5  # a code may differ only for a coordinate this close to a decision boundary


def make_layout(preset: str, num_kv_heads: int, head_dim: int, block_size: int | None = 16, **options) -> BlockLayout:
    """options: further TurboQuantConfig fields (key_centering=True, value_rotation=True)."""
    rotation = options.pop("rotation", "hadamard" if head_dim & (head_dim - 1) == 0 else "random")
    plain = dict(key_centering=False, value_rotation=False, exact_prefix_tokens=0, recent_window=0)
    cfg = TurboQuantConfig.from_preset(preset, rotation=rotation, block_size=block_size, seed=3, **{**plain, **options})
    return BlockLayout(cfg, num_kv_heads, head_dim)


def rotated_coordinates(key: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """reference.quantize_keys' y (unit-variance rotated coordinates) in float64, [N, H, D]."""
    codec = reference.key_codec(layout.config, layout.head_dim, str(key.device))
    x = key.double()
    amax = x.abs().amax(-1, keepdim=True)
    u = x / torch.where(amax > 0, amax, torch.ones_like(amax))
    rms = u.square().mean(-1, keepdim=True).sqrt()
    return (u @ codec.rotation.double().T) / torch.where(rms > 0, rms, torch.ones_like(rms))


def compare_pools(got: torch.Tensor, want: torch.Tensor, layout: BlockLayout, key: torch.Tensor,
                  slots: torch.Tensor, value: torch.Tensor | None = None) -> int:
    """Assert the kernel's pool equals reference.store's; return the count of tolerated code flips.

    Tolerated: a codebook key code that differs where its rotated coordinate lies within
    BOUNDARY_RTOL of a decision boundary (the rotation's summation order differs), and the key
    scale of such a token. Everything else (values, value metadata, FP8 keys) must be equal,
    except under value_rotation (see check_rotated_values). `key` is what was quantized: the
    input minus the key_centering mean, if any.
    """
    meta_g, meta_w = layout.metadata(got), layout.metadata(want)
    if layout.config.value_rotation:
        assert value is not None, "value_rotation pools are checked against the stored values"
        check_rotated_values(got, want, layout, value, slots)
    else:
        vc_g, vc_w = layout.value_codes(got), layout.value_codes(want)
        assert torch.equal(vc_g, vc_w), f"value codes differ at {(vc_g != vc_w).nonzero()[:8].tolist()}"
        assert torch.equal(meta_g[:, :, 1:].view(torch.int16), meta_w[:, :, 1:].view(torch.int16)), (
            f"value metadata differs at {(meta_g[:, :, 1:] != meta_w[:, :, 1:]).nonzero()[:8].tolist()}")
    kc_g, kc_w = layout.key_codes(got), layout.key_codes(want)
    cfg = layout.config
    if not cfg.uses_codebook or torch.equal(kc_g, kc_w):
        assert torch.equal(kc_g, kc_w), f"FP8 key bytes differ at {(kc_g != kc_w).nonzero()[:8].tolist()}"
        assert torch.equal(meta_g[:, :, KEY_SCALE].view(torch.int16), meta_w[:, :, KEY_SCALE].view(torch.int16)), (
            "key scales differ")
        return 0
    # Unpack codes of the stored tokens and locate the flips.
    keep = slots >= 0
    s = slots[keep]
    blk, off = s // layout.block_size, s % layout.block_size
    d = layout.head_dim
    level = torch.argsort(reference.stored_codes(cfg.key_bits)).to(key.device)  # stored code -> level
    codes_g = level[reference.unpack_key_codes(kc_g[blk, :, off], cfg.key_bits, d, key_planes(cfg, d)).long()]  # [n, H, D] levels
    codes_w = level[reference.unpack_key_codes(kc_w[blk, :, off], cfg.key_bits, d, key_planes(cfg, d)).long()]
    flips = codes_g != codes_w
    y = rotated_coordinates(key[keep], layout)
    bnd = reference.key_codec(cfg, d, str(key.device)).boundaries.double()
    dist = (y[..., None] - bnd).abs().amin(-1) / y.abs().clamp_min(1.0)
    bad = flips & (dist > BOUNDARY_RTOL)
    assert not bad.any(), f"{int(bad.sum())} key codes differ away from any decision boundary (dist {dist[bad][:5].tolist()})"
    assert (codes_g - codes_w).abs().max() <= 1, "a key code moved by more than one level"
    flipped_tokens = flips.any(-1)  # [n, H]
    ks_g = meta_g[blk, :, KEY_SCALE, off].view(torch.int16)
    ks_w = meta_w[blk, :, KEY_SCALE, off].view(torch.int16)
    # Without a code flip the key scale may still differ by one bfloat16 step when its fp32 value
    # sits at a rounding midpoint and the summation order moves it by an ulp: rare, counted, bounded.
    scale_diff = (ks_g[~flipped_tokens].int() - ks_w[~flipped_tokens].int()).abs()
    assert scale_diff.max() <= 1 if scale_diff.numel() else True, "a key scale differs by more than one bf16 step"
    n_scale = int((scale_diff > 0).sum())
    assert n_scale <= max(1, scale_diff.numel() // 10000), f"{n_scale} key scales differ without a code flip"
    n_flips = int(flips.sum())
    assert n_flips <= max(2, flips.numel() // 1000), f"{n_flips} of {flips.numel()} key codes flipped"
    return n_flips


def check_rotated_values(got: torch.Tensor, want: torch.Tensor, layout: BlockLayout, value: torch.Tensor,
                         slots: torch.Tensor) -> None:
    """value_rotation: the kernel rotates in 3xTF32, the spec in an fp32 matmul, so a row's
    midpoint/scale may move by a bfloat16 step and a code by one level at a rounding edge.

    Checked instead of equality: every stored value reconstructs, in the rotated space, within
    half a quantization step of the exactly (float64) rotated input, and only a few codes and
    metadata fields differ from reference.store's.
    """
    cfg, d = layout.config, layout.head_dim
    keep = slots >= 0
    s = slots[keep]
    blk, off = s // layout.block_size, s % layout.block_size
    rv = reference.value_rotation_matrix(cfg, d, str(value.device)).double()
    y = value[keep].double() @ rv.T  # [n, H, D]
    meta = layout.metadata(got)
    scale = meta[blk, :, VALUE_SCALE, off].double()[..., None]  # [n, H, 1]
    mid = meta[blk, :, VALUE_MID, off].double()[..., None]
    codes = reference.unpack_value_codes(layout.value_codes(got)[blk, :, off], cfg.value_bits, d, value_planes(cfg, d))
    deq = mid + scale * (codes.double() - ((1 << cfg.value_bits) - 1) / 2)
    err = (deq - y).abs()
    bound = scale * 0.5 + 1e-5 * y.abs().amax(-1, keepdim=True)
    assert (err <= bound).all(), (
        f"{int((err > bound).sum())} values reconstruct beyond half a step; worst excess "
        f"{float((err - bound).max()):.3e} at {(err > bound).nonzero()[:4].tolist()}")
    codes_w = reference.unpack_value_codes(layout.value_codes(want)[blk, :, off], cfg.value_bits, d, value_planes(cfg, d))
    n_codes = int((codes != codes_w).sum())
    assert n_codes <= max(4, codes.numel() // 200), f"{n_codes} of {codes.numel()} value codes differ from the spec"
    meta_w = layout.metadata(want)
    n_meta = sum(int((meta[blk, :, f, off].view(torch.int16) != meta_w[blk, :, f, off].view(torch.int16)).sum())
                 for f in (VALUE_SCALE, VALUE_MID))
    assert n_meta <= max(2, scale.numel() // 100), f"{n_meta} value metadata fields differ from the spec"


def fill_cache(layout: BlockLayout, lens: list[int], device=DEVICE, extra_blocks: int = 2,
               dtype=torch.float32, key_offset: torch.Tensor | None = None,
               value_mean: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool holding len tokens per row (random K/V via reference.store), scattered block table; values are
    standard normal plus value_mean (0: zero-mean values, whose average over a long walk is small against them).

    With key_offset [H, D] (or per row [B, H, D]), keys get that mean added (as real biased keys
    would) and are stored centred on it.

    Unwritten slots hold 0xFF bytes (NaN scales), which no visible attention result may touch.
    """
    t = layout.block_size
    max_blocks = max(-(-n // t) for n in lens) + 1
    num_blocks = len(lens) * max_blocks + extra_blocks
    pool = layout.allocate(num_blocks, device).fill_(0xFF)  # unwritten slots: NaN metadata
    table = torch.randperm(num_blocks, device=device)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    table = table.to(torch.int32)
    for row, n in enumerate(lens):
        pos = torch.arange(n, device=device)
        slots = table[row].long()[pos // t] * t + pos % t
        k = torch.randn(n, layout.num_kv_heads, layout.head_dim, device=device, dtype=dtype) * 2
        v = torch.randn(n, layout.num_kv_heads, layout.head_dim, device=device, dtype=dtype) + value_mean
        offset = key_offset if key_offset is None or key_offset.dim() == 2 else key_offset[row]  # per row: [B, H, D]
        if offset is not None:
            k = k + offset.to(dtype)
        reference.store(pool, layout, k, v, slots, key_offset=offset)
    return pool, table


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not got.isnan().any(), f"{int(got.isnan().sum())} output elements were not written (NaN poison)"
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def attention_tolerance(dtype: torch.dtype, ref32: torch.Tensor) -> float:
    """1e-3 for the kernel's arithmetic plus the unavoidable rounding of the output dtype."""
    return 1e-3 + rel_error(ref32.to(dtype), ref32)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def exact_prefix(layout: BlockLayout, rows: int, length: int, dtype=torch.float32,
                 device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """Random exact_prefix_tokens buffers [rows, H, P, D]: keys large enough to draw a real share
    of the attention (as attention-sink tokens do) and values off-centre, so a kernel that reads
    the pool at those positions instead, or mistreats them, lands far from the reference."""
    shape = (rows, layout.num_kv_heads, length, layout.head_dim)
    keys = torch.randn(shape, device=device) * 3
    values = torch.randn(shape, device=device) * 2 + 1.5
    return keys.to(dtype), values.to(dtype)


def poison_positions(pool: torch.Tensor, layout: BlockLayout, table: torch.Tensor, rows_positions) -> None:
    """Overwrite every head's slot at the given (row, positions) pairs with garbage codes (0xFF)
    and NaN metadata, so any read of those slots shows up as NaN in the output."""
    t = layout.block_size
    for row, positions in rows_positions:
        for pos in positions:
            blk, off = table[row, pos // t].long(), pos % t
            layout.key_codes(pool)[blk, :, off] = 0xFF
            layout.value_codes(pool)[blk, :, off] = 0xFF
            layout.metadata(pool)[blk, :, :, off] = float("nan")


def recent_range(seq_len: int, window: int, recent_from: int) -> range:
    """The positions a recent_window ring of `window` slots serves for a row (reference.overlay_recent)."""
    return range(max(recent_from, seq_len - window), seq_len)


def recent_ring(layout: BlockLayout, rows: int, window: int, dtype=torch.float32,
                device=DEVICE, records: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Random recent_window rings [rows, H, W, D], independent of the pool's keys/values and
    off-centre, so reading the pool (or the prefix) at ring positions lands far from the spec;
    records: as int8 ring records (reference.encode_ring), each slot at its own scale."""
    shape = (rows, layout.num_kv_heads, window, layout.head_dim)
    keys = torch.randn(shape, device=device) * 2.5
    values = torch.randn(shape, device=device) * 2 - 1.0
    if records:  # scales over three decades, so a record read at another's scale shows
        spread = 10.0 ** torch.randint(-1, 2, (*shape[:3], 1), device=device).float()
        return reference.encode_ring(keys * spread), reference.encode_ring(values * spread.flip(2))
    return keys.to(dtype), values.to(dtype)


def poisoned_exact_buffers(pool: torch.Tensor, layout: BlockLayout, table: torch.Tensor, lens: list[int],
                           starts: list[int], prefix_len: int = 0, recent: tuple[int, int] | None = None,
                           dtype=torch.float32, device=DEVICE, ring_records: bool = False) -> dict:
    """unified_attention's exact buffers for a test, with what they serve poisoned elsewhere: prefix_len P > 0 gives
    exact prefix buffers and NaN pool slots at positions kv_start + s (s < P); recent=(W, recent_from) a ring, NaN
    pool slots at its positions and NaN prefix entries the ring covers (the ring wins there, as in
    reference.overlay_recent). So a kernel must read each position from where the spec says."""
    kw = {}
    if prefix_len:
        poison_positions(pool, layout, table, [(r, range(st, min(st + prefix_len, n)))
                                               for r, (st, n) in enumerate(zip(starts, lens))])
        kw["prefix_keys"], kw["prefix_values"] = exact_prefix(layout, len(lens), prefix_len, dtype, device)
    if recent is not None:
        w, kw["recent_from"] = recent
        ranges = [recent_range(n, w, kw["recent_from"]) for n in lens]
        poison_positions(pool, layout, table, list(enumerate(ranges)))
        kw["recent_keys"], kw["recent_values"] = recent_ring(layout, len(lens), w, dtype, device, ring_records)
        for r, (st, ring) in enumerate(zip(starts, ranges)):
            for s in range(prefix_len):  # prefix entries the ring serves must stay unread
                if st + s in ring:
                    kw["prefix_keys"][r, :, s] = float("nan")
                    kw["prefix_values"][r, :, s] = float("nan")
    return kw
