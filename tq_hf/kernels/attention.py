"""unified_attention: paged attention over the compressed cache (prefill, chunked prefill, decode), one launcher.

A call's argument kinds decide its plan (plan_attention: inputs validated, kernel and launch choices made
once, then cached); each call then builds the runtime arguments and launches the plan's kernel (unified.py,
or decode_warps.py's one-warp kernel for large plain 4-bit decode) and, in split decode, the reduction
(reduce.py). The device's traits (device.py) and the caller's LaunchConfig overrides are part of the plan's key.

A caller that repeats one call with new queries (a cache layer's decode steps) passes a HeldAttention: the plan and
the arguments that do not change are then kept from call to call, and a call only checks that it names the same
tensors and settings (see HeldAttention).
"""

from __future__ import annotations

import torch

from ..layout import BlockLayout
from .checks import check_attention_inputs, check_key_offset, check_prefix, check_recent
from .codec_tensors import codec_tensors, next_pow2, value_rotation_tensor
from .device import DeviceTraits, device_traits as _traits_of
from .fast_launch import PlanCache, addresses, argument_key, device_of, holdable_offset, value_key
from .launch import launch_fitting
from .launch_config import DEFAULT as _NO_OVERRIDES, LaunchConfig
from .plan import AttentionPlan
from .unified_plan import plan_unified
from .warp_plan import plan_warps, wanted as warps_wanted
from . import workspace as _workspace
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
    held: "HeldAttention | None" = None,
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
    held: the caller's HeldAttention (with `out` given): reused when this call matches the one it holds, else
    refilled with this call.
    Returns `out` (allocated if None) in query's dtype.
    """
    signature = None
    if held is not None and out is not None:
        signature = held_signature(pool, layout, block_table, seq_lens, kv_start, sinks, key_offset, prefix_keys,
                                   prefix_values, recent_keys, recent_values, workspace, max_seq_len, scale,
                                   sliding_window, softcap, num_splits, launch, device_traits)
        if held.serves(signature, query, out):
            return held.launch(query, out, recent_from)
    plan = plan_attention(query, pool, layout, block_table, seq_lens, scale, kv_start, sliding_window, sinks, softcap,
                          max_seq_len, out, num_splits, workspace, launch, key_offset, prefix_keys, prefix_values,
                          recent_keys, recent_values, device_traits)
    _check_recent_from(recent_from)
    if out is None:
        out = torch.empty_like(query)
    middle, pout, plse = _lasting_arguments(plan, pool, block_table, seq_lens, workspace, kv_start, sinks, key_offset,
                                            prefix_keys, prefix_values, recent_keys, recent_values)
    args = _call_arguments(query, out, middle, recent_from, plan.scalars)
    with device_of(pool):
        if plan.attention is None:
            plan.attention = launch_fitting(plan.kernel, plan.grid, args, plan.constants, plan.block_n, plan.num_stages)
        else:
            plan.attention(*args)
        if plan.split:
            plan.reduce(pout, plse, out, *out.stride()[:3], plan.ns_all, plan.vrot)
    if signature is not None and holdable_offset(key_offset):
        held.hold(signature, plan, query, out, middle, (pout, plse), (pool, layout, block_table, seq_lens, kv_start,
                                                                    sinks, key_offset, prefix_keys, prefix_values,
                                                                    recent_keys, recent_values, workspace))
    return out


def held_signature(pool, layout, block_table, seq_lens, kv_start, sinks, key_offset, prefix_keys, prefix_values,
                   recent_keys, recent_values, workspace, max_seq_len, scale, sliding_window, softcap,
                   num_splits=None, launch=None, device_traits=None) -> tuple:
    """What a held call must match besides its query and out (unified_attention's arguments but those and
    recent_from): the tensors by identity, the split bound and the settings."""
    traits = device_traits if device_traits is not None else _traits_of(pool.device)
    return (id(pool), id(layout), id(block_table), id(seq_lens), id(kv_start), id(sinks), id(key_offset),
            id(prefix_keys), id(prefix_values), id(recent_keys), id(recent_values), id(workspace),
            _split_bound(max_seq_len), scale, sliding_window, softcap, num_splits, launch, traits)


class HeldAttention:
    """One caller's repeated unified_attention call (a cache layer's decode steps): its plan and the runtime arguments
    that stay, kept while each call names the same tensors (by identity) and settings, with a query and out of the
    kinds the plan was made for (dtype, shape, strides, device, alignment).

    Identity is a sound key because the held tensors are referenced here: no other tensor can take their ids while
    they are held. It assumes what the cache's tensors obey: a tensor keeps its shape, strides and storage (the cache
    replaces a buffer rather than resizing it in place). A call with anything else plans through unified_attention's
    plan cache, validating what is new, and is held instead. What a held call saves: the plan key over every argument
    and the argument tuple (docs/performance.md has the host time).
    """

    __slots__ = ("_signature", "_query_kind", "_out_kind", "_tensors", "_plan", "_middle", "_partials", "_workspaces",
                 "_middle_at", "_reduce_at")

    def __init__(self):
        self._signature = None

    def serves(self, signature: tuple, query: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether a call with this signature, query and out can reuse what is held."""
        return (signature == self._signature and argument_key(query) == self._query_kind
                and argument_key(out) == self._out_kind and _workspace.generation() == self._workspaces)

    def hold(self, signature: tuple, plan: AttentionPlan, query: torch.Tensor, out: torch.Tensor, middle: tuple,
             partials: tuple, tensors: tuple) -> None:
        """Keep a launched call: its plan, lasting kernel arguments and split partials, and the tensors it named."""
        self._signature, self._plan, self._middle, self._partials = signature, plan, middle, partials
        self._query_kind, self._out_kind, self._tensors = argument_key(query), argument_key(out), tensors
        self._workspaces = _workspace.generation()  # the split partials are views of the workspace of now
        # the lasting tensors' addresses for direct launches (the tensors themselves stay referenced above)
        self._middle_at, self._reduce_at = addresses(middle), addresses((*partials, plan.vrot))

    def launch(self, query: torch.Tensor, out: torch.Tensor, recent_from: int) -> torch.Tensor:
        """The held call with a new query, out and recent_from."""
        _check_recent_from(recent_from)
        plan = self._plan
        with device_of(self._tensors[0]):
            site, reduce = plan.attention, plan.reduce
            if site.direct() and (reduce is None or reduce.direct()):  # addresses: no driver lookup per tensor
                o_at = out.data_ptr()
                site.run_direct(*_call_arguments(query, out, self._middle_at, recent_from, plan.scalars,
                                                 query.data_ptr(), o_at))
                if reduce is not None:
                    pout, plse, vrot = self._reduce_at
                    reduce.run_direct(pout, plse, o_at, *out.stride()[:3], plan.ns_all, vrot)
                return out
            self.launch_tensors(query, out, recent_from)
        return out

    def launch_tensors(self, query: torch.Tensor, out: torch.Tensor, recent_from: int) -> None:
        """The held call with every tensor passed as a tensor (Triton's own path, or the direct one converting each;
        eval.launch_overhead times it against launch's addresses)."""
        plan = self._plan
        plan.attention(*_call_arguments(query, out, self._middle, recent_from, plan.scalars))
        if plan.split:
            plan.reduce(*self._partials, out, *out.stride()[:3], plan.ns_all, plan.vrot)


def _check_recent_from(recent_from) -> None:
    if type(recent_from) is not int or recent_from < 0:
        raise ValueError(f"recent_from must be an int >= 0 (the first position the ring may serve), got {recent_from!r}")


def _split_bound(max_seq_len):
    """max_seq_len as plans see it: a positive int rounded up to a power of two (one plan per doubling)."""
    return next_pow2(max_seq_len) if type(max_seq_len) is int and max_seq_len > 0 else max_seq_len


def kernel_arguments(plan: AttentionPlan, query, pool, block_table, seq_lens, out, workspace=None, kv_start=None,
                     sinks=None, key_offset=None, prefix_keys=None, prefix_values=None, recent_keys=None,
                     recent_values=None, recent_from: int = 0) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """(the attention kernel's runtime arguments, split partial outputs, split log-sum-exps) of a planned call;
    absent tensors are replaced by device placeholders, so one signature serves every variant."""
    middle, pout, plse = _lasting_arguments(plan, pool, block_table, seq_lens, workspace, kv_start, sinks, key_offset,
                                            prefix_keys, prefix_values, recent_keys, recent_values)
    return _call_arguments(query, out, middle, recent_from, plan.scalars), pout, plse


def _call_arguments(query, out, middle: tuple, recent_from: int, scalars: tuple, query_at=None, out_at=None) -> tuple:
    """The kernel's arguments: query and out (with their strides) and recent_from around what lasts across calls.
    query_at, out_at: their addresses, passed in their place (a direct launch whose middle holds addresses)."""
    qs, os_ = query.stride(), out.stride()
    return (query if query_at is None else query_at, qs[0], qs[1], qs[2], out if out_at is None else out_at,
            os_[0], os_[1], os_[2], *middle, recent_from, *scalars)


def _lasting_arguments(plan: AttentionPlan, pool, block_table, seq_lens, workspace, kv_start, sinks, key_offset,
                       prefix_keys, prefix_values, recent_keys,
                       recent_values) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """(the kernel arguments between out's strides and recent_from, split partial outputs, split log-sum-exps)."""
    if key_offset is not None:
        key_offset = key_offset.float().contiguous()
    cent = plan.cent
    pout = plse = cent  # placeholders when not splitting
    if plan.split:
        if workspace is None:
            pout, plse = split_partials(pool.device, plan.partial_rows * plan.partial_width, plan.workspace_numel)
        else:
            pout = workspace[: plan.partial_rows * plan.partial_width]
            plse = workspace[plan.partial_rows * plan.partial_width : plan.workspace_numel]
    middle = (
        pool, block_table, block_table.stride(0), seq_lens,
        kv_start if kv_start is not None else seq_lens,
        sinks if sinks is not None else cent,
        plan.rot, cent, key_offset if key_offset is not None else cent, plan.s_koff, plan.vrot, pout, plse,
        *_buffer_args(prefix_keys, cent), *_buffer_args(prefix_values, cent), plan.prefix_len,
        *_buffer_args(recent_keys, cent), *_buffer_args(recent_values, cent), max(plan.recent_size, 1),
    )
    return middle, pout, plse


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
    max_seq_len = _split_bound(max_seq_len)
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
