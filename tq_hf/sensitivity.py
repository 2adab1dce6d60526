"""How much a layer's attention moves when its keys are quantized, measured on the first prefill.

Most layers of most models barely notice 3-4-bit keys, but some do not: Qwen2.5's first layer
carries keys whose norm is ~15x the other layers' (k_proj biases turned by RoPE, which per-channel
centering cannot remove), and its queries are as sharp, so a key error of 1.7% moves its attention
by a KL of 4.5 nats on Wikipedia text. The cache cannot tell such a layer from its keys alone;
the attention can, at the first prefill, where it holds the prompt's queries and exact keys. A
layer whose attention moves by more than `TurboQuantConfig.dense_layer_kl` keeps its K/V dense.
"""

from __future__ import annotations

import torch

from . import reference
from .config import TurboQuantConfig

SAMPLE_QUERIES = 64  # the last queries of the prompt, each attending over...
SAMPLE_KEYS = 1024  # ...at most this many keys before it: bounded cost at any prompt length
SAMPLE_ROWS = 4  # rows of a batch measured (the decision is the layer's, for every row)


def key_quantization_kl(query: torch.Tensor, key: torch.Tensor, config: TurboQuantConfig, scale: float,
                        key_offset: torch.Tensor | None = None, kv_start: torch.Tensor | None = None,
                        softcap: float | None = None) -> float:
    """Mean KL(p_exact || p_quantized) of the prompt's last queries' causal attention, in nats.

    query [B, Hq, L, D] and key [B, Hk, L, D]: a prefill's own (positions 0..L-1 of each row);
    key_offset [B, Hk, D]: the key_centering means the cache stores with (None: none);
    kv_start [B]: each row's first real position (left padding is not attended; None: 0).
    Every key is quantized (the exact prefix and ring are ignored): the measure is of the format.
    """
    rows = min(query.shape[0], SAMPLE_ROWS)
    lq = min(query.shape[2], SAMPLE_QUERIES)
    lk = min(key.shape[2], SAMPLE_KEYS + lq)
    q = query[:rows, :, -lq:].float()
    k = key[:rows, :, -lk:].float()
    offset = None if key_offset is None else key_offset[:rows, :, None, :].float()
    codes, key_scale = reference.quantize_keys(k, config, offset)
    k_hat = reference.dequantize_keys(codes, key_scale, config, k.shape[-1], offset)
    group = q.shape[1] // k.shape[1]
    k, k_hat = k.repeat_interleave(group, 1), k_hat.repeat_interleave(group, 1)

    length = key.shape[2]
    q_pos = torch.arange(length - lq, length, device=q.device)
    k_pos = torch.arange(length - lk, length, device=q.device)
    first = torch.zeros(rows, dtype=torch.long, device=q.device) if kv_start is None else kv_start[:rows].long()
    seen = (k_pos[None, None, :] <= q_pos[None, :, None]) & (k_pos[None, None, :] >= first[:, None, None])
    seen = seen[:, None]  # [rows, 1, lq, lk]
    real = seen.any(-1)  # queries of real tokens that see at least one key
    if not real.any():
        return 0.0

    def log_probs(keys: torch.Tensor) -> torch.Tensor:
        s = (q @ keys.transpose(-1, -2)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        return s.masked_fill(~seen, float("-inf")).log_softmax(-1)

    exact, quantized = log_probs(k), log_probs(k_hat)
    kl = (exact.exp() * (exact - quantized)).masked_fill(~seen, 0.0).sum(-1)  # [rows, Hq, lq]
    return float(kl.masked_select(real.expand_as(kl)).mean())
