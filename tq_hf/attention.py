"""The "turboquant" attention and mask functions for transformers' AttentionInterface.

With a TurboQuantCache the key tensor handed to the attention function carries a LayerStep
(see cache.py): the queries then attend over the compressed pool through ops.paged_attention
(Triton on CUDA, reference.py elsewhere), except a first prefill in "exact" mode, which attends
over the prompt's own K/V with HF's mask. With any other cache, or none, this is sdpa-equivalent
math (eager-equivalent where sdpa lacks the feature: logit softcapping, attention sinks).

The mask function is HF's sdpa mask with two changes: at decode (one query) it never takes the
host-syncing "is the mask skippable" shortcut (a plain causal decode mask is the 2-D padding mask
itself, viewed as 4-D, or None without one; anything else is built), and a mask carries the 2-D
padding mask it was built from (or NO_PADDING when the model got none), so the attention function
can find each row's first real position: the 4-D mask alone cannot tell left padding from keys
that a sliding window hides.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import ops, reference
from .sensitivity import key_quantization_kl
from .cache import ATTENTION_NAME, STEP_ATTRIBUTE, SUPPORTED_DTYPES, LayerStep

PADDING_ATTRIBUTE = "_turboquant_padding"  # attribute of a mask tensor: the 2-D padding mask [B, S] bool
NO_PADDING = "no padding"  # that attribute when the model was called without a 2-D attention mask
# FP8 keys serve a layer the check flags only where they keep its attention as close as ordinary layers' 3-4-bit
# keys keep theirs (most below 0.1 nats at the default dense_layer_kl of 0.5; Qwen2.5-Coder-0.5B's first layer 0.01)
FP8_KEYS_KL_SHARE = 0.2
DENSE_SCORE_BUDGET = 1 << 26  # fp32 scores per chunk of the dense fallback (256 MiB)


def turboquant_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [B, Hq, Lq, D], key/value [B, Hk, S, D] -> ([B, Lq, Hq, D], None)."""
    sinks = kwargs.pop("s_aux", None)  # gpt_oss attention sinks, one logit per query head
    if kwargs.get("output_attentions"):
        raise ValueError(
            "attn_implementation='turboquant' does not return attention weights (output_attentions=True); "
            "load the model with attn_implementation='eager' to inspect them"
        )
    if kwargs.get("position_bias") is not None:
        raise ValueError("attn_implementation='turboquant' does not support position_bias (relative attention bias)")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    step: LayerStep | None = getattr(key, STEP_ATTRIBUTE, None)
    if step is None or step.exact:
        if step is not None:
            _settle_prefill(step, attention_mask, query, key, value, scale, sliding_window, sinks, softcap)
        return dense_attention_forward(module, query, key, value, attention_mask, dropout, scale, sliding_window,
                                       softcap, sinks, is_causal, **kwargs)

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal or _is_cross_attention(module):
        raise ValueError("TurboQuantCache supports causal self-attention only (cross-attention or non-causal "
                         "attention was requested)")
    if dropout and module.training:
        raise ValueError("attention dropout is not supported over a TurboQuantCache (the model is in training mode)")
    layer = step.layer
    out = None
    if step is layer._decode_step and not layer.needs_full_mask and query.dim() == 4:  # most generate() steps
        b, hq, lq, d = query.shape
        out = query.new_empty(b, lq, hq, d)
        if _held_decode(layer, query, out.transpose(1, 2), scale, sliding_window, sinks, softcap):
            return out, None
    _check_query(query, layer)
    # (a decode step's update already filled the prefix with the padding it knew)
    if step.refresh_padding and _settle_prefill(step, attention_mask, query, key, value, scale, sliding_window,
                                                sinks, softcap):  # the layer went dense: this forward too
        return dense_attention_forward(module, query, key, value, attention_mask, dropout, scale, sliding_window,
                                       softcap, sinks, is_causal, **kwargs)
    window = step.window if layer.layout.config.prefill_attention == "exact" else None
    if layer.needs_full_mask:  # padding inside rows: only HF's mask describes it
        k, v = layer.dequantized()
        if window is not None:  # this forward's own tokens (and the ring's history) exact
            k, v = (reference.overlay_recent(x, ring, layer.seq_lens, layer.recent_from) for x, ring in zip((k, v), window))
        mask = _bool_mask(attention_mask, query, k.shape[2], sliding_window, True)
        out = _chunked_dense(query, k, v, mask, scale, sinks, softcap).to(query.dtype)
        return out.transpose(1, 2).contiguous(), None
    # written as [B, Lq, Hq, D], the layout the model's output projection reads (no transposing copy)
    # (a fixed-capacity layer bounds the walk by its capacity: one kernel plan for every step, no length read)
    b, hq, lq, d = query.shape
    if out is None:
        out = query.new_empty(b, lq, hq, d)
    view = out.transpose(1, 2)
    # several queries over unpadded rows: no kv_start, and the common length, for the dense route (ops); under
    # torch.compile the length lives on the device and the op reads it when it runs (ops.LENGTH_AT_RUN)
    unpadded = lq > 1 and not layer.padded
    length = (ops.LENGTH_AT_RUN if torch.compiler.is_compiling() else layer.length) if unpadded else None
    result = ops.paged_attention(
        query, layer.pool, layer.layout, layer.block_table, layer.seq_lens, scale, out=view,
        kv_start=None if unpadded else layer.kv_start, sliding_window=sliding_window, sinks=sinks, softcap=softcap,
        max_seq_len=layer.length if layer.max_cache_len is None else layer.max_cache_len, key_offset=layer.key_offset,
        **_exact_overlays(layer, window), **_decode_workspace(layer, query), length=length,
        held=layer.launches if lq == 1 else None,  # a decode step: the layer's plans, held across steps
    )
    return (out if result is view else result.transpose(1, 2)), None  # (traced: the op's new tensor)


def _held_decode(layer, query: torch.Tensor, view: torch.Tensor, scale: float, sliding_window: int | None,
                 sinks: torch.Tensor | None, softcap: float | None) -> bool:
    """A settled layer's one-token step through the launch the layer holds (ops.paged_attention_held), with the
    arguments the general call below passes for such a step; False when the held launch does not serve it."""
    prefix, ring = layer.prefix_keys is not None, layer.recent_keys is not None
    return ops.paged_attention_held(
        query, view, layer.launches, layer.pool, layer.layout, layer.block_table, layer.seq_lens, scale,
        layer.kv_start, sliding_window, sinks, softcap,
        layer.length if layer.max_cache_len is None else layer.max_cache_len, layer.key_offset,
        layer.prefix_keys, layer.prefix_values if prefix else None, layer.recent_keys,
        layer.recent_values if ring else None, layer.recent_from if ring else 0, layer.decode_workspace,
    )


def _is_cross_attention(module: torch.nn.Module) -> bool:
    """module.is_cross_attention, False when unset, without nn.Module.__getattr__'s miss (an exception, ~1 us per
    decode step and layer: models that never cross-attend do not set it); the class's answer is remembered (its
    lookup walks the class hierarchy, ~0.8 us per decode layer step when nothing defines it)."""
    flag = module.__dict__.get("is_cross_attention")
    if flag is not None:
        return bool(flag)
    cls = type(module)
    if torch.compiler.is_compiling():  # folds to a constant; writing the memo here would recompile the next step
        return bool(getattr(cls, "is_cross_attention", False))
    known = _CROSS_ATTENTION_CLASSES.get(cls)
    if known is None:
        known = _CROSS_ATTENTION_CLASSES[cls] = bool(getattr(cls, "is_cross_attention", False))
    return known


_CROSS_ATTENTION_CLASSES: dict[type, bool] = {}  # attention module class -> its is_cross_attention


def _settle_prefill(step: LayerStep, attention_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, scale: float, sliding_window: int | None, sinks: torch.Tensor | None,
                    softcap: float | None) -> bool:
    """What a prefill-like forward settles from its mask and exact K/V: the rows' padding, the centering means,
    the exact prefix, the per-layer check, the decode scratch. True when the layer went dense."""
    _refresh_padding(step, attention_mask, query.shape[0], sliding_window)
    step.layer.recenter(key, value, step.start, step.window)
    step.layer.fill_prefix(key, value, step.start)
    if _keep_dense_if_sensitive(step, query, key, value, scale, softcap):
        return True
    _reserve_decode_workspace(step.layer, query, scale, sliding_window, sinks, softcap)
    return False


def _keep_dense_if_sensitive(step: LayerStep, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             scale: float, softcap: float | None) -> bool:
    """The first prefill's per-layer check (TurboQuantConfig.dense_layer_kl): a layer whose attention moves
    too far under quantized keys takes FP8 keys where they keep it close (sensitive_layer_keys), else keeps its
    K/V dense from now on. True when it went dense. One or two host reads, at prefill."""
    layer = step.layer
    config = layer.layout.config
    threshold = config.dense_layer_kl
    if threshold is None or step.start != 0 or torch.compiler.is_compiling():
        return False
    if key_quantization_kl(query, key, config, scale, layer.key_offset, layer.kv_start, softcap) <= threshold:
        return False
    fallback = config.fp8_key_fallback()
    if fallback is not None and key_quantization_kl(query, key, fallback, scale, layer.key_offset, layer.kv_start,
                                                    softcap) <= threshold * FP8_KEYS_KL_SHARE:
        layer.use_config(fallback, key, value)
        return False
    layer.keep_dense(key, value)
    return True


def _reserve_decode_workspace(layer, query: torch.Tensor, scale: float, sliding_window: int | None,
                              sinks: torch.Tensor | None, softcap: float | None) -> None:
    """A fixed-capacity layer's split scratch for its decode steps, sized at the prefill: a captured step then
    allocates nothing. Kept across batches of one size (a static address); a batch of another size starts without
    one (TurboQuantLayer._drop_buffers). A prefill inside a compiled region (a manual compiled loop's; generate()
    runs it uncompiled) reserves it behind a graph break while the layer has none: else the first captured step
    would allocate the shared scratch in the graph's private pool (cudagraph trees then fail: "tensor(s) in the
    cudagraph pool not tracked as outputs")."""
    if layer.max_cache_len is None:
        return
    if torch.compiler.is_compiling():
        if layer.decode_workspace is None:
            _reserve_decode_workspace_eagerly(layer, query, scale, sliding_window, sinks, softcap)
        return
    need = ops.decode_workspace_numel(query, layer.pool, layer.layout, layer.block_table, layer.seq_lens, scale,
                                      kv_start=layer.kv_start, sliding_window=sliding_window, sinks=sinks,
                                      softcap=softcap, max_seq_len=layer.max_cache_len, key_offset=layer.key_offset,
                                      **_exact_overlays(layer))
    have = layer.decode_workspace
    if need and (have is None or have.numel() < need):
        layer.decode_workspace = torch.empty(need, dtype=torch.float32, device=query.device)
        torch._dynamo.mark_static_address(layer.decode_workspace)


@torch.compiler.disable
def _reserve_decode_workspace_eagerly(layer, query: torch.Tensor, scale: float, sliding_window: int | None,
                                      sinks: torch.Tensor | None, softcap: float | None) -> None:
    _reserve_decode_workspace(layer, query, scale, sliding_window, sinks, softcap)


def _decode_workspace(layer, query: torch.Tensor) -> dict:
    """The layer's own split scratch for a one-token step, when it has one."""
    if query.shape[2] != 1 or getattr(layer, "decode_workspace", None) is None:
        return {}
    return {"workspace": layer.decode_workspace}


def _check_query(query: torch.Tensor, layer) -> None:
    """Clear errors before the kernel sees a query that cannot go with this layer's pool."""
    rows, kv_heads, head_dim = layer.rows, layer.layout.num_kv_heads, layer.layout.head_dim
    shape = query.shape
    if len(shape) != 4 or shape[0] != rows or shape[3] != head_dim or shape[1] % kv_heads:
        raise ValueError(
            f"query must be [batch {rows}, a multiple of {kv_heads} query heads, tokens, head_dim {head_dim}] "
            f"to attend over this TurboQuantCache layer, got {list(query.shape)}"
        )
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"query has dtype {query.dtype}; supported: {', '.join(map(str, SUPPORTED_DTYPES))}")
    pool = layer.pool  # (CUDA devices compared by index: a torch.device per step costs ~0.5 us)
    same = query.get_device() == pool.get_device() if query.is_cuda and pool.is_cuda else query.device == pool.device
    if not same:
        raise ValueError(f"query is on {query.device} but the TurboQuantCache layer is on {layer.pool.device}")


def _exact_overlays(layer, window: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """The exact-token side buffers of a layer (exact_prefix_tokens, recent_window) as kernel kwargs; `window`:
    a multi-token forward's own ring (LayerStep.window), which stands in for the layer's ring."""
    extra = {}
    if layer.prefix_keys is not None:
        extra.update(prefix_keys=layer.prefix_keys, prefix_values=layer.prefix_values)
    if window is not None:
        extra.update(recent_keys=window[0], recent_values=window[1], recent_from=layer.recent_from)
    elif layer.recent_keys is not None:
        extra.update(recent_keys=layer.recent_keys, recent_values=layer.recent_values, recent_from=layer.recent_from)
    return extra


def dense_attention_forward(module, query, key, value, attention_mask, dropout, scale, sliding_window, softcap,
                            sinks, is_causal, **kwargs) -> tuple[torch.Tensor, None]:
    """HF semantics over dense K/V: sdpa when it can, eager-equivalent fp32 math for softcap/sinks."""
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[-1] > key.shape[2]:
        attention_mask = attention_mask[..., : key.shape[2]]  # a fixed-capacity cache's mask: columns past the keys
    if softcap is None and sinks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scale,
                                      is_causal=is_causal, **kwargs)
    if dropout and module.training:
        raise ValueError("attn_implementation='turboquant' does not support attention dropout together with "
                         "softcapping or attention sinks; use attn_implementation='eager' for training")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = _bool_mask(attention_mask, query, key.shape[2], sliding_window, causal)
    out = _chunked_dense(query, key, value, mask, scale, sinks, softcap)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _bool_mask(attention_mask: torch.Tensor | None, query: torch.Tensor, num_keys: int,
               sliding_window: int | None, causal: bool) -> torch.Tensor:
    """HF's 4-D mask (bool or additive float; None = plain causal) as [B, Lq, S] bool."""
    b, _, lq, _ = query.shape
    if attention_mask is None:
        if not causal:
            return torch.ones(b, lq, num_keys, dtype=torch.bool, device=query.device)
        lens = torch.full((b,), num_keys, device=query.device)
        return reference.attention_mask(lq, num_keys, lens, sliding_window=sliding_window)
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        raise ValueError(f"expected a [batch, 1, queries, keys] attention mask, got {list(attention_mask.shape)}")
    mask = attention_mask[:, 0, :, :num_keys]
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask.to(query.device).expand(b, lq, num_keys)


def _chunked_dense(query, key, value, mask, scale, sinks, softcap) -> torch.Tensor:
    """reference.dense_attention over query chunks, so the fp32 scores stay within DENSE_SCORE_BUDGET."""
    b, hq, lq, _ = query.shape
    chunk = max(1, DENSE_SCORE_BUDGET // max(1, b * hq * key.shape[2]))
    parts = [
        reference.dense_attention(query[:, :, i : i + chunk], key, value, mask[:, i : i + chunk], scale, sinks, softcap)
        for i in range(0, lq, chunk)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, 2)


def _refresh_padding(step: LayerStep, attention_mask: torch.Tensor | None, rows: int,
                     sliding_window: int | None) -> None:
    """Derive each row's first real position from this prefill-like forward's mask (on device).

    The one host read here (is the padding a prefix of every row?) happens on prefill only.
    """
    real = None if attention_mask is None else getattr(attention_mask, PADDING_ATTRIBUTE, None)
    if attention_mask is None or real is NO_PADDING:  # HF skips the mask only when nothing is padded
        step.layer.set_padding(None, contiguous=True, max_start=0)
        return
    if real is None:  # mask built elsewhere (or moved across devices): columns anybody may see
        m = attention_mask if attention_mask.dtype == torch.bool else attention_mask > torch.finfo(attention_mask.dtype).min / 2
        real = _visible_columns(m.any(1).any(1), step.start, sliding_window)
    real = real.bool().expand(rows, -1)[:, : step.layer.length]  # (a fixed-capacity mask spans the capacity)
    steps = real.to(torch.int8).diff(dim=-1)
    leading_pads = (~real).int().cumprod(-1).sum(-1)
    # one host read: is the padding a prefix of every row (0...0 1...1), and the largest prefix
    contiguous, max_start = torch.stack([(steps >= 0).all().int(), leading_pads.max()]).tolist()
    step.layer.set_padding(leading_pads, bool(contiguous), max_start)


def _visible_columns(seen: torch.Tensor, start: int, sliding_window: int | None) -> torch.Tensor:
    """[B, S] columns some query of this forward may see -> the columns that are not left padding.

    On a sliding-window layer the keys older than the first query's window (positions before
    start - W + 1) are unseen whether or not they are padding; they count as padding only when the
    unseen prefix reaches into that window (padding is a prefix of the row).
    """
    window_first = start - sliding_window + 1 if sliding_window is not None else 0
    if window_first <= 0:
        return seen
    leading = (~seen).int().cumprod(-1).sum(-1, keepdim=True)
    cols = torch.arange(seen.shape[-1], device=seen.device)
    return seen | ((cols < window_first) & (leading <= window_first))


def turboquant_mask(*args, **kwargs) -> torch.Tensor | None:
    """HF's sdpa mask; never host-synced at decode; carries the 2-D padding mask it was built from."""
    if kwargs.get("q_length") == 1 and not args:
        mask = _one_query_padding_mask(kwargs)
        if mask is not SDPA_MASK:
            return mask
        kwargs["allow_is_causal_skip"] = False
    mask = sdpa_mask(*args, **kwargs)
    padding = kwargs.get("attention_mask")
    if mask is not None and padding is None:  # called without a 2-D mask: nothing is padded
        setattr(mask, PADDING_ATTRIBUTE, NO_PADDING)
    elif mask is not None and padding.dim() == 2:
        setattr(mask, PADDING_ATTRIBUTE, padding)
    return mask


def _one_query_padding_mask(kwargs: dict) -> torch.Tensor | None | str:
    """A one-query forward's sdpa mask where it is the padding alone: a plain causal mask (no window, chunk, packed
    sequence or custom mask: HF then gives another mask_function or disallows the skip) whose query is at the last
    key (host ints). Without a 2-D mask that is None, as sdpa_mask gives (no host read); with one, a 4-D view of it,
    which sdpa_mask would build from aranges and comparisons at every decode step (~50 us of host time per forward).
    SDPA_MASK where sdpa_mask must build it."""
    padding, kv_length, kv_offset = kwargs.get("attention_mask"), kwargs.get("kv_length"), kwargs.get("kv_offset", 0)
    q_offset = kwargs.get("q_offset")
    if (kwargs.get("local_size") is not None or kwargs.get("use_vmap") or not kwargs.get("allow_is_causal_skip", True)
            or kwargs.get("mask_function", causal_mask_function) is not causal_mask_function
            or type(kv_length) is not int or type(kv_offset) is not int or type(q_offset) is not int
            or q_offset != kv_offset + kv_length - 1):
        return SDPA_MASK
    if padding is None:
        return None
    if padding.dim() != 2 or padding.shape[-1] != kv_offset + kv_length or padding.shape[0] != kwargs.get("batch_size"):
        return SDPA_MASK
    mask = padding[:, None, None, kv_offset:] if padding.dtype == torch.bool else padding[:, None, None, kv_offset:] != 0
    mask = mask.to(kwargs.get("device", mask.device))
    setattr(mask, PADDING_ATTRIBUTE, padding)
    return mask


SDPA_MASK = "sdpa_mask"  # _one_query_padding_mask's answer where sdpa_mask must build the mask


def register() -> None:
    """Make attn_implementation="turboquant" available to every transformers model."""
    ALL_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, turboquant_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, turboquant_mask)
