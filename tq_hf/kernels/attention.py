"""unified_attention: paged attention over the compressed cache (prefill, chunked prefill, decode), one launcher.

A call's argument kinds decide its plan (plan_attention: inputs validated, kernel and launch choices made
once, then cached); each call then builds the runtime arguments and launches the plan's kernel (unified.py,
or decode_warps.py's one-warp kernel for large plain 4-bit decode) and, in split decode, the reduction
(reduce.py). The device's traits (device.py) and the caller's LaunchConfig overrides are part of the plan's key.
"""

from __future__ import annotations

import torch

from ..layout import BlockLayout
from .checks import check_attention_inputs, check_key_offset, check_prefix, check_recent
from .codec_tensors import codec_tensors, next_pow2, value_rotation_tensor
from .device import DeviceTraits, device_traits as _traits_of
from .fast_launch import PlanCache, argument_key, device_of, value_key
from .launch import launch_fitting
from .launch_config import DEFAULT as _NO_OVERRIDES, LaunchConfig
from .plan import AttentionPlan
from .unified_plan import plan_unified
from .warp_plan import plan_warps, wanted as warps_wanted
from .workspace import split_partials

_PLANS = PlanCache()


def unified_attention(
    query: torch.Tensor,
    pool: torch.Tensor,
    layout: BlockLayout,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_start: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    workspace: torch.Tensor | None = None,
    launch: LaunchConfig | None = None,
    key_offset: torch.Tensor | None = None,
    prefix_keys: torch.Tensor | None = None,
    prefix_values: torch.Tensor | None = None,
    recent_keys: torch.Tensor | None = None,
    recent_values: torch.Tensor | None = None,
    recent_from: int = 0,
    device_traits: DeviceTraits | None = None,
) -> torch.Tensor:
    """Attention of query [B, Hq, Lq, D] over the compressed pool (see reference.paged_attention).

    key_offset: the key_centering mean the keys were stored with (keys read as k_hat + mu), [Hk, D]
    shared or [B, Hk, D] per row;
    value_rotation comes from the layout's config (the output is rotated back once per row).
    prefix_keys/prefix_values: [B, Hk, P, D] exact original keys/values (exact_prefix_tokens) read
    instead of the pool at positions kv_start[b] + s, s < P (reference.overlay_prefix).
    recent_keys/recent_values: [B, Hk, W, D] ring of exact recent keys/values (recent_window),
    position j at slot j % W, read instead of the pool and the prefix for positions
    [max(recent_from, seq_lens[b] - W), seq_lens[b]) (reference.overlay_recent). recent_from is a
    host int (a kernel argument: no sync, captured as is by a CUDA graph).

    max_seq_len: host-side bound on seq_lens; picks the decode kernel and sizes its split count without a device
    sync (default: the block table's capacity). num_splits: override the split-KV heuristic.
    workspace: optional fp32 scratch for split partials (default: a persistent per-device one).
    launch: overrides of the launch heuristics, for benchmarks (launch_config.LaunchConfig).
    device_traits: the device as the heuristics see it (default: the pool's device, device.device_traits).
    Returns `out` (allocated if None) in query's dtype.
    """
    plan = plan_attention(query, pool, layout, block_table, seq_lens, scale, kv_start, sliding_window, sinks, softcap,
                          max_seq_len, out, num_splits, workspace, launch, key_offset, prefix_keys, prefix_values,
                          recent_keys, recent_values, device_traits)
    if type(recent_from) is not int or recent_from < 0:
        raise ValueError(f"recent_from must be an int >= 0 (the first position the ring may serve), got {recent_from!r}")
    if out is None:
        out = torch.empty_like(query)
    args, pout, plse = kernel_arguments(plan, query, pool, block_table, seq_lens, out, workspace, kv_start, sinks,
                                        key_offset, prefix_keys, prefix_values, recent_keys, recent_values, recent_from)
    with device_of(pool):
        if plan.attention is None:
            plan.attention = launch_fitting(plan.kernel, plan.grid, args, plan.constants, plan.block_n, plan.num_stages)
        else:
            plan.attention(*args)
        if plan.split:
            plan.reduce(pout, plse, out, *out.stride()[:3], plan.ns_all)
    return out


def kernel_arguments(plan: AttentionPlan, query, pool, block_table, seq_lens, out, workspace=None, kv_start=None,
                     sinks=None, key_offset=None, prefix_keys=None, prefix_values=None, recent_keys=None,
                     recent_values=None, recent_from: int = 0) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """(the attention kernel's runtime arguments, split partial outputs, split log-sum-exps) of a planned call;
    absent tensors are replaced by device placeholders, so one signature serves every variant."""
    if key_offset is not None:
        key_offset = key_offset.float().contiguous()
    cent = plan.cent
    pout = plse = cent  # placeholders when not splitting
    if plan.split:
        if workspace is None:
            pout, plse = split_partials(pool.device, plan.partial_rows * plan.dp, plan.workspace_numel)
        else:
            pout = workspace[: plan.partial_rows * plan.dp]
            plse = workspace[plan.partial_rows * plan.dp : plan.workspace_numel]
    args = (
        query, *query.stride()[:3], out, *out.stride()[:3],
        pool, block_table, block_table.stride(0), seq_lens,
        kv_start if kv_start is not None else seq_lens,
        sinks if sinks is not None else cent,
        plan.rot, cent, key_offset if key_offset is not None else cent, plan.s_koff, plan.vrot, pout, plse,
        *_buffer_args(prefix_keys, cent), *_buffer_args(prefix_values, cent), plan.prefix_len,
        *_buffer_args(recent_keys, cent), *_buffer_args(recent_values, cent), max(plan.recent_size, 1), recent_from,
        *plan.scalars,
    )
    return args, pout, plse


def _buffer_args(t: torch.Tensor | None, placeholder: torch.Tensor) -> tuple:
    """(pointer, row, head, position strides) of a prefix or ring buffer; a device placeholder when absent."""
    if t is None:
        return placeholder, 0, 0, 0
    return t, t.stride(0), t.stride(1), t.stride(2)


def plan_attention(query, pool, layout, block_table, seq_lens, scale, kv_start=None, sliding_window=None, sinks=None,
                   softcap=None, max_seq_len=None, out=None, num_splits=None, workspace=None,
                   launch: LaunchConfig | None = None, key_offset=None, prefix_keys=None, prefix_values=None,
                   recent_keys=None, recent_values=None, device_traits: DeviceTraits | None = None) -> AttentionPlan:
    """The cached plan for these argument kinds (unified_attention's arguments), made and validated on first sight;
    nothing is launched. max_seq_len only sizes the split count: rounded up to a power of two, one plan serves a
    decode step after step (a split count sized for up to 2x the length)."""
    if launch is not None and type(launch) is not LaunchConfig:
        raise TypeError(f"launch must be a tq_hf.kernels.LaunchConfig or None, got {type(launch).__name__}")
    if device_traits is not None and type(device_traits) is not DeviceTraits:
        raise TypeError(f"device_traits must be a tq_hf.kernels.DeviceTraits or None, got {type(device_traits).__name__}")
    traits = device_traits if device_traits is not None else _traits_of(pool.device)
    if type(max_seq_len) is int and max_seq_len > 0:
        max_seq_len = next_pow2(max_seq_len)
    key = (id(layout), *map(argument_key, (query, pool, block_table, seq_lens, kv_start, sinks, out, key_offset,
                                          prefix_keys, prefix_values, recent_keys, recent_values, workspace)),
           *map(value_key, (scale, sliding_window, softcap, max_seq_len, num_splits)), launch, traits)
    plan = _PLANS.get(key)
    if plan is None or plan.layout is not layout:
        plan = _make_plan(query, pool, layout, block_table, seq_lens, kv_start, sinks, out, key_offset, prefix_keys,
                          prefix_values, recent_keys, recent_values, workspace, scale, sliding_window, softcap,
                          max_seq_len, num_splits, launch if launch is not None else _NO_OVERRIDES, traits)
        _PLANS.put(key, plan)
    return plan


def _make_plan(query, pool, layout, block_table, seq_lens, kv_start, sinks, out, key_offset, prefix_keys,
               prefix_values, recent_keys, recent_values, workspace, scale, sliding_window, softcap, max_seq_len,
               num_splits, launch: LaunchConfig, traits: DeviceTraits) -> AttentionPlan:
    """Validate the inputs, then plan decode_warps' kernel where it is wanted, else the unified kernel."""
    check_attention_inputs(query, pool, layout, block_table, seq_lens, kv_start, sinks, out, scale,
                           sliding_window, softcap)
    key_offset, s_koff = check_key_offset(key_offset, layout, pool.device, rows=query.shape[0])
    b, hq, lq, d = query.shape
    prefix_len = check_prefix(prefix_keys, prefix_values, layout, b, pool.device)
    recent_size = check_recent(recent_keys, recent_values, layout, b, pool.device)
    g = hq // layout.num_kv_heads
    cfg = layout.config
    rot, _, _, cent = codec_tensors(layout, str(pool.device))  # cent: centroids by stored code (the gather's table)
    vrot = value_rotation_tensor(layout, str(pool.device))
    plain = not (prefix_len or recent_size or key_offset is not None or cfg.value_rotation or kv_start is not None
                 or sliding_window is not None or sinks is not None or softcap is not None)
    capacity = block_table.shape[1] * layout.block_size
    kv_len = min(capacity if max_seq_len is None else max_seq_len, capacity)  # the host's bound on a walk
    if warps_wanted(launch, layout, g * lq, b, plain, traits, kv_len):
        return plan_warps(layout, pool, b, g, lq, cent, vrot, workspace, kv_len, num_splits, scale, launch, traits)
    return plan_unified(query, pool, layout, kv_start=kv_start, sinks=sinks, key_offset=key_offset, s_koff=s_koff,
                        prefix_len=prefix_len, recent_size=recent_size,
                        exact_buffers=(prefix_keys, prefix_values, recent_keys, recent_values), workspace=workspace,
                        scale=scale, sliding_window=sliding_window, softcap=softcap, kv_len=kv_len,
                        num_splits=num_splits, rot=rot, cent=cent, vrot=vrot, launch=launch, traits=traits)
