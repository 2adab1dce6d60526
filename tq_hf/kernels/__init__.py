"""Triton kernels over the compressed paged cache (CUDA; the interpreter runs them on CPU).

store_kv: quantize + write new tokens (reference.store's contract and bytes).
unified_attention: prefill, chunked prefill and decode attention over the pool
(reference.paged_attention's contract), with a split-KV decode path.
dense_history_attention: the same contract for forwards of many queries over unpadded rows, through a dense copy
of the history and flash attention (dense_history_serves says when).
ring_window: reference.ring_window (a forward's exact window from the ring and its new tokens).
dequantize: reference.gather's contract (the history as dense K/V, for other attention implementations).
HeldAttention, HeldStore: one caller's repeated launch, its plan and lasting arguments kept across calls.
DeviceTraits: the device as the launch heuristics see it (default: read from the pool's device).
LaunchConfig, StoreLaunchConfig: overrides of the launch heuristics, for benchmarks and tests.
"""

from .attention import HeldAttention, held_signature, plan_attention, unified_attention
from .dequantize import dequantize
from .history import dense_history_attention, dense_history_serves, prefers_dense_route
from .device import DeviceTraits, device_traits
from .launch_config import LaunchConfig, StoreLaunchConfig
from .store import HeldStore, store_kv, store_signature
from .window import ring_window

__all__ = ["DeviceTraits", "dense_history_attention", "dense_history_serves", "prefers_dense_route", "dequantize", "HeldAttention", "HeldStore", "held_signature", "LaunchConfig", "StoreLaunchConfig", "device_traits",
           "plan_attention", "ring_window", "store_kv", "store_signature", "unified_attention"]
