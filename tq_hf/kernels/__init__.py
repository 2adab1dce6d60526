"""Triton kernels over the compressed paged cache (CUDA; the interpreter runs them on CPU).

store_kv: quantize + write new tokens (reference.store's contract and bytes).
unified_attention: prefill, chunked prefill and decode attention over the pool
(reference.paged_attention's contract), with a split-KV decode path.
"""

from .store import store_kv
from .attention import unified_attention

__all__ = ["store_kv", "unified_attention"]
