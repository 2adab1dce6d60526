"""Input checks of the kernel launchers: each bad argument gets an error naming it and what is supported."""

from __future__ import annotations

import math

import torch

from ..config import MAX_EXACT_PREFIX
from ..layout import BlockLayout

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# ring slots the kernels take: recent_window, or a multi-token forward's ring (that window and its own tokens)
MAX_RING_SLOTS = 1 << 24


def check_key_offset(key_offset, layout: BlockLayout, device, rows: int | None = None) -> tuple[torch.Tensor | None, int]:
    """(the key_centering mean as contiguous fp32, its row stride): [H, D] shared (stride 0) or
    [R, H, D] per row (stride H * D). `rows`, when given, is the R a per-row mean must have."""
    if key_offset is None:
        return None, 0
    check_tensor("key_offset", key_offset, dtypes=ACTIVATION_DTYPES, device=device)
    heads, dim = layout.num_kv_heads, layout.head_dim
    shared = tuple(key_offset.shape) == (heads, dim)
    per_row = key_offset.dim() == 3 and tuple(key_offset.shape[1:]) == (heads, dim) and key_offset.shape[0] > 0
    if per_row and rows is not None and key_offset.shape[0] != rows:
        per_row = False
    if not (shared or per_row):
        want = f"[{heads}, {dim}] (one mean per KV head) or [{rows if rows is not None else 'rows'}, {heads}, {dim}] (per row)"
        raise ValueError(f"key_offset must be {want}, got {list(key_offset.shape)}")
    return key_offset.float().contiguous(), 0 if shared else heads * dim


def check_tensor(name: str, t, *, dim: int | None = None, dtypes=None, device=None) -> None:
    """Raise TypeError/ValueError naming `name` when t is not a tensor of the expected kind."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {list(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {names}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, but the pool is on {device}")


def check_layout_pool(pool: torch.Tensor, layout: BlockLayout) -> None:
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a tq_hf.layout.BlockLayout, got {type(layout).__name__}")
    check_tensor("pool", pool)
    layout.check_pool(pool)


def check_attention_inputs(query, pool, layout, block_table, seq_lens, kv_start, sinks, out, scale, sliding_window, softcap):
    check_layout_pool(pool, layout)
    dev = pool.device
    check_tensor("query", query, dim=4, dtypes=ACTIVATION_DTYPES, device=dev)
    b, hq, lq, d = query.shape
    if d != layout.head_dim:
        raise ValueError(f"query head_dim {d} does not match the layout's head_dim {layout.head_dim}")
    if query.stride(-1) != 1:
        raise ValueError("query must be contiguous in its last (head_dim) dimension")
    hk = layout.num_kv_heads
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of the pool's KV heads ({hk})")
    if lq < 1 or b < 1:
        raise ValueError(f"query must have at least one row and one position, got shape {list(query.shape)}")
    check_tensor("block_table", block_table, dim=2, dtypes=(torch.int32, torch.int64), device=dev)
    if block_table.shape[0] != b or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be [{b}, max_blocks] with contiguous rows, got {list(block_table.shape)}")
    check_tensor("seq_lens", seq_lens, dim=1, dtypes=(torch.int32, torch.int64), device=dev)
    if seq_lens.shape[0] != b:
        raise ValueError(f"seq_lens must be [{b}], got {list(seq_lens.shape)}")
    if kv_start is not None:
        check_tensor("kv_start", kv_start, dim=1, dtypes=(torch.int32, torch.int64), device=dev)
        if kv_start.shape[0] != b:
            raise ValueError(f"kv_start must be [{b}], got {list(kv_start.shape)}")
    if sinks is not None:
        check_tensor("sinks", sinks, dim=1, dtypes=ACTIVATION_DTYPES, device=dev)
        if sinks.shape[0] != hq:
            raise ValueError(f"sinks must be [{hq}] (one logit per query head), got {list(sinks.shape)}")
    if out is not None:
        check_tensor("out", out, dim=4, dtypes=(query.dtype,), device=dev)
        if out.shape != query.shape or out.stride(-1) != 1:
            raise ValueError(f"out must be {list(query.shape)} with a contiguous last dimension, got {list(out.shape)}")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite Python float, got {scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"softcap must be a positive float or None, got {softcap!r}")


def _check_exact_buffers(kind: str, keys, values, limit: int, option: str, letter: str, slot_word: str,
                         layout: BlockLayout, batch: int, device) -> int:
    """Validate a pair of dense exact-token buffers [B, Hk, N, D] ("prefix" or "recent"); return N (0: none)."""
    k_name, v_name = f"{kind}_keys", f"{kind}_values"
    if (keys is None) != (values is None):
        raise ValueError(f"{k_name} and {v_name} ({option}) must be given together, or neither")
    if keys is None:
        return 0
    records = kind == "recent" and keys.dtype == torch.int8  # int8 ring records (layout.ring_spec)
    width = layout.ring_width(keys.dtype) if records else layout.head_dim
    expected = (f"[{batch}, {layout.num_kv_heads}, {letter}, {width}] with 1 <= {letter} <= {limit}"
                + (" (int8 ring records: head_dim codes, then a bfloat16 scale per 16 of them, padded to 16 bytes)"
                   if records else ""))
    for name, t in ((k_name, keys), (v_name, values)):
        check_tensor(name, t, dim=4, dtypes=(torch.int8,) if records else ACTIVATION_DTYPES, device=device)
        b, hk, n, d = t.shape
        if (b, hk, d) != (batch, layout.num_kv_heads, width) or not 1 <= n <= limit:
            raise ValueError(f"{name} must be {expected} (rows, KV heads, {slot_word}, head_dim), got {list(t.shape)}")
        if records:
            check_ring_alignment(name, t)
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    if keys.shape != values.shape:
        raise ValueError(f"{k_name} {list(keys.shape)} and {v_name} {list(values.shape)} must have the same shape")
    return keys.shape[2]


def check_ring_alignment(name: str, t: torch.Tensor) -> None:
    """int8 ring records [.., .., W, ring_record_bytes(D)] keep their 16-bit scales 2-byte aligned and each record
    4-byte aligned (the kernels load the scales as 16-bit words)."""
    if t.stride(0) % 4 or t.stride(1) % 4 or t.stride(2) % 4 or t.storage_offset() % 4:
        raise ValueError(f"{name}: int8 ring records must start 4-byte aligned (strides and offset multiples of 4), "
                         f"got strides {t.stride()} and offset {t.storage_offset()}")


def check_prefix(prefix_keys, prefix_values, layout: BlockLayout, batch: int, device) -> int:
    """Validate the exact_prefix_tokens buffers; return P (0 when neither is given)."""
    return _check_exact_buffers("prefix", prefix_keys, prefix_values, MAX_EXACT_PREFIX, "exact_prefix_tokens", "P",
                                "prefix tokens", layout, batch, device)


def check_recent(recent_keys, recent_values, layout: BlockLayout, batch: int, device) -> int:
    """Validate the recent_window ring buffers; return W (0 when neither is given)."""
    return _check_exact_buffers("recent", recent_keys, recent_values, MAX_RING_SLOTS, "recent_window", "W",
                                "ring slots", layout, batch, device)

