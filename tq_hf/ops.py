"""Where each operation runs: Triton kernels for CUDA tensors, reference.py otherwise.

The kernels and the reference share one signature per operation, so callers (the cache, the
attention function) never branch on the device themselves.
"""

from __future__ import annotations

import os

import torch

from . import reference
from .layout import BlockLayout


def use_kernels(t: torch.Tensor) -> bool:
    """Kernels on CUDA tensors, unless TQ_HF_FORCE_REFERENCE=1 (for A/B checks)."""
    return t.is_cuda and os.environ.get("TQ_HF_FORCE_REFERENCE", "0") != "1"


def store(pool: torch.Tensor, layout: BlockLayout, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
          **kwargs) -> None:
    """Quantize key/value [N, H, D] into slots [N] of pool (negative slots skipped); see reference.store."""
    if use_kernels(pool):
        from .kernels import store_kv

        store_kv(pool, layout, key, value, slots, **kwargs)
    else:
        reference.store(pool, layout, key, value, slots, **kwargs)


def paged_attention(query: torch.Tensor, pool: torch.Tensor, layout: BlockLayout, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """Attention of query [B, Hq, Lq, D] over the pool; see reference.paged_attention. out: a buffer of
    query's shape and dtype (any strides, last dimension contiguous) the result goes into; returned."""
    if use_kernels(pool):
        from .kernels import unified_attention

        return unified_attention(query, pool, layout, block_table, seq_lens, scale, out=out, **kwargs)
    result = reference.paged_attention(query, pool, layout, block_table, seq_lens, scale, **kwargs)
    return result if out is None else out.copy_(result)
