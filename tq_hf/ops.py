"""Where each operation runs: Triton kernels for CUDA tensors, reference.py otherwise.

The kernels and the reference share one signature per operation, so callers (the cache, the
attention function) never branch on the device themselves.

Under torch.compile the same operations are the custom ops `tq_hf::store` (mutates the pool, and
the recent ring and row lengths when given) and `tq_hf::paged_attention` (returns a new tensor),
with fake implementations, so dynamo traces a decode step as one graph and CUDA graphs capture it;
`tq_hf::chunk_attention` takes a forward of many queries, reading the rows' length when it runs.
Eager calls skip the custom-op dispatcher (tens of microseconds per call at B=1) and run the
implementation directly. custom_op rather than triton_op: the launchers replay compiled kernels
without Triton's per-call Python (kernels/fast_launch.py), which inductor could not trace anyway;
opaque ops keep that and still let CUDA graphs capture the launches. A custom op cannot take a BlockLayout: layouts are registered once and
passed by index (`layout_index`).
"""

from __future__ import annotations

import os

import torch

from . import reference
from .layout import BlockLayout

_LAYOUTS: list[BlockLayout] = []  # index -> layout; kept alive so the kernels' plan caches keyed by id stay valid
_LAYOUT_INDEX: dict[BlockLayout, int] = {}


def use_kernels(t: torch.Tensor) -> bool:
    """Kernels on CUDA tensors, unless TQ_HF_FORCE_REFERENCE=1 (for A/B checks)."""
    return t.is_cuda and os.environ.get("TQ_HF_FORCE_REFERENCE", "0") != "1"


def layout_index(layout: BlockLayout) -> int:
    """The registered index of `layout` (registered on first sight): how the custom ops name a layout."""
    index = _LAYOUT_INDEX.get(layout)
    if index is None:
        index = _LAYOUT_INDEX[layout] = len(_LAYOUTS)
        _LAYOUTS.append(layout)
    return index


def _kernels():
    """tq_hf.kernels, imported on first use (Triton is needed only where the kernels run); an import statement in
    the launch path would cost ~1.5 us per call."""
    global _KERNELS
    if _KERNELS is None:
        from . import kernels

        _KERNELS = kernels
    return _KERNELS


_KERNELS = None
# paged_attention(length=LENGTH_AT_RUN) under torch.compile: the rows hold one common length (no padding), which
# lives on the device; a forward big enough for the dense route reads it when it runs (tq_hf::chunk_attention)
LENGTH_AT_RUN = "at run"
CHUNK_MIN_QUERIES = 64  # fewer (a verification forward) keep the op CUDA graphs capture, and the unified kernel


class HeldLaunches:
    """What one caller's kernel launches keep from call to call (a cache layer's decode steps): the store's and the
    attention's plans and lasting arguments (kernels' HeldStore and HeldAttention), reused while the next call names
    the same tensors and settings. The reference path ignores it; drop() lets go of the tensors held."""

    __slots__ = ("store", "attention", "kernels")

    def __init__(self):
        self.drop()

    def drop(self) -> None:
        self.store = self.attention = None
        self.kernels = None  # use_kernels' answer for this caller, asked once (an environment read costs ~1 us)

    def __deepcopy__(self, memo) -> "HeldLaunches":
        return HeldLaunches()  # a copied cache has other tensors: nothing held applies to it (nor copies a kernel)

    def __reduce__(self):
        return HeldLaunches, ()


def _use_kernels_held(t: torch.Tensor, held: HeldLaunches | None) -> bool:
    """use_kernels(t), remembered by the caller's HeldLaunches (a repeated call asks it once)."""
    if held is None:
        return use_kernels(t)
    if held.kernels is None:
        held.kernels = use_kernels(t)
    return held.kernels


def store(pool: torch.Tensor, layout: BlockLayout, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
          held: HeldLaunches | None = None, **kwargs) -> None:
    """Quantize key/value [N, H, D] (or a decode step's [R, H, 1, D]) into slots [N] of pool (negative slots
    skipped); see reference.store. held: the caller's HeldLaunches, for a repeated call (eager kernel launches only)."""
    if torch.compiler.is_compiling():
        recent = kwargs.get("recent") or (None, None)
        if kwargs.get("slot_shift"):  # (compiled steps compute their slots whole; the op takes no shift)
            slots = torch.where(slots >= 0, slots + kwargs["slot_shift"], slots)
        torch.ops.tq_hf.store(pool, layout_index(layout), key, value, slots, kwargs.get("key_offset"), *recent,
                              kwargs.get("start", 0), kwargs.get("seq_lens"), kwargs.get("positions"))
    elif _use_kernels_held(pool, held):
        kernels = _kernels()
        if held is not None:
            if held.store is None:
                held.store = kernels.HeldStore()
            kwargs["held"] = held.store
        kernels.store_kv(pool, layout, key, value, slots, **kwargs)
    else:
        reference.store(pool, layout, key, value, slots, **kwargs)


def store_held(held: HeldLaunches, pool: torch.Tensor, layout: BlockLayout, key: torch.Tensor, value: torch.Tensor,
               slots: torch.Tensor, key_offset, recent_keys, recent_values, seq_lens, start: int,
               slot_shift: int) -> bool:
    """store(pool, layout, key, value, slots, held=held, ...) with these arguments (no ring: recent_keys None) when
    the caller's held store serves them (a cache layer's settled one-token step, eager): True once launched, else
    False and nothing done (call store). It skips the general path's keyword plumbing (docs/performance.md)."""
    held_store = held.store  # (set only where the kernels run, outside compiled regions)
    if held_store is None or torch.compiler.is_compiling():
        return False
    signature = _kernels().store_signature(pool, layout, slots, key_offset, recent_keys, recent_values, seq_lens)
    if not held_store.serves(signature, key, value):
        return False
    held_store.launch(key, value, start, slot_shift)
    return True


def paged_attention(query: torch.Tensor, pool: torch.Tensor, layout: BlockLayout, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                    held: HeldLaunches | None = None, **kwargs) -> torch.Tensor:
    """Attention of query [B, Hq, Lq, D] over the pool; see reference.paged_attention. out: a buffer of
    query's shape and dtype (any strides, last dimension contiguous) the result goes into; returned.
    Under torch.compile the result is a new tensor (`out` is then not written): use the return value.
    held: the caller's HeldLaunches, for a repeated call (eager kernel launches only).
    length: every row's length (a host int) when the rows hold the same count and no padding (kv_start None): a
    forward of many queries may then attend through a dense copy of the history (kernels.dense_history_serves).
    Under torch.compile LENGTH_AT_RUN says the same of a length on the device (seq_lens)."""
    if torch.compiler.is_compiling():
        args = (query, pool, layout_index(layout), block_table, seq_lens, float(scale), kwargs.get("kv_start"),
                kwargs.get("sliding_window"), kwargs.get("sinks"), kwargs.get("softcap"), kwargs.get("max_seq_len"),
                kwargs.get("key_offset"), kwargs.get("prefix_keys"), kwargs.get("prefix_values"),
                kwargs.get("recent_keys"), kwargs.get("recent_values"), kwargs.get("recent_from", 0))
        if kwargs.get("length") == LENGTH_AT_RUN and _dense_route_may_pay(query, pool, layout, kwargs):
            return torch.ops.tq_hf.chunk_attention(*args).transpose(1, 2)
        return torch.ops.tq_hf.paged_attention(*args, kwargs.get("workspace")).transpose(1, 2)
    length = kwargs.pop("length", None)
    if _use_kernels_held(pool, held):
        kernels = _kernels()
        if length is not None and kernels.dense_history_serves(query, layout, length, **kwargs):
            try:
                return kernels.dense_history_attention(query, pool, layout, block_table, seq_lens, scale, length,
                                                       out=out, **_exact_kwargs(kwargs))
            except torch.OutOfMemoryError:  # no room for the transient dense copy: the kernel needs none
                pass
        if held is not None:
            if held.attention is None:
                held.attention = kernels.HeldAttention()
            kwargs["held"] = held.attention
        return kernels.unified_attention(query, pool, layout, block_table, seq_lens, scale, out=out, **kwargs)
    kwargs.pop("workspace", None)  # the kernels' split scratch
    result = reference.paged_attention(query, pool, layout, block_table, seq_lens, scale, **kwargs)
    return result if out is None else out.copy_(result)


def paged_attention_held(query: torch.Tensor, out: torch.Tensor, held: HeldLaunches, pool: torch.Tensor,
                         layout: BlockLayout, block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         kv_start, sliding_window, sinks, softcap, max_seq_len, key_offset, prefix_keys, prefix_values,
                         recent_keys, recent_values, recent_from: int, workspace) -> bool:
    """paged_attention(query, ..., out=out, held=held) with these arguments (absent ones None, recent_from 0) when
    the caller's held launch serves them (a cache layer's settled one-token step, eager): True once launched, else
    False and nothing done (call paged_attention). It skips the general path's keyword plumbing through three
    functions, ~5 us of host time per decode layer step (docs/performance.md)."""
    attention = held.attention  # (set only where the kernels run, outside compiled regions)
    if attention is None or torch.compiler.is_compiling():
        return False
    signature = _kernels().held_signature(pool, layout, block_table, seq_lens, kv_start, sinks, key_offset,
                                          prefix_keys, prefix_values, recent_keys, recent_values, workspace,
                                          max_seq_len, scale, sliding_window, softcap)
    if not attention.serves(signature, query, out):
        return False
    attention.launch(query, out, recent_from)
    return True


def gather(pool: torch.Tensor, layout: BlockLayout, block_table: torch.Tensor,
           key_offset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.gather: every slot of every row's blocks dequantized, (K, V) [B, H, NB * T, D] float32; the kernel
    on CUDA. Under torch.compile a custom op: the codebook and rotations built on first use stay out of the trace."""
    if torch.compiler.is_compiling():
        return torch.ops.tq_hf.gather(pool, layout_index(layout), block_table, key_offset)
    if use_kernels(pool):
        return _kernels().dequantize(pool, layout, block_table, key_offset)
    return reference.gather(pool, layout, block_table, key_offset)


def ring_window(ring: torch.Tensor, new: torch.Tensor, start: int,
                key_offset: torch.Tensor | None = None) -> torch.Tensor:
    """reference.ring_window (a forward's exact window from the ring and its new tokens); the kernel on CUDA, one
    launch. key_offset: the key-centering mean int8 key records were taken less of (ignored for an exact ring, which holds
    the keys themselves). Traced, the torch ops (dynamo sees through them)."""
    offset = key_offset if ring.dtype == torch.int8 else None
    if use_kernels(new) and not torch.compiler.is_compiling():
        return _kernels().ring_window(ring, new, start, offset)
    return reference.ring_window(ring, new, start, offset)


# ---- the custom ops (what torch.compile sees) ----------------------------------------------------
@torch.library.custom_op("tq_hf::store", mutates_args=("pool", "recent_keys", "recent_values", "seq_lens"))
def _store_op(pool: torch.Tensor, layout: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
              key_offset: torch.Tensor | None, recent_keys: torch.Tensor | None, recent_values: torch.Tensor | None,
              start: int, seq_lens: torch.Tensor | None, positions: torch.Tensor | None = None) -> None:
    recent = None if recent_keys is None else (recent_keys, recent_values)
    store(pool, _LAYOUTS[layout], key, value, slots, key_offset=key_offset, recent=recent, start=start,
           seq_lens=seq_lens, positions=positions)


@_store_op.register_fake
def _(pool, layout, key, value, slots, key_offset, recent_keys, recent_values, start, seq_lens, positions=None) -> None:
    return None


# `workspace` is scratch the op writes before it reads it: not declared mutated (nothing outside reads it)
@torch.library.custom_op("tq_hf::paged_attention", mutates_args=())
def _paged_attention_op(query: torch.Tensor, pool: torch.Tensor, layout: int, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, kv_start: torch.Tensor | None, sliding_window: int | None,
                        sinks: torch.Tensor | None, softcap: float | None, max_seq_len: int | None,
                        key_offset: torch.Tensor | None, prefix_keys: torch.Tensor | None,
                        prefix_values: torch.Tensor | None, recent_keys: torch.Tensor | None,
                        recent_values: torch.Tensor | None, recent_from: int,
                        workspace: torch.Tensor | None = None) -> torch.Tensor:
    """Returns [B, Lq, Hq, D] (the layout a model's output projection reads; the caller transposes)."""
    return _attention_op(query, pool, layout, block_table, seq_lens, scale, recent_from, workspace, None, locals())


@_paged_attention_op.register_fake
def _(query, pool, layout, block_table, seq_lens, scale, kv_start, sliding_window, sinks, softcap, max_seq_len,
      key_offset, prefix_keys, prefix_values, recent_keys, recent_values, recent_from, workspace=None) -> torch.Tensor:
    return _query_major(query)


# a host read of the rows' length: CUDA graphs cannot capture it, so inductor leaves a graph holding it uncaptured
@torch.library.custom_op("tq_hf::chunk_attention", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _chunk_attention_op(query: torch.Tensor, pool: torch.Tensor, layout: int, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, kv_start: torch.Tensor | None, sliding_window: int | None,
                        sinks: torch.Tensor | None, softcap: float | None, max_seq_len: int | None,
                        key_offset: torch.Tensor | None, prefix_keys: torch.Tensor | None,
                        prefix_values: torch.Tensor | None, recent_keys: torch.Tensor | None,
                        recent_values: torch.Tensor | None, recent_from: int) -> torch.Tensor:
    """paged_attention's op for a compiled forward of many queries over unpadded rows (a prefill chunk, a chat's
    next turn): it reads the rows' common length from seq_lens when it runs, so the forward may attend through
    a dense copy of the history as an eager one does (kernels.dense_history_serves), where the unified kernel
    re-decodes the history once per tile of queries. Returns [B, Lq, Hq, D]."""
    capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()  # (a capture by hand: no host read)
    length = None if capturing else int(seq_lens[0])
    return _attention_op(query, pool, layout, block_table, seq_lens, scale, recent_from, None, length, locals())


@_chunk_attention_op.register_fake
def _(query, pool, layout, block_table, seq_lens, scale, kv_start, sliding_window, sinks, softcap, max_seq_len,
      key_offset, prefix_keys, prefix_values, recent_keys, recent_values, recent_from) -> torch.Tensor:
    return _query_major(query)


_OP_KEYWORDS = ("kv_start", "sliding_window", "sinks", "softcap", "max_seq_len", "key_offset", "prefix_keys",
                "prefix_values", "recent_keys", "recent_values")  # the attention ops' arguments paged_attention names


def _attention_op(query: torch.Tensor, pool: torch.Tensor, layout: int, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float, recent_from: int, workspace: torch.Tensor | None,
                  length: int | None, arguments: dict) -> torch.Tensor:
    """The attention ops' body: paged_attention into a new [B, Lq, Hq, D]; `arguments`: the op's own (locals()).

    Without the caller's scratch (a forward of several tokens, or a layer that keeps none) the unified kernel's
    split partials go in scratch of this call, not the shared persistent buffer: one made here under cudagraph trees
    would land in the graph's pool and outlive the call, untracked (they refuse that: "tensor(s) in the cudagraph
    pool not tracked")."""
    out = _query_major(query)
    spec = _LAYOUTS[layout]
    kwargs = {name: arguments[name] for name in _OP_KEYWORDS}
    dense = length is not None and use_kernels(pool) and _kernels().dense_history_serves(query, spec, length, **kwargs)
    if workspace is None and not dense:
        numel = workspace_numel(query, pool, spec, block_table, seq_lens, scale, **kwargs)
        workspace = query.new_empty(numel, dtype=torch.float32) if numel else None
    scratch = {} if workspace is None else {"workspace": workspace}
    paged_attention(query, pool, spec, block_table, seq_lens, scale, out=out.transpose(1, 2), recent_from=recent_from,
                    length=length if dense else None, **kwargs, **scratch)
    return out


def _dense_route_may_pay(query: torch.Tensor, pool: torch.Tensor, layout: BlockLayout, kwargs: dict) -> bool:
    """Whether a compiled forward of many queries over unpadded rows takes tq_hf::chunk_attention: on the kernels,
    from CHUNK_MIN_QUERIES queries, without the features the dense route lacks (sliding window, sinks, softcap),
    where it would pay over the whole capacity (decided at trace time from shapes; the op decides for the length it
    reads)."""
    bound = kwargs.get("max_seq_len")
    lacking = any(kwargs.get(name) is not None for name in ("sliding_window", "sinks", "softcap"))
    return (pool.is_cuda and query.shape[2] >= CHUNK_MIN_QUERIES and bound is not None and not lacking
            and _kernels().prefers_dense_route(query, layout, bound))


@torch.library.custom_op("tq_hf::gather", mutates_args=())
def _gather_op(pool: torch.Tensor, layout: int, block_table: torch.Tensor,
               key_offset: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return gather(pool, _LAYOUTS[layout], block_table, key_offset)


@_gather_op.register_fake
def _(pool, layout, block_table, key_offset) -> tuple[torch.Tensor, torch.Tensor]:
    spec = _LAYOUTS[layout]
    shape = (block_table.shape[0], spec.num_kv_heads, block_table.shape[1] * spec.block_size, spec.head_dim)
    return pool.new_empty(shape, dtype=torch.float32), pool.new_empty(shape, dtype=torch.float32)


def workspace_numel(query: torch.Tensor, pool: torch.Tensor, layout: BlockLayout, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, **kwargs) -> int:
    """fp32 elements of split-KV scratch that paged_attention of `query` needs on the kernels (0: none)."""
    if not use_kernels(pool):
        return 0
    from .kernels import plan_attention

    kwargs.pop("recent_from", None)  # a kernel argument, not a plan input
    plan = plan_attention(query, pool, layout, block_table, seq_lens, scale, **kwargs)
    return plan.workspace_numel if plan.split else 0


def decode_workspace_numel(query: torch.Tensor, pool: torch.Tensor, layout: BlockLayout, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, **kwargs) -> int:
    """fp32 elements of split-KV scratch that one-token decode steps of `query`'s rows and heads need (0: none).

    A fixed-capacity layer owns such a buffer, made eagerly: a captured decode step must not allocate it (an
    allocation inside CUDA-graph capture lands in the graph's private pool), nor share the global buffer that a
    later, larger plan would replace under an earlier graph."""
    return workspace_numel(query[:, :, -1:], pool, layout, block_table, seq_lens, scale, **kwargs)


def _exact_kwargs(kwargs: dict) -> dict:
    """The key_offset and exact-token buffers of a paged_attention call (what the dense route takes besides)."""
    names = ("key_offset", "prefix_keys", "prefix_values", "recent_keys", "recent_values", "recent_from")
    return {name: kwargs[name] for name in names if name in kwargs}


def _query_major(query: torch.Tensor) -> torch.Tensor:
    """An empty [B, Lq, Hq, D] for query [B, Hq, Lq, D]."""
    b, h, lq, d = query.shape
    return query.new_empty(b, lq, h, d)
