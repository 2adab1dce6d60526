"""TurboQuantCache: a transformers `Cache` whose layers keep K/V compressed in a paged pool.

Why this shape: every row of an HF batch has the same cache length (left padding included), so
logical block i of row b lives at physical block i * B + b. The block table is then a pure
function of (capacity, B); growing the pool is a prefix copy; beam reorders, batch selection and
repeats are one gather of the pool viewed as [capacity, B, H, plane]; crop only lowers the length.
Nothing on the decode path reads a device value on the host.

Left padding stays in the cache (positions and `get_seq_length` keep HF's meaning) but is never
attended: each row's first real position (`kv_start`) is derived on device from the attention
mask of prefill-like forwards and handed to the kernel.

How the attention function finds the compressed layer: `update()` returns the new tokens' own
key/value tensors with a `LayerStep` attached as an attribute of the key tensor. The reference
lives and dies with that tensor, so no later forward without this cache can pick it up. When the
model runs another attention implementation, `update()` instead returns the dequantized history
as ordinary dense K/V (slow, but correct).

Not every layer is compressed: `full_precision_layers` get a plain DynamicLayer, and sliding-window
layers that `sliding_layers` keeps exact (by default those with windows under 4096 tokens) get
transformers' own window-sized DynamicSlidingWindowLayer, bounded by the window as in DynamicCache.

With `max_cache_len` the cache has a fixed capacity, as StaticCache (its uncompressed layers are then
StaticLayer / StaticSlidingWindowLayer): it is `is_compileable`, so generate() compiles the decode step
(CUDA graphs on CUDA), and under torch.compile a decode step reads its positions from the device
lengths (`seq_lens`) and runs the kernels as the custom ops of ops.py: one graph for every step.
Prefill stays eager, where the padding, the key-centering means and the exact prefix are settled: generate()'s
compiled call runs a forward uncompiled while `settles_on_host` says so (its chunks after that compile whole).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import transformers
from transformers.cache_utils import (Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer, StaticLayer,
                                      StaticSlidingWindowLayer)
from transformers.utils import logging

from . import ops, reference
from .codebook import _ordinary_tensors
from .config import SLIDING_COMPRESS_MIN_WINDOW, TurboQuantConfig
from .layout import BlockLayout, ring_record_bytes
from .support import ATTENTION_NAME, check_supported

logger = logging.get_logger(__name__)
STEP_ATTRIBUTE = "_turboquant_step"  # attribute of the key tensor update() returns
GROWTH_DIVISOR = 64  # grow a pool by >= 1/64 of its capacity: <= 1.6% slack (4bit from 4k tokens: <= 0.30x fp16)
MIN_GROWTH_TOKENS = 64  # ... and by at least this many tokens per row, so small caches do not copy every block
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# DynamicLayer.crop: a positive count kept that many tokens until transformers 5.18, which refuses it
POSITIVE_CROP_RAISES = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 18)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # key/value/query dtypes the kernels take
# chunk_history_tokens=None keeps up to this many (SmolLM2, 8 prompts of 1000 tokens in chunks of 32 or 256: decode KL
# 1.07-1.18x one prefill's for k3v4 and 3bit with 512, 1.21-1.34x with the ring's 128 alone; docs/performance.md)
AUTO_CHUNK_HISTORY_TOKENS = 512
# forwards of up to this many tokens (speculative verification, a chat's next turn) take their store slots from a
# cached table of offsets, as wide as the next power of two (TurboQuantLayer._slots: 2 device ops); longer ones (long
# prefill chunks, rarer per token) compute them (7), where a table would take T x width x 8 bytes
SLOT_TABLE_TOKENS = 1024


def min_growth_blocks(block_size: int) -> int:
    """Blocks of block_size tokens a pool grows by at least (MIN_GROWTH_TOKENS, whole blocks)."""
    return -(-MIN_GROWTH_TOKENS // block_size)


def _compressed_excess(layout: BlockLayout, element_bytes: int, n: int) -> float:
    """Bytes per row and KV head by which a compressed layer of n tokens may exceed a dense layer of the same tokens
    in a dtype of `element_bytes` (negative: it holds less): its pool (whole blocks, plus the growth slack of
    _reserve, at most) and its exact prefix and ring, against 2 * head_dim * element_bytes per token. Falls as n
    grows (every term's slope is below a dense token's)."""
    cfg, t, dim = layout.config, layout.block_size, layout.head_dim
    dense_token = 2 * dim * element_bytes
    ring_token = 2 * ring_record_bytes(dim) if cfg.ring_records else dense_token
    side = cfg.exact_prefix_tokens * dense_token + cfg.recent_window * ring_token
    slack = min_growth_blocks(t) - 1  # blocks past the needed ones a pool may hold (besides capacity / GROWTH_DIVISOR)
    blocks = n / t + 1 + max(slack, n / (t * GROWTH_DIVISOR))
    return blocks * layout.plane_bytes + side - n * dense_token


def break_even_tokens(layout: BlockLayout, element_bytes: int) -> int:
    """The least tokens per row from which a compressed layer never holds more bytes than a dense layer of the same
    tokens in a dtype of `element_bytes` (compress_from_tokens=None; _compressed_excess)."""
    cfg, t = layout.config, layout.block_size
    if layout.plane_bytes * (1 + 1 / GROWTH_DIVISOR) >= t * 2 * layout.head_dim * element_bytes:
        raise ValueError(f"a {cfg.key_bits}/{cfg.value_bits}-bit block of {t} tokens is not smaller than the same "
                         f"tokens at {element_bytes} bytes per element: compressing never saves memory")
    n = 0
    while _compressed_excess(layout, element_bytes, n) > 0:
        n += 1
    return n


def chunk_history_room(layout: BlockLayout, tokens: int, element_bytes: int, history_bytes: int) -> int:
    """Tokens per row of chunk history (chunk_history_tokens=None: at most AUTO_CHUNK_HISTORY_TOKENS) a compressed
    layer of `tokens` tokens per row keeps while it holds no more than a dense layer of those tokens at
    `element_bytes` per element (exact_dtype's): what _compressed_excess leaves, for the history as the layer keeps
    it (history_vector_bytes; `history_bytes`: the model dtype's element size)."""
    vector, fixed = history_vector_bytes(layout, history_bytes)
    room = (-_compressed_excess(layout, element_bytes, tokens) - fixed) // (2 * vector)
    return int(min(AUTO_CHUNK_HISTORY_TOKENS, max(0, room)))


def history_as_records(layout: BlockLayout, history_bytes: int) -> bool:
    """Whether a layer keeps its chunk history as int8 records (their keys centered by one fp32 vector per row and
    head): where the ring holds records and the model's dtype takes 4 bytes, so the records multiply the history's
    room by 3.6 at head_dim 128. In a 16-bit model (1.8x) they measured no better than the exact history and cost
    more operators per forward (docs/performance.md)."""
    return layout.config.ring_records and history_bytes > 2


def history_vector_bytes(layout: BlockLayout, history_bytes: int) -> tuple[int, int]:
    """(bytes of one kept key or value vector, bytes per row and KV head besides) of the chunk history of a model
    whose dtype takes `history_bytes` per element (history_as_records)."""
    d = layout.head_dim
    return (ring_record_bytes(d), 4 * d) if history_as_records(layout, history_bytes) else (d * history_bytes, 0)


class TurboQuantCacheFullError(RuntimeError):
    """The cache would exceed its `max_cache_tokens` or `max_cache_len` bound."""


@dataclass(frozen=True)
class LayerStep:
    """What one update() hands the attention function for one layer and one forward.

    exact: attend over the new tokens' exact K/V (the first prefill with prefill_attention="exact").
    refresh_padding: a prefill-like forward (several new tokens, or the first): re-derive the
        rows' first real positions from this forward's attention mask.
    """

    layer: "TurboQuantLayer"
    exact: bool
    refresh_padding: bool
    start: int  # position of the first new token (-1: a one-token step, whose attention never reads it)
    # a forward of several tokens over a non-empty history: the exact ring's positions before `start` and the
    # forward's own K/V, as one ring of W + new slots (position p at slot p % (W + new)); see forward_window
    window: tuple[torch.Tensor, torch.Tensor] | None = None


class _StaticWhenFixed:
    """A layer attribute holding a tensor or None. In a fixed-capacity layer each tensor set is marked as having a
    static address, so CUDA graphs of a compiled step read it in place instead of copying it before every replay."""

    def __init__(self, doc: str):
        self.__doc__ = doc

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, layer, owner=None):
        return self if layer is None else layer.__dict__.get(self.slot)

    def __set__(self, layer, tensor: torch.Tensor | None) -> None:
        layer.__dict__[self.slot] = tensor if tensor is None else _static(tensor, layer.max_cache_len is not None)


class TurboQuantLayer(CacheLayerMixin):
    """One attention layer's compressed K/V: a uint8 pool [capacity * rows, H, plane_bytes].

    With `max_cache_len` (tokens per row) the layer has a fixed capacity, as transformers' StaticLayer:
    the pool, block table and exact side buffers are allocated once, at the first update, and a
    decode step traced by torch.compile takes its position from the device (`seq_lens`), so one
    graph serves every step (is_compileable). Prefill runs eagerly (generate() does so), where the
    host-side levers (padding, key-centering means, the exact prefix bound) are settled.
    """

    is_sliding = False  # keeps the whole history; the kernel applies any window
    is_croppable = True

    def __init__(self, layout: BlockLayout, max_cache_tokens: int | None = None, max_cache_len: int | None = None):
        super().__init__()
        self.layout = layout  # num_kv_heads may shrink to a tensor-parallel shard at lazy_initialization
        self.config_kv_heads = layout.num_kv_heads
        self.max_cache_tokens = max_cache_tokens
        self.replace_with_dense = None  # set by the owning TurboQuantCache: (key, value) -> None
        self.max_cache_len = max_cache_len
        self.is_compileable = max_cache_len is not None
        self.launches = ops.HeldLaunches()  # a decode step's kernel plans, kept while the buffers stay the same
        self._decode_step = LayerStep(self, False, False, -1)  # what a settled one-token step hands the attention
        self._inputs_passed = None  # the kinds of the last K/V found good (_check_inputs)
        self._drop_buffers()
        self._clear()

    # tensors a compiled step reads, at static addresses in a fixed-capacity layer (_StaticWhenFixed)
    key_offset = _StaticWhenFixed("[rows, H, D] float32 key_centering means per row and KV head (None: no centering)")
    kv_start = _StaticWhenFixed("[rows] int32 first real position of each row (left padding; None: none)")

    def _drop_buffers(self) -> None:
        self.launches.drop()
        self.pool: torch.Tensor | None = None
        self.rows = 0
        self.capacity = 0  # blocks per row
        self.block_table: torch.Tensor | None = None  # [rows, capacity] int32
        self.seq_lens: torch.Tensor | None = None  # [rows] int32, == length (persistent, filled in place)
        self.prefix_keys: torch.Tensor | None = None  # [rows, H, P, D] exact first real tokens (exact_prefix_tokens)
        self.prefix_values: torch.Tensor | None = None
        self.recent_keys: torch.Tensor | None = None  # [rows, H, W, D] ring of the last W tokens (recent_window)
        self.recent_values: torch.Tensor | None = None
        # fixed capacity: split scratch of decode steps, sized at each batch's prefill (a compiled one reserves it
        # while there is none)
        self.decode_workspace: torch.Tensor | None = None

    def _clear(self) -> None:
        if self.max_cache_len is None:  # a fixed-capacity layer keeps its buffers (static addresses) for the next batch
            self._drop_buffers()
        elif self.seq_lens is not None:
            self.seq_lens.zero_()
        self._length = 0  # tokens per row, pads included (HF's cache length); read through `length`
        self._length_on_device = False  # compiled steps advanced seq_lens only: `length` reads it back once
        self._starting = True  # no update since the last reset (a host flag a compiled step can read: no length)
        self.kv_start = None  # no padding
        self.needs_full_mask = False  # padding inside a row: attend through HF's mask instead of kv_start
        self.key_offset = None  # from the first update (key_centering)
        self._recenter_pending = False  # the means came from this forward's update: the attention may drop pads
        # key_centering means still settling: some row has fewer than `recent_window` real tokens (see settle_means)
        self._centering_open = False
        self._max_start = 0  # host bound on every row's first real position (set_padding)
        self._starts_padded = False  # _max_start > 0, kept apart: a compiled chunk guards on a bool, not on the bound
        self.prefix_fill_until = 0  # host bound: prefix tokens can only arrive at positions below this
        self._prefix_open = False  # length < prefix_fill_until, kept as a flag (a compiled step reads no length)
        self.recent_from = 0  # host int: the ring is valid from max(recent_from, length - W) (crop lowers it)
        self._drop_chunk_history()
        self.is_initialized = self.pool is not None

    @property
    def length(self) -> int:
        """Tokens per row (host int). After compiled decode steps, which advance only the device lengths, the
        first eager read takes it back from the device (one read; never inside a compiled step)."""
        if self._length_on_device:
            self._length = int(self.seq_lens[0])
            self._length_on_device = False
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        self._length = value
        self._length_on_device = False

    # ---- CacheLayerMixin --------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Take the device and the KV head count from the first K/V this layer sees.

        Why the heads: under tensor parallelism (tp_plan) each rank's projections yield a shard of
        the config's KV heads, so the layer accepts any divisor of the config's count and lays out
        its pool for that many heads (as transformers' own StaticLayer sizes itself from key_states).
        Why the device: under a device_map each layer's pool must live where that layer runs.
        """
        heads = key_states.shape[1] if key_states.dim() == 4 else 0
        dim, total = self.layout.head_dim, self.config_kv_heads
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if t.dim() != 4 or t.shape[3] != dim or t.shape[1] != heads or heads < 1 or total % heads:
                raise ValueError(
                    f"{name} must be [batch, KV heads, tokens, head_dim {dim}] with the config's {total} KV heads "
                    f"or a tensor-parallel shard of them (a divisor of {total}), got {list(t.shape)} "
                    f"(key_states {list(key_states.shape)})"
                )
        if heads != self.layout.num_kv_heads:
            self.layout = dataclasses.replace(self.layout, num_kv_heads=heads)
        ops.layout_index(self.layout)  # registered outside any compiled region (compiled steps look it up)
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.exact_dtype = self.layout.config.exact_dtype_for(key_states.dtype)  # the prefix's and ring's
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, dense: bool = False,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Compress and store the new tokens; see the module docstring for what is returned."""
        if self.max_cache_len is not None and torch.compiler.is_compiling():
            if self.settles_on_host(key_states.shape[2]):
                return _untraced_update(self, key_states, value_states, dense)
            return self._traced_update(key_states, value_states, dense)
        self._starting = False
        self._check_inputs(key_states, value_states)
        if key_states.shape[2] == 1 and not dense and self._settled(key_states.shape[0]):
            return self._steady_decode(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, heads, new, dim = key_states.shape
        was_empty = self.length == 0
        if was_empty:
            self._start_batch(rows)
        elif rows != self.rows:
            raise ValueError(
                f"batch size changed from {self.rows} to {rows} on a non-empty TurboQuantCache; call reset(), "
                "batch_select_indices() or batch_repeat_interleave() first"
            )
        start = self.length
        self._reserve(start + new)
        slots = None if new == 1 else self._slots(start, new)  # (a one-token step's: _store_step)
        if was_empty and self.layout.config.exact_prefix_tokens:
            shape = (rows, heads, self.layout.config.exact_prefix_tokens, dim)
            self.prefix_keys = self._zeros(self.prefix_keys, shape, self.exact_dtype)
            self.prefix_values = self._zeros(self.prefix_values, shape, self.exact_dtype)
            self.prefix_fill_until = self.layout.config.exact_prefix_tokens
        if was_empty and self.layout.config.recent_window:
            shape, ring_dtype = self.layout.ring_spec(rows, self.layout.config.recent_window, self.exact_dtype)
            self.recent_keys = self._zeros(self.recent_keys, shape, ring_dtype)
            self.recent_values = self._zeros(self.recent_values, shape, ring_dtype)
            self.recent_from = 0
        self._recenter_pending = False
        # (read before the store below overwrites the ring slots of the oldest positions)
        wants_window = not was_empty and (new > 1 and not dense or self._centering_open)
        window = self.forward_window(key_states, value_states, start) if wants_window else None
        if was_empty:  # a new batch (or the same rows after crop(0)): new key_centering means
            self.key_offset = None
            self._centering_open = self._settles_means()
        if self._centering_open:
            self._settle_means(key_states, value_states, window, start)
            # a prefill-like forward: the "turboquant" attention refines the means once its mask tells the padding
            self._recenter_pending = not dense and (was_empty or new > 1)
        elif self.layout.config.key_centering and self.key_offset is None:
            self._set_means(_key_mean(key_states))  # per row and KV head, over the first update's tokens
            self._recenter_pending = not dense
        # one launch: the codes, the exact ring's copy of the last tokens (recent_window) and the new row lengths
        self._keep_chunk_history(key_states, value_states, start, dense)
        if new == 1:
            self._store_step(key_states, value_states, start)
        else:
            recent = (self.recent_keys, self.recent_values) if self.recent_keys is not None else None
            ops.store(self.pool, self.layout, _tokens_first(key_states), _tokens_first(value_states), slots,
                      key_offset=self.key_offset, recent=recent, start=start, seq_lens=self.seq_lens)
        self.length = start + new
        if not self._recenter_pending:  # (else the attention closes it once this forward's padding is known)
            self._close_centering()

        exact = was_empty and self.layout.config.prefill_attention == "exact"
        # padding known so far (none at a first prefill: the prefix then counts from position 0; the
        # "turboquant" attention refills it once this forward's mask has told where the padding ends)
        self.fill_prefix(key_states, value_states, start)
        self._prefix_open = self.prefix_keys is not None and self.length < self.prefix_fill_until
        if dense:  # another attention implementation: it never tells the cache where the padding ends
            if self.max_cache_len is not None:  # as StaticLayer: the whole capacity, HF's mask hides the rest
                return self._dense_capacity(key_states, value_states, start if exact else None)
            return (key_states, value_states) if exact else self.dequantized(key_states.dtype)
        # (a one-token step attends the layer's ring as every decode step does; its window served the means only)
        setattr(key_states, STEP_ATTRIBUTE, LayerStep(self, exact, was_empty or new > 1, start,
                                                      window if new > 1 else None))
        return key_states, value_states

    def settles_on_host(self, new: int) -> bool:
        """Whether an update of `new` tokens per row settles state on the host, so runs eagerly (behind a graph break
        when compiled): a batch's first update (padding, means, exact prefix bound), one of several tokens while the
        key-centering means settle, or one before a centering layer has means."""
        # (a one-token step never reads _centering_open: a compiled step gets no guard on it, no recompile)
        return self._starting or (new > 1 and self._centering_open) or (self.layout.config.key_centering
                                                                       and self.key_offset is None)

    def _settled(self, rows: int) -> bool:
        """Whether a one-token step of `rows` rows only stores and attends: the layer holds these rows, and their
        centering means, exact prefix and padding are settled (host flags only; no device read)."""
        return (self.pool is not None and rows == self.rows and self._length > 0 and not self._length_on_device
                and not self._centering_open and not self._prefix_open
                and (self.key_offset is not None or not self.layout.config.key_centering))

    def _steady_decode(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """update() of a settled layer's one-token step (most of generate()'s steps): the store, and the layer's one
        decode LayerStep."""
        start = self._length
        self._reserve(start + 1)
        self._store_step(key_states, value_states, start)
        self._length = start + 1
        if self._chunk_history_end >= 0:
            self._drop_chunk_history()
        setattr(key_states, STEP_ATTRIBUTE, self._decode_step)
        return key_states, value_states

    def _store_step(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int) -> None:
        """A one-token step's store: its tokens as they are (one per row) at each row's first slot shifted to
        `start` (a host int; no tensor op per step), the ring and the lengths in the same launch, the layer's held
        plans."""
        shift = self._slot_shift(start)
        if ops.store_held(self.launches, self.pool, self.layout, key_states, value_states, self._row_slots,
                          self.key_offset, self.recent_keys, self.recent_values, self.seq_lens, start, shift):
            return  # (a repeated step: the held store, without the general call's plumbing)
        recent = (self.recent_keys, self.recent_values) if self.recent_keys is not None else None
        ops.store(self.pool, self.layout, key_states, value_states, self._row_slots, key_offset=self.key_offset,
                  recent=recent, start=start, seq_lens=self.seq_lens, slot_shift=shift, held=self.launches)

    def _traced_update(self, key_states: torch.Tensor, value_states: torch.Tensor,
                       dense: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """update() of a fixed-capacity layer under torch.compile: positions from the device, no host state read
        that changes from step to step (one graph serves every decode step).

        The new tokens' positions start at seq_lens (every row's length); a token past max_cache_len is not stored
        and the lengths stop at max_cache_len (eager updates raise TurboQuantCacheFullError instead).
        """
        rows, _, new, _ = key_states.shape
        t, limit = self.layout.block_size, self.max_cache_len
        pos = self.seq_lens[:1].long() + torch.arange(new, device=self.device)  # [new]
        kept = pos < limit
        slots = self._row_slots[:, None] + ((pos // t) * (self.rows * t) + pos % t)[None, :]
        slots = torch.where(kept[None, :], slots, -1).flatten()
        window = self.forward_window(key_states, value_states, pos[0]) if new > 1 and not dense else None
        # the ring (the last min(new, W) tokens at slot position % W, kept slots only) in the same launch
        recent = (self.recent_keys, self.recent_values) if self.recent_keys is not None else None
        ops.store(self.pool, self.layout, _tokens_first(key_states), _tokens_first(value_states), slots,
                  key_offset=self.key_offset, recent=recent, positions=pos)
        if self._prefix_open:
            self._copy_prefix(key_states, value_states, pos[0])
        self.seq_lens.add_(kept.sum().to(self.seq_lens.dtype))
        self._length_on_device = True
        if dense:
            return self._dense_capacity(key_states, value_states, None)
        setattr(key_states, STEP_ATTRIBUTE, LayerStep(self, False, False, -1, window))
        return key_states, value_states

    def _dense_capacity(self, key_states: torch.Tensor, value_states: torch.Tensor,
                        exact_from: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole fixed capacity dequantized (for another attention implementation); exact_from: the position
        from which the new tokens are returned as given (a first prefill with prefill_attention="exact")."""
        k, v = self.dequantized(key_states.dtype, self.max_cache_len)
        if exact_from is not None:
            new = key_states.shape[2]
            k[:, :, exact_from : exact_from + new] = key_states
            v[:, :, exact_from : exact_from + new] = value_states
        return k, v

    def _zeros(self, buffer: torch.Tensor | None, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """Zeros of `shape`: a fixed-capacity layer zeroes its buffer of that shape in place (its address is static)."""
        if self.max_cache_len is not None and buffer is not None and buffer.shape == shape and buffer.dtype == dtype:
            return buffer.zero_()
        return _static(torch.zeros(shape, dtype=dtype, device=self.device), self.max_cache_len is not None)

    def _check_inputs(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Clear errors for inputs the store would reject deep inside (or, worse, accept silently). Inputs of the
        kinds (shapes, dtypes, devices) last found good pass at once (decode steps repeat them)."""
        kinds = None
        if type(key_states) is torch.Tensor and type(value_states) is torch.Tensor:
            kinds = (key_states.shape, key_states.dtype, key_states.device, value_states.shape, value_states.dtype,
                     value_states.device)
            if kinds == self._inputs_passed:
                return
        self._check_new_inputs(key_states, value_states)
        if self.is_initialized:  # (before the first update the heads are not known yet: nothing to remember)
            self._inputs_passed = kinds

    def _check_new_inputs(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        expected = (self.layout.num_kv_heads, self.layout.head_dim)
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{name} has dtype {t.dtype}; TurboQuantCache supports "
                                f"{', '.join(map(str, SUPPORTED_DTYPES))}")
            if self.is_initialized and (t.dim() != 4 or (t.shape[1], t.shape[3]) != expected):  # else: lazy_initialization
                raise ValueError(
                    f"{name} must be [batch, {expected[0]} KV heads, tokens, head_dim {expected[1]}] for this "
                    f"cache layer (as its first update), got {list(t.shape)}"
                )
            if self.is_initialized and t.device != self.device:
                raise ValueError(f"{name} is on {t.device} but this cache layer lives on {self.device}; "
                                 "keep every update of a layer on one device")
        if key_states.device != value_states.device:
            raise ValueError(f"key_states ({key_states.device}) and value_states ({value_states.device}) must be "
                             "on the same device")
        if key_states.shape != value_states.shape:
            raise ValueError(f"key_states {list(key_states.shape)} and value_states {list(value_states.shape)} "
                             "must have the same shape")

    # ---- DynamicLayer's tensors, for code that inspects caches (attention never reads them) ---------
    @property
    def keys(self) -> torch.Tensor | None:
        """The keys as attention sees them, [rows, KV heads, length, head_dim] in the model's dtype:
        dequantized on each access (a copy of the whole history), None before the first update."""
        return self.dequantized(self.dtype)[0] if self.is_initialized else None

    @keys.setter
    def keys(self, value) -> None:
        self._refuse_assignment("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """The values as attention sees them (see `keys`)."""
        return self.dequantized(self.dtype)[1] if self.is_initialized else None

    @values.setter
    def values(self, value) -> None:
        self._refuse_assignment("values", value)

    @staticmethod
    def _refuse_assignment(name: str, value) -> None:
        if value is not None:  # CacheLayerMixin.__init__ sets both to None
            raise AttributeError(f"TurboQuantLayer.{name} is read-only (dequantized from the compressed pool); "
                                 "write through update()")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.max_cache_len is not None:  # one mask shape for every step, as StaticLayer
            return self.max_cache_len, 0
        return self.length + query_length, 0

    def get_seq_length(self) -> int | torch.Tensor:
        """Tokens per row; inside a compiled step of a fixed-capacity layer a 0-d device tensor (as StaticLayer's)."""
        if self.max_cache_len is not None and torch.compiler.is_compiling():
            return self.seq_lens[0] if self.seq_lens is not None else 0
        return self.length

    def get_max_length(self) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def offload(self) -> None:  # the pool stays where its layer runs
        pass

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove tokens, as DynamicLayer.crop does on this transformers:
        a positive count keeps that many tokens before 5.18 (deprecated there) and raises from 5.18 on.

        Assisted decoding may pass a 0-d tensor (a device count of accepted tokens): it becomes a
        host int here, as lengths are host ints everywhere else (kernel arguments, no syncs)."""
        tokens_to_remove = int(tokens_to_remove)
        if tokens_to_remove > 0:
            if POSITIVE_CROP_RAISES:
                raise ValueError(
                    f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                    "Please use a negative integer to remove that number of tokens from the cache instead."
                )
            new_length = min(tokens_to_remove, self.length)
        else:
            new_length = max(self.length + tokens_to_remove, 0)
        self._drop_chunk_history()
        if new_length != self.length:
            if self.recent_keys is not None:  # ring slots of dropped positions will be overwritten
                self.recent_from = max(self.recent_from, self.length - self.recent_keys.shape[2])
            self.length = new_length
            self.seq_lens.fill_(new_length)
            self._prefix_open = self.prefix_keys is not None and new_length < self.prefix_fill_until
            self._starting = new_length == 0
            if self.kv_start is not None:  # cropped into a row's left padding: what follows is real
                self.kv_start = self.kv_start.clamp_max(new_length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if indices.dtype == torch.bool:
            indices = indices.nonzero().squeeze(-1)
        self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.pool is not None:
            self._select_rows(torch.arange(self.rows, device=self.device).repeat_interleave(repeats))

    # ---- what the attention function reads ------------------------------------------------------
    @property
    def padded(self) -> bool:
        """Whether some row may start with padding (kv_start holds a nonzero first position; a host bound)."""
        return self.kv_start is not None and self._starts_padded

    def set_padding(self, kv_start: torch.Tensor | None, contiguous: bool, max_start: int = 0) -> None:
        """Record each row's first real position (None: no padding); non-contiguous padding is sticky.

        max_start (host int): the largest first real position, which bounds where prefix tokens arrive.
        """
        self.kv_start = None if kv_start is None else kv_start.to(self.device, torch.int32)
        self.needs_full_mask = self.needs_full_mask or not contiguous
        self._max_start = max_start
        self._starts_padded = max_start > 0
        if self.prefix_keys is not None:
            self.prefix_fill_until = max_start + self.prefix_keys.shape[2]
            self._prefix_open = self.length < self.prefix_fill_until

    def keep_dense(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Hand this layer's slot in its cache to an uncompressed layer holding the given K/V (the whole
        history: called at the first prefill, by the attention's per-layer check)."""
        if self.replace_with_dense is None:
            raise RuntimeError("this TurboQuantLayer belongs to no TurboQuantCache")
        self.replace_with_dense(key_states, value_states)

    def use_config(self, config: TurboQuantConfig, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """From now on store keys and values in `config`'s format (the attention's per-layer check, at the first
        prefill: FP8 keys for a layer whose attention 3-4-bit keys move too far). Re-stores the history, which
        `key_states`/`value_states` [rows, H, length, D] must be, with the layer's means; the exact prefix, the
        means and the lengths stay as they are, and so does the ring unless the new format keeps it in another kind
        (config.ring_records)."""
        layout = BlockLayout(config, self.layout.num_kv_heads, self.layout.head_dim)
        if layout.block_size != self.layout.block_size or key_states.shape[2] != self.length:
            raise ValueError("use_config takes a format of the same block size and the layer's whole history")
        self.launches.drop()
        self.layout = layout
        self.pool = _static(layout.allocate(self.capacity * self.rows, self.device), self.max_cache_len is not None)
        recent = None
        if self.recent_keys is not None:  # a ring of the other kind (recent_format "auto": FP8 keys keep theirs
            # exact) is written again from the history
            shape, ring_dtype = layout.ring_spec(self.rows, self.ring_size, self.exact_dtype)
            if ring_dtype != self.recent_keys.dtype:
                self.recent_keys = self._zeros(None, shape, ring_dtype)
                self.recent_values = self._zeros(None, shape, ring_dtype)
                recent = (self.recent_keys, self.recent_values)
        ops.store(self.pool, layout, _tokens_first(key_states), _tokens_first(value_states),
                  self._slots(0, key_states.shape[2]), key_offset=self.key_offset, recent=recent, start=0)

    def recenter(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int,
                 window: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Once this forward's mask has told where each row's padding ends (set_padding), take the
        key_centering means over the real tokens only and store the update's tokens again with them.

        Runs in the forward whose update set (or moved) the means, and only if rows are padded:
        the stored codes then never depend on pad tokens, nor on the other rows of the batch.
        """
        if not self._recenter_pending:
            return
        self._recenter_pending = False
        if self._centering_open:
            if self.kv_start is not None:
                self._settle_means(key_states, value_states, window, start, restore_new=True)
            self._close_centering()
            return
        if self.kv_start is None:
            return
        rows, _, new, _ = key_states.shape
        pos = torch.arange(start, start + new, device=self.device)
        real = pos[None, :] >= self.kv_start.long()[:, None]  # [rows, new]
        self._set_means(_key_mean(key_states, real))
        ops.store(self.pool, self.layout, _tokens_first(key_states), _tokens_first(value_states),
                  self._slots(start, new), key_offset=self.key_offset, recent=self._records_ring(), start=start)

    # ---- key_centering means ------------------------------------------------------------------------
    def _settles_means(self) -> bool:
        """Whether this layer's means come from each row's first `recent_window` real tokens, whatever forwards
        they arrive in (chunked prefill, a prompt fed token by token, decode): a layer with a ring, which holds
        every token of a row until that row's means are final. (A compiled one-token step of a fixed-capacity layer
        leaves them as they are, and stores with them: a captured step cannot store history again. A row then keeps
        the means it has once it holds `recent_window` real tokens; one still short of them, all of whose tokens
        are in the ring, is refined by the next eager update.)"""
        cfg = self.layout.config
        return cfg.key_centering and cfg.recent_window > 0

    def _settle_means(self, key_states: torch.Tensor, value_states: torch.Tensor,
                      window: tuple[torch.Tensor, torch.Tensor] | None, start: int, restore_new: bool = False) -> None:
        """Means over each row's real positions [kv_start, kv_start + W) seen so far (W = recent_window), from the
        exact tokens (the ring's history and this forward's tokens); rows whose means were already final keep
        them. The history's tokens in the ring are stored again with the new means (restore_new: this forward's
        tokens too), so every stored code of a row goes with the row's current means."""
        w = self.layout.config.recent_window
        first = start if window is None else start - (window[0].shape[2] - key_states.shape[2])
        keys = key_states if window is None else _in_position_order(window[0], first)
        pos = first + torch.arange(keys.shape[2], device=self.device)
        lo = torch.zeros(self.rows, dtype=torch.long, device=self.device) if self.kv_start is None else self.kv_start.long()
        real = (pos[None, :] >= lo[:, None]) & (pos[None, :] < lo[:, None] + w) & (pos[None, :] >= self.recent_from)
        means = _key_mean(keys, real & (pos[None, :] >= 0))
        if self.key_offset is not None:  # rows complete before this forward keep their means
            done = (lo + w <= start)[:, None, None]
            means = torch.where(done, self.key_offset, means)
        self._set_means(means)
        if window is None:
            if restore_new:
                ops.store(self.pool, self.layout, _tokens_first(key_states), _tokens_first(value_states),
                          self._slots(start, key_states.shape[2]), key_offset=self.key_offset,
                          recent=self._records_ring(), start=start)
            return
        count = keys.shape[2] if restore_new else keys.shape[2] - key_states.shape[2]
        kept = (pos[:count] >= max(self.recent_from, 0))[None, :].expand(self.rows, -1)
        slots = torch.where(kept.flatten(), self._slots(first, count, clamp=True), -1)
        values = _in_position_order(window[1], first)
        ops.store(self.pool, self.layout, _tokens_first(keys[:, :, :count]), _tokens_first(values[:, :, :count]),
                  slots, key_offset=self.key_offset)

    def _set_means(self, means: torch.Tensor) -> None:
        """New key_centering means; an int8 ring's key records, centered by the old ones, are encoded again with them
        (the tokens a forward stores again with the new means are then rewritten from the exact K/V)."""
        ring = self._records_ring()
        if ring is not None:
            vectors = reference.decode_ring(ring[0], reference.ring_offset(self.key_offset))
            ring[0].copy_(reference.encode_ring(vectors, reference.ring_offset(means)))
        self.key_offset = means

    def _records_ring(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The ring, when it holds int8 records (whose key records go with the means), else None."""
        if self.recent_keys is None or self.recent_keys.dtype != torch.int8:
            return None
        return self.recent_keys, self.recent_values

    def _close_centering(self) -> None:
        """The means are final once every row has `recent_window` real tokens (a host bound: no read)."""
        if self.length >= self._max_start + self.layout.config.recent_window:
            self._centering_open = False

    # ---- exact tokens of a multi-token forward ---------------------------------------------------------
    @property
    def ring_size(self) -> int:
        return 0 if self.recent_keys is None else self.recent_keys.shape[2]

    def forward_window(self, key_states: torch.Tensor, value_states: torch.Tensor,
                       start: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact tokens a forward of several new tokens attends besides the pool: the ring's W positions
        before `start` (or the chunk history's, when the forward follows another that kept it) and the new
        tokens, as one ring of W + new slots (position p at slot p % (W + new), the layout the kernels'
        recent_window overlay reads). So every new query attends the forward's own tokens exactly, and the
        older history as a decode step at `start` would. Read before the store overwrites the ring."""
        new = key_states.shape[2]
        if type(start) is int and self.recent_keys is not None and not self._window_from_chunk_history(start, new):
            return self._ring_window(key_states, value_states, start)
        past = self._window_history(start, new)
        w = 0 if past is None else past[0].shape[2]
        pos = torch.arange(w + new, device=self.device) + (start - w)  # (start: a host int, or 0-d when traced)
        seqs = (x if p is None else torch.cat([p.to(x.dtype), x], 2)
                for p, x in zip(past or (None, None), (key_states, value_states)))
        return tuple(torch.empty_like(seq).index_copy_(2, pos % (w + new), seq) for seq in seqs)

    def _window_history(self, start: int | torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The history positions a forward window holds before `start`, keys and values in position order: the
        chunk history when this forward of several tokens follows the ones that kept it (and it may hold more than
        the ring's W tokens and holds at least W), else the ring's W positions (decoded records); None without a
        ring."""
        if type(start) is int and self._window_from_chunk_history(start, new):
            return self._chunk_history_window()
        if self.recent_keys is None:
            return None
        w = self.ring_size
        slots = (torch.arange(w, device=self.device) + (start - w)) % w
        offset = reference.ring_offset(self.key_offset)
        return (reference.ring_vectors(self.recent_keys.index_select(2, slots), offset),
                reference.ring_vectors(self.recent_values.index_select(2, slots)))

    def _window_from_chunk_history(self, start: int, new: int) -> bool:
        """Whether a forward of `new` tokens at `start` takes its window's history from the chunk history."""
        return (new > 1 and bool(self._chunk_history) and start == self._chunk_history_end
                and self._chunk_history_size > self.ring_size and self._chunk_history_tokens() >= self.ring_size)

    def _ring_window(self, key_states: torch.Tensor, value_states: torch.Tensor,
                     start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_window over the ring for new tokens at a host position (ops.ring_window: one launch per tensor on
        CUDA, where the general path's position-order reads, decode, cat and scatter took ~20 device ops per layer; a
        verification forward of speculative decoding and a chat's next turn run this in every layer)."""
        return (ops.ring_window(self.recent_keys, key_states, start, self.key_offset),
                ops.ring_window(self.recent_values, value_states, start))

    def _keep_chunk_history(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int,
                            dense: bool) -> None:
        """After an eager forward of several tokens, keep the last chunk_history_tokens of the K/V of the run of such
        forwards it ends (as int8 records where history_as_records, else by reference where they own their storage;
        the oldest piece trimmed), for a next such forward; anything else drops them. A fixed-capacity layer keeps
        none (its memory is allocated up front). With chunk_history_tokens=None a run's first forward keeps none (a
        prompt prefilled whole, or a chat turn that decode steps follow, would hold them for nothing), unless it
        leaves an exact start (continue_run), and later ones what fits (chunk_history_room of the tokens then held):
        at most what the run kept before plus their own."""
        new, size = key_states.shape[2], self.layout.config.chunk_history_tokens
        follows = start == self._chunk_history_end
        if size is None:
            size = chunk_history_room(self.layout, start + new, self.exact_dtype.itemsize,
                                      key_states.element_size()) if follows else 0
        elif size <= self.ring_size:
            size = -1  # never read (the ring holds as many): nothing kept
        if (new == 1 or dense or size < 0 or self.max_cache_len is not None
                or self.layout.config.prefill_attention != "exact"):  # (then no forward attends its window)
            self._drop_chunk_history()
            return
        pieces = self._chunk_history if follows else []
        offset = self._chunk_history_offset if follows else None
        if size and history_as_records(self.layout, key_states.element_size()):  # int8 records, the keys centered
            # by the mean of the run's first kept forward (one vector per row and head for the whole run)
            offset = key_states.float().mean(2, keepdim=True) if offset is None else offset
            last = slice(max(0, new - size), new)  # (records of tokens the trim below would drop are never made)
            pieces.append((reference.encode_ring(key_states[:, :, last], offset),
                           reference.encode_ring(value_states[:, :, last])))
        else:
            pieces.append((key_states, value_states))
        kept, count = [], 0  # the last `size` tokens: newest pieces first
        for k, v in reversed(pieces if size else ()):
            take = min(k.shape[2], size - count)
            if take == 0:
                break
            kept.append(tuple(_own_storage(x[:, :, -take:]) for x in (k, v)))
            count += take
        self._chunk_history, self._chunk_history_end, self._chunk_history_size = kept[::-1], start + new, size
        self._chunk_history_offset = offset if kept else None

    def continue_run(self) -> None:
        """The next update, a first one, brings the tokens of an exact start's forwards with its own: it keeps them
        as chunk history as a later forward of a run keeps the run's (with chunk_history_tokens=None, what fits),
        so a prompt fed in chunks attends them exactly past the exact start too."""
        self._chunk_history_end = 0

    def _chunk_history_window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept history: keys and values [rows, H, T, D] in position order (records decoded, in fp32)."""
        pieces = self._chunk_history
        keys, values = (torch.cat([p[i] for p in pieces], 2) if len(pieces) > 1 else pieces[0][i] for i in range(2))
        return reference.ring_vectors(keys, self._chunk_history_offset), reference.ring_vectors(values)

    def _chunk_history_tokens(self) -> int:
        return sum(k.shape[2] for k, _ in self._chunk_history)

    def _drop_chunk_history(self) -> None:
        self._chunk_history: list[tuple[torch.Tensor, torch.Tensor]] = []  # (keys, values) of each forward, in order
        self._chunk_history_end = -1  # the position after its last token (-1: no run of forwards of several tokens)
        self._chunk_history_size = 0  # the tokens it may hold (chunk_history_tokens, or the room for them)
        self._chunk_history_offset: torch.Tensor | None = None  # records: the keys' centering [rows, H, 1, D] fp32

    def chunk_history_bytes(self) -> int:
        """The K/V kept between forwards of several tokens (chunk_history_tokens; transient)."""
        offset = self._chunk_history_offset
        return _bytes(self._chunk_history) + (0 if offset is None else offset.numel() * offset.element_size())

    def fill_prefix(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int) -> None:
        """Copy the new tokens that are among each row's first P real tokens into the exact prefix.

        Runs only while such tokens can still arrive (a host-side bound), so decode pays nothing.
        """
        if self.prefix_keys is None or start >= self.prefix_fill_until:
            return
        self._copy_prefix(key_states, value_states, start)

    def _copy_prefix(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int | torch.Tensor) -> None:
        """fill_prefix's copy, for a host or a device (0-d) start position."""
        rows, heads, new, dim = key_states.shape
        p = self.prefix_keys.shape[2]
        first = torch.zeros(rows, dtype=torch.long, device=self.device) if self.kv_start is None else self.kv_start.long()
        idx = first[:, None] + torch.arange(p, device=self.device)[None, :] - start  # [rows, P] into the new tokens
        arrived = ((idx >= 0) & (idx < new))[:, None, :, None]
        index = idx.clamp(0, new - 1)[:, None, :, None].expand(rows, heads, p, dim)
        for dst, src in ((self.prefix_keys, key_states), (self.prefix_values, value_states)):
            dst.copy_(torch.where(arrived, src.gather(2, index).to(dst.dtype), dst))

    def dequantized(self, dtype: torch.dtype = torch.float32, tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole history as dense K/V [rows, H, tokens, D] (for other attention implementations); tokens:
        the length (a host int) by default; more: positions past the length hold whatever the pool holds."""
        tokens = self.length if tokens is None else tokens
        used = -(-tokens // self.layout.block_size)
        k, v = ops.gather(self.pool, self.layout, self.block_table[:, :used], self.key_offset)
        if self.prefix_keys is not None:
            k = reference.overlay_prefix(k, self.prefix_keys, self.kv_start)
            v = reference.overlay_prefix(v, self.prefix_values, self.kv_start)
        if self.recent_keys is not None:
            k = reference.overlay_recent(k, self.recent_keys, self.seq_lens, self.recent_from, self.key_offset)
            v = reference.overlay_recent(v, self.recent_values, self.seq_lens, self.recent_from)
        return k[:, :, :tokens].to(dtype), v[:, :, :tokens].to(dtype)

    def memory_footprint(self) -> int:
        return self.pool_bytes() + self.exact_side_bytes() + self.chunk_history_bytes()

    def pool_bytes(self) -> int:
        """The compressed pool: grows with the tokens."""
        return 0 if self.pool is None else self.pool.numel() * self.pool.element_size()

    def exact_side_bytes(self) -> int:
        """The exact prefix and recent ring: a constant per row, whatever the context length."""
        tensors = (self.prefix_keys, self.prefix_values, self.recent_keys, self.recent_values)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    # ---- paging ------------------------------------------------------------------------------------
    def _start_batch(self, rows: int) -> None:
        """An empty layer takes a (new) batch size; an existing pool is reinterpreted, not copied (a fixed-capacity
        layer allocates anew for another batch size)."""
        if rows != self.rows and self.max_cache_len is not None:
            self._drop_buffers()
            self.rows = rows
        elif rows != self.rows:
            self.rows = rows
            self.capacity = 0 if self.pool is None else self.pool.shape[0] // rows
            self.pool = None if self.pool is None else self.pool[: self.capacity * rows]
            self._rebuild_tables()
        self.kv_start = None
        self.needs_full_mask = False

    def _reserve(self, tokens: int) -> None:
        """Make room for `tokens` per row: exact when empty, then geometric growth by a prefix copy."""
        if self.max_cache_len is not None:
            self._reserve_fixed(tokens)
            return
        needed = -(-tokens // self.layout.block_size)
        if needed <= self.capacity:
            return
        limit = None
        if self.max_cache_tokens is not None:
            limit = self.max_cache_tokens // (self.rows * self.layout.block_size)
            if needed > limit:
                raise TurboQuantCacheFullError(
                    f"TurboQuantCache needs {needed * self.layout.block_size} tokens per row x {self.rows} rows "
                    f"but max_cache_tokens={self.max_cache_tokens} allows {limit * self.layout.block_size} per row; "
                    "raise max_cache_tokens or shorten the generation"
                )
        grown = needed if self.pool is None else max(needed, self.capacity + self._growth(self.capacity))
        grown = grown if limit is None else min(grown, limit)
        pool = self.layout.allocate(grown * self.rows, self.device)
        if self.pool is not None:
            pool[: self.pool.shape[0]].copy_(self.pool)
        self.pool, self.capacity = pool, grown
        self._rebuild_tables()

    def _reserve_fixed(self, tokens: int) -> None:
        """A fixed-capacity layer: its pool for max_cache_len tokens per row, allocated once; beyond it, an error."""
        if tokens > self.max_cache_len:
            raise TurboQuantCacheFullError(
                f"TurboQuantCache holds max_cache_len={self.max_cache_len} tokens per row; this update needs {tokens}: "
                "raise max_cache_len or shorten the generation"
            )
        if self.pool is not None:
            return
        blocks = -(-self.max_cache_len // self.layout.block_size)
        if self.max_cache_tokens is not None and blocks * self.layout.block_size * self.rows > self.max_cache_tokens:
            raise TurboQuantCacheFullError(
                f"max_cache_len={self.max_cache_len} tokens per row x {self.rows} rows ({blocks} blocks of "
                f"{self.layout.block_size} tokens per row) exceeds max_cache_tokens={self.max_cache_tokens}"
            )
        self.pool, self.capacity = _static(self.layout.allocate(blocks * self.rows, self.device)), blocks
        self._rebuild_tables()

    def _growth(self, blocks: int) -> int:
        """Blocks per row a pool of `blocks` per row grows by: 1/GROWTH_DIVISOR of it, >= MIN_GROWTH_TOKENS."""
        return max(min_growth_blocks(self.layout.block_size), blocks // GROWTH_DIVISOR)

    def _rebuild_tables(self) -> None:
        """Block table [rows, capacity] = block * rows + row, and the persistent per-row buffers."""
        self.launches.drop()  # (their tensors are replaced: no old pool stays referenced)
        static = self.max_cache_len is not None
        if static and not torch.compiler.is_compiling():
            # read-only and the same in every fixed-capacity layer of this geometry: one pair of tensors, so a
            # compiled step's graph takes (and dynamo guards) them once, not per layer (docs/performance.md)
            self.block_table, self._row_slots = _shared_tables(self.rows, self.capacity, self.layout.block_size,
                                                               str(self.device))
        else:
            self.block_table, self._row_slots = _tables(self.rows, self.capacity, self.layout.block_size, self.device)
        self.seq_lens = _static(torch.full((self.rows,), self.length, dtype=torch.int32, device=self.device), static)
        self._step_slots = torch.empty_like(self._row_slots)  # a decode step's slots (persistent: no allocation)

    def _slot_shift(self, position: int) -> int:
        """What position `position` adds to each row's first slot (_row_slots): its slot is the sum."""
        t = self.layout.block_size
        return (position // t) * self.rows * t + position % t

    def _slots(self, start: int, count: int, clamp: bool = False) -> torch.Tensor:
        """Slots [rows * count] (row-major) of positions start .. start + count - 1 of every row.

        Position p of row r: block (p // T) * rows + r, offset p % T. clamp: negative positions give position 0's
        slot (for callers that mask them).
        """
        t = self.layout.block_size
        if count == 1 and not clamp:  # one add into a persistent buffer (the store reads it before the next such add)
            return torch.add(self._row_slots, self._slot_shift(start), out=self._step_slots)
        if not clamp and type(count) is int and count <= SLOT_TABLE_TOKENS:  # 2 device ops, not 7 (traced: a SymInt)
            width = max(16, 1 << (count - 1).bit_length())
            offsets = _slot_offsets(t, self.rows, str(self.device), width)[start % t, :count]
            return (self._row_slots[:, None] + offsets).add_(self._slot_shift(start)).flatten()
        pos = torch.arange(start, start + count, device=self.device)
        pos = pos.clamp_min(0) if clamp else pos
        return (self._row_slots[:, None] + ((pos // t) * self.rows * t + pos % t)[None, :]).flatten()

    def _select_rows(self, indices: torch.Tensor) -> None:
        """Rows become self[indices] (beam reorder, batch select, repeat): one gather of the used blocks."""
        if self.pool is None:
            return
        self.launches.drop()
        self._drop_chunk_history()
        indices = indices.to(self.device)
        new_rows = indices.shape[0]
        used = -(-self.length // self.layout.block_size)
        plane = self.pool.shape[1:]
        old = self.pool.view(self.capacity, self.rows, *plane)
        # the new pool holds what is used plus the usual growth slack, not the old capacity: a pool
        # kept from a long earlier request must not be multiplied by the new row count
        capacity = self.capacity if self.max_cache_len is not None else min(self.capacity, used + self._growth(used))
        # a fixed-capacity layer keeps its buffers' addresses (a compiled step's static inputs) while the rows do
        in_place = self.max_cache_len is not None and new_rows == self.rows
        if in_place:
            old[:used].copy_(old[:used].index_select(1, indices))
        else:
            pool = _static(self.layout.allocate(capacity * new_rows, self.device), self.max_cache_len is not None)
            torch.index_select(old[:used], 1, indices, out=pool.view(capacity, new_rows, *plane)[:used])
            self.pool = pool
        rebuild = new_rows != self.rows or capacity != self.capacity
        self.capacity = capacity
        if self.kv_start is not None:
            self.kv_start = self.kv_start.index_select(0, indices)
        if self.key_offset is not None:
            self.key_offset = self.key_offset.index_select(0, indices)
        for name in ("prefix_keys", "prefix_values", "recent_keys", "recent_values"):
            buffer = getattr(self, name)
            if buffer is not None:
                picked = buffer.index_select(0, indices)
                setattr(self, name, buffer.copy_(picked) if in_place else _static(picked, self.max_cache_len is not None))
        if rebuild:
            self.rows = new_rows
            self._rebuild_tables()


def _tables(rows: int, capacity: int, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The block table [rows, capacity] int32 (block * rows + row) and each row's first slot [rows] int64 (row *
    block_size: block 0, offset 0)."""
    row = torch.arange(rows, device=device, dtype=torch.int32)
    block = torch.arange(capacity, device=device, dtype=torch.int32)
    return block[None, :] * rows + row[:, None], row.long() * block_size


@functools.lru_cache(maxsize=16)
@_ordinary_tensors
def _shared_tables(rows: int, capacity: int, block_size: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """_tables for fixed-capacity layers, one pair per geometry and device, static addresses (never written)."""
    block_table, row_slots = _tables(rows, capacity, block_size, device)
    return _static(block_table), _static(row_slots)


@functools.lru_cache(maxsize=32)
def _slot_offsets(block_size: int, rows: int, device: str, width: int) -> torch.Tensor:
    """[T, width] int64: row r (a position's offset in its block) holds what the slots of the positions 0, 1, ...
    after it add to its own (TurboQuantLayer._slots: position p of a row, block p // T of the pool's rows-interleaved
    blocks, offset p % T)."""
    r, i = torch.arange(block_size)[:, None], torch.arange(width)[None, :]
    return (((r + i) // block_size) * rows * block_size + (r + i) % block_size - r).to(device)


@torch.compiler.disable
def _untraced_update(layer: TurboQuantLayer, key_states: torch.Tensor, value_states: torch.Tensor,
                     dense: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An update that settles host state (TurboQuantLayer.settles_on_host) inside a compiled region, as a manual
    compiled loop's prefill: eager, behind a graph break, as the padding, the key-centering means and the exact
    prefix bound need host logic. generate()'s compiled call runs such forwards uncompiled (a break per layer costs
    a compile per layer: TurboQuantCache.settles_on_host). A decode step never comes here."""
    return layer.update(key_states, value_states, dense=dense)


@torch.compiler.disable
def _initialize_eagerly(layer: StaticLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """A fixed-capacity dense layer's buffers allocated outside a compiled region (a manual loop's compiled prefill;
    generate()'s compiled call runs that forward uncompiled, and early-initializes the StaticCache it makes itself
    for the same reason): under tracing the layer cannot mark its buffers as static addresses, and under CUDA graph
    trees transformers 5.17's StaticLayer handed the captured chunk a buffer the graph did not own (its next launch
    failed on an H100: "Pointer argument must be either uint64 or have data_ptr method", a segfault under inductor's
    static launcher)."""
    layer.lazy_initialization(key_states, value_states)


def _static(t: torch.Tensor, static: bool = True) -> torch.Tensor:
    """Mark a fixed-capacity layer's persistent buffer as having a static address (as StaticLayer does), so CUDA
    graphs of a compiled step read and write it in place; `t` is returned."""
    if static and not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(t)
    return t


def _key_mean(key_states: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """[B, H, L, D] -> [B, H, D] float32 channel means per row (key_centering), finite whatever the input.

    real [B, L] bool: the tokens to average (left padding excluded); a row without any gets 0.
    The plain float32 mean is kept wherever it is finite; where it is not (the sum of keys near the
    float32 maximum overflows, or a NaN/inf sits among the first tokens) a mean taken at a 2**-64
    scale over the finite elements replaces it, so one bad token cannot poison the row's keys.
    """
    x = key_states.float()
    tiny = x.nan_to_num(0.0, 0.0, 0.0) * 2.0**-64
    if real is None:
        mean, scaled = x.mean(2), tiny.mean(2)
    else:
        keep = real[:, None, :, None]
        count = real.sum(-1).clamp_min(1)[:, None, None]  # [B, 1, 1]
        mean = torch.where(keep, x, 0.0).sum(2) / count
        scaled = torch.where(keep, tiny, 0.0).sum(2) / count
    return torch.where(mean.isfinite(), mean, scaled * 2.0**64)


def _in_position_order(window: torch.Tensor, first: int) -> torch.Tensor:
    """A forward window [B, H, N, D] (position p at slot p % N) in position order, from position `first`."""
    size = window.shape[2]
    return window.index_select(2, torch.arange(first, first + size, device=window.device) % size)


def _bytes(pieces) -> int:
    return sum(t.numel() * t.element_size() for piece in pieces for t in piece)


def _own_storage(x: torch.Tensor) -> torch.Tensor:
    """x itself when it spans its whole storage, else a copy: a kept slice (or a fused projection's view) must not
    keep a larger tensor alive."""
    return x if x.untyped_storage().nbytes() == x.numel() * x.element_size() else x.clone()


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """[B, H, L, D] -> [B * L, H, D] (row-major over batch then position, as _slots orders them);
    a decode step's one position is a view (one op, no copy)."""
    if x.shape[2] == 1:
        return x.select(2, 0)
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def exact_start_tokens(layout: BlockLayout, element_bytes: int) -> int:
    """compress_from_tokens=None: break_even_tokens, and at least twice the ring, so the first prefill that
    compresses (its per-layer check, its centering means) sees a ring's worth of tokens besides the ring's own
    (Gemma-3-270M k3v4, 4k tokens: compressing from 128 tokens, where an int8 ring breaks even, the check missed
    FP8 keys for layers 5 and 11 in some windows: mean KL 0.0059, against 0.0034 from 256)."""
    return max(break_even_tokens(layout, element_bytes), 2 * layout.config.recent_window)


class ExactStartLayer(DynamicLayer):
    """A compressed layer's first tokens, held exact as transformers' DynamicLayer holds them, until a forward
    takes the rows past `compress_from` tokens (TurboQuantConfig.compress_from_tokens): the owning cache then puts
    a TurboQuantLayer in its place, which takes the whole history as if it were one first prefill. Below that
    length the compressed layer's pool, prefix and ring would take more bytes than these exact tokens."""

    def __init__(self, config: TurboQuantConfig):
        super().__init__()
        self.tq_config = config
        self.compress_from = config.compress_from_tokens  # None: from exact_start_tokens at the first update

    def takes(self, new_tokens: int, layout: BlockLayout, dtype: torch.dtype) -> bool:
        """Whether a forward of `new_tokens` tokens stays within the exact start."""
        if self.compress_from is None:
            self.compress_from = exact_start_tokens(layout, self.tq_config.exact_dtype_for(dtype).itemsize)
        return self.get_seq_length() + new_tokens <= self.compress_from

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """DynamicLayer's update with the tokens kept in TurboQuantConfig.exact_dtype (the model's, or with "16bit"
        bfloat16 for a float32 model): the history comes back in the model's dtype."""
        exact = self.tq_config.exact_dtype_for(key_states.dtype)
        keys, values = super().update(key_states.to(exact), value_states.to(exact))
        return keys.to(key_states.dtype), values.to(value_states.dtype)


class TurboQuantCache(Cache):
    """A transformers Cache that stores K/V in the TurboQuant format.

    Args:
        config: the model's config (`model.config`); its text config gives layers, heads and
            head_dim, and its `_attn_implementation` decides what `update()` returns.
        preset: a preset name ("k8v4", "4bit", "k3v4", "3bit"); "4bit" when neither is given.
        tq_config: a full TurboQuantConfig instead of a preset.
        max_cache_tokens: optional bound on tokens per layer summed over the batch; exceeding it
            raises TurboQuantCacheFullError.
        max_cache_len: optional fixed capacity in tokens per row (as StaticCache's): every layer is allocated
            for it at the first update and the cache is `is_compileable`, so generate() compiles the decode
            step by itself (on CUDA) and torch.compile(model.forward, fullgraph=True) traces one graph for
            every step. Eager updates past it raise TurboQuantCacheFullError; a compiled step's compressed
            layers store no token past it (the lengths stop there), while full-precision layers, transformers'
            StaticLayer, index out of bounds as under a StaticCache. None (default): the pool grows with the tokens.
    """

    def __init__(self, config, preset: str | None = None, tq_config: TurboQuantConfig | None = None,
                 max_cache_tokens: int | None = None, max_cache_len: int | None = None):
        if tq_config is not None and preset is not None:
            raise ValueError("pass either preset or tq_config, not both")
        if tq_config is None:
            tq_config = TurboQuantConfig.from_preset("4bit" if preset is None else preset)
        elif not isinstance(tq_config, TurboQuantConfig):
            raise TypeError(f"tq_config must be a TurboQuantConfig, got {type(tq_config).__name__}")
        if max_cache_tokens is not None and (not isinstance(max_cache_tokens, int) or max_cache_tokens < 1):
            raise ValueError(f"max_cache_tokens must be a positive int or None, got {max_cache_tokens!r}")
        if max_cache_len is not None and (type(max_cache_len) is not int or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive int (tokens per row) or None, got {max_cache_len!r}")
        self.fixed_capacity = max_cache_len  # not max_cache_len: a read-only Cache property on transformers 5.17
        self.config = config
        self.tq_config = tq_config
        check_supported(config)
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self._text_config = text
        num_layers = text.num_hidden_layers
        _check_layer_types(text, num_layers)
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        self._layout = BlockLayout(tq_config, kv_heads, head_dim)
        self._max_cache_tokens = max_cache_tokens
        full_precision = tq_config.full_precision_layer_set(num_layers)
        windows = self._exact_windows = exact_sliding_windows(text, num_layers, tq_config.sliding_layers)
        layers = [
            _exact_layer(max_cache_len, windows.get(i)) if i in windows or i in full_precision
            else self._first_layer(i)
            for i in range(num_layers)
        ]
        super().__init__(layers=layers)
        self.dense_by_check: list[int] = []  # layers the first prefill's check kept dense (dense_layer_kl)
        self._reset_static: set[int] = set()  # fixed capacity: dense layers emptied by reset(), buffers kept
        self._steps_settled = False  # settles_on_host found nothing to settle since the last reset()
        if not any(_compresses(layer) for layer in layers):
            logger.warning_once(f"{self.nothing_compressed()}; it saves no memory over a DynamicCache")

    def _first_layer(self, layer_idx: int) -> CacheLayerMixin:
        """What a compressed layer starts a batch as: its exact start (compress_from_tokens), or compressed."""
        if self.fixed_capacity is None and self.tq_config.compress_from_tokens != 0:
            return ExactStartLayer(self.tq_config)
        return self._compressed_layer(layer_idx)

    def _compressed_layer(self, layer_idx: int) -> "TurboQuantLayer":
        layer = TurboQuantLayer(self._layout, self._max_cache_tokens, self.fixed_capacity)
        layer.replace_with_dense = functools.partial(self._keep_dense, layer_idx)
        return layer

    def _start_compressing(self, layer_idx: int, key_states: torch.Tensor,
                           value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx` leaves its exact start: a TurboQuantLayer takes its place and gets the exact history
        and the new tokens as one first update (so padding, centering means, prefix, ring and the per-layer check
        are settled as at any first prefill, the new tokens' queries attending at the end)."""
        start = self.layers[layer_idx]
        layer = self._compressed_layer(layer_idx)
        if start.get_seq_length():
            key_states = torch.cat([start.keys.to(key_states.dtype), key_states], dim=2)
            value_states = torch.cat([start.values.to(value_states.dtype), value_states], dim=2)
            layer.continue_run()
        self.layers[layer_idx] = layer
        return layer.update(key_states, value_states, dense=not self.attends_compressed)

    def reset(self) -> None:
        """Empty every layer; compressed layers start the next batch from their exact start again."""
        super().reset()
        self._steps_settled = False
        if self.fixed_capacity is not None:  # (its layers keep their buffers: static addresses of compiled steps)
            self._reset_static = {i for i, layer in enumerate(self.layers) if isinstance(layer, StaticLayer)}
            return
        if self.tq_config.compress_from_tokens == 0:
            return
        for i, layer in enumerate(self.layers):
            if isinstance(layer, TurboQuantLayer):
                self.layers[i] = self._first_layer(i)

    def _keep_dense(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Layer `layer_idx` from now on: transformers' own uncompressed layer, holding key/value (its history)."""
        layer = _exact_layer(self.fixed_capacity, None)
        layer.update(key_states, value_states)  # from position 0, the Dynamic- and StaticLayer alike
        self.layers[layer_idx] = layer
        self.dense_by_check.append(layer_idx)

    @property
    def fp8_keys_by_check(self) -> list[int]:
        """Layers the first prefill's check gave FP8 keys (TurboQuantConfig.sensitive_layer_keys)."""
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, TurboQuantLayer)
                and layer.layout.config.key_bits != self.tq_config.key_bits]

    def nothing_compressed(self) -> str:
        """Why no layer of this cache is compressed ("" when some are)."""
        if any(_compresses(layer) for layer in self.layers):
            return ""
        sliding = self._exact_windows
        windows = sorted(set(sliding.values()))
        reasons = []
        if sliding:
            reasons.append(f"{len(sliding)} sliding-window layers keep transformers' exact window (windows {windows} "
                           f"< {SLIDING_COMPRESS_MIN_WINDOW} tokens; sliding_layers='compressed' compresses them)")
        if len(sliding) < len(self.layers):
            reasons.append(f"{len(self.layers) - len(sliding)} layers are full_precision_layers")
        return f"TurboQuantCache compresses none of this model's {len(self.layers)} layers: " + " and ".join(reasons)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx {layer_idx!r} does not exist: this TurboQuantCache has {len(self.layers)} "
                             f"layers (0 to {len(self.layers) - 1}, from the model config it was built with)")
        layer = self.layers[layer_idx]
        if layer_idx in self._reset_static:  # a dense layer's first update after reset()
            self._reset_static.discard(layer_idx)
            if layer.is_initialized and layer.keys.shape[0] != key_states.shape[0]:
                layer.is_initialized = False  # a batch of another size: buffers of its size, as the pools take
        if not torch.compiler.is_compiling() and self._rows_held(layer_idx) is None:  # a layer (re)starting a batch:
            self._check_batch_size(layer_idx, key_states.shape[0])  # every layer must hold the same rows
        if isinstance(layer, TurboQuantLayer):
            return layer.update(key_states, value_states, dense=not self.attends_compressed)
        if isinstance(layer, ExactStartLayer) and not layer.takes(key_states.shape[2], self._layout, key_states.dtype):
            return self._start_compressing(layer_idx, key_states, value_states)
        if torch.compiler.is_compiling() and isinstance(layer, StaticLayer) and not layer.is_initialized:
            _initialize_eagerly(layer, key_states, value_states)
        return layer.update(key_states, value_states, *args, **kwargs)

    def settles_on_host(self, new_tokens: int) -> bool:
        """Whether a forward of `new_tokens` tokens per row must run uncompiled: a fixed-capacity layer's update then
        settles state on the host (TurboQuantLayer.settles_on_host), or a dense layer allocates its buffers. Compiled,
        every such layer breaks the graph inside the model's layer loop, so dynamo skips the model's frame from then
        on and compiles each layer's frames apart, one variant per layer index, until its recompile limit (the later
        chunks then run eagerly). generate()'s compiled call runs such forwards eagerly (generation.py); a manual
        compiled loop can ask the same."""
        # (a growing cache is never compiled; a one-token forward settles nothing once a scan found nothing to
        # settle, until reset(): the scan would cost every decode step ~0.3 us per layer)
        if self.fixed_capacity is None or (new_tokens == 1 and self._steps_settled):
            return False
        for i, layer in enumerate(self.layers):
            if isinstance(layer, TurboQuantLayer) and layer.settles_on_host(new_tokens):
                return True
            if isinstance(layer, StaticLayer) and (not layer.is_initialized or i in self._reset_static):
                return True  # (after reset() a batch of another size allocates anew: TurboQuantCache.update)
        self._steps_settled = True
        return False

    def get_query_offset(self, layer_idx: int = 0) -> int | torch.Tensor:
        """The new queries' first position, for HF's mask. After compiled steps a fixed-capacity layer's length
        lives on the device: it is returned there (a 0-d tensor, as StaticLayer's), so the mask that generate()
        builds before every compiled step reads nothing back from the GPU."""
        if not torch.compiler.is_compiling():  # (a traced step reads seq_lens itself: no host flag to guard on)
            layer = self.layers[layer_idx] if 0 <= layer_idx < len(self.layers) else None
            if isinstance(layer, TurboQuantLayer) and layer._length_on_device:
                return layer.seq_lens[0]
        return super().get_query_offset(layer_idx)

    def _check_batch_size(self, layer_idx: int, rows: int) -> None:
        """Runs on prefill only (an empty layer): one Python pass over the layers."""
        for i in range(len(self.layers)):
            held = self._rows_held(i)
            if i != layer_idx and held is not None and held != rows:
                raise ValueError(
                    f"layer {layer_idx} got a batch of {rows} rows but layer {i} of this TurboQuantCache holds "
                    f"{held}; every layer must hold the same batch (call reset() to start a new one)"
                )

    def _rows_held(self, layer_idx: int) -> int | None:
        """Batch size of a non-empty layer (compressed or dense), else None; no device read (a static layer counts
        as holding rows once allocated, until reset() empties it: its buffers stay for the next batch)."""
        layer = self.layers[layer_idx]
        if isinstance(layer, TurboQuantLayer):
            return layer.rows if layer.length else None
        if isinstance(layer, StaticLayer):
            return layer.keys.shape[0] if layer.is_initialized and layer_idx not in self._reset_static else None
        return layer.keys.shape[0] if layer.get_seq_length() else None

    @property
    def attends_compressed(self) -> bool:
        """Whether the model runs the "turboquant" attention (read now: set_attn_implementation may change it)."""
        impl = _attn_implementation(self._text_config)
        if impl is None:
            impl = _attn_implementation(self.config)
        return impl == ATTENTION_NAME

    # ---- reports --------------------------------------------------------------------------------
    def memory_footprint(self) -> int:
        """Bytes allocated for K/V now: compressed pools plus full-precision layers."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, TurboQuantLayer):
                total += layer.memory_footprint()
            elif layer.is_initialized and layer.keys is not None:
                total += layer.keys.numel() * layer.keys.element_size()
                total += layer.values.numel() * layer.values.element_size()
        return total

    def fp16_equivalent_bytes(self) -> int:
        """What an fp16 DynamicCache would hold for the same tokens in every layer."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, TurboQuantLayer):
                total += 2 * 2 * layer.rows * layer.length * layer.layout.num_kv_heads * layer.layout.head_dim
            elif layer.is_initialized and layer.keys is not None:
                total += 2 * 2 * layer.keys.numel()
        return total

    def summary(self) -> str:
        """One line: layers, tokens, bytes allocated vs an fp16 cache of the same tokens."""
        compressed = sum(_compresses(layer) for layer in self.layers)
        used, fp16 = self.memory_footprint(), self.fp16_equivalent_bytes()
        ratio = f"{used / fp16:.3f}x" if fp16 else "n/a"
        cfg = self.tq_config
        if not compressed:
            return f"{self.nothing_compressed()}; {used / 2**20:.2f} MiB allocated ({ratio} of fp16)"
        layers = [layer for layer in self.layers if isinstance(layer, TurboQuantLayer)]
        pool, side = sum(l.pool_bytes() for l in layers), sum(l.exact_side_bytes() for l in layers)
        starting = [layer for layer in self.layers if isinstance(layer, ExactStartLayer)]
        fp8 = self.fp8_keys_by_check
        checked = [f"{len(self.dense_by_check)} kept dense"] if self.dense_by_check else []
        checked += [f"{len(fp8)} with FP8 keys"] if fp8 else []
        checked = f" ({' and '.join(checked)} by the first prefill's check)" if checked else ""
        ring = f"{cfg.recent_window} ring tokens{' as int8 records' if cfg.ring_records else ''}"
        parts = [f"compressed pool {pool / 2**20:.2f} MiB + exact prefix/ring {side / 2**20:.2f} MiB "
                 f"(a constant {cfg.exact_prefix_tokens} prefix + {ring} per row and layer)"] if layers else []
        if starting:
            exact = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in starting if layer.keys is not None)
            begins = sorted({layer.compress_from for layer in starting if layer.compress_from is not None})
            when = f", compressed from {'/'.join(map(str, begins))} tokens per row" if begins else ""
            parts.append(f"{len(starting)} layers still exact {exact / 2**20:.2f} MiB (compress_from_tokens{when})")
        return (
            f"TurboQuantCache k{cfg.key_bits}v{cfg.value_bits}: {compressed}/{len(self.layers)} layers compressed{checked}, "
            f"{self.get_seq_length()} tokens/row, {used / 2**20:.2f} MiB allocated vs {fp16 / 2**20:.2f} MiB fp16 "
            f"({ratio}): {' + '.join(parts)}"
        )

    def __repr__(self) -> str:
        return self.summary()


def _compresses(layer: CacheLayerMixin) -> bool:
    """A compressed layer, or one still in its exact start."""
    return isinstance(layer, (TurboQuantLayer, ExactStartLayer))


def _attn_implementation(config) -> str | None:
    """config._attn_implementation, read past transformers' attribute hooks where it can be (every update reads it:
    the hooks cost ~5 us per read at B=1)."""
    if not torch.compiler.is_compiling():  # (dynamo cannot trace object.__getattribute__)
        stored = object.__getattribute__(config, "__dict__")
        if "_attn_implementation_internal" in stored:
            return stored["_attn_implementation_internal"]
    return getattr(config, "_attn_implementation", None)


class _CroppableStaticLayer(StaticLayer):
    """transformers' StaticLayer with the crop of 5.18+ (5.17's has none: assisted decoding crops)."""

    is_croppable = True

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise RuntimeError("Static layers can only be cropped by passing a negative int, to specify how many "
                               "tokens to remove")
        self.cumulative_length.sub_(abs(tokens_to_remove))  # in place: a static address


_STATIC_LAYER = StaticLayer if hasattr(StaticLayer, "crop") else _CroppableStaticLayer


def _exact_layer(max_cache_len: int | None, sliding_window: int | None) -> CacheLayerMixin:
    """An uncompressed layer (full_precision_layers, or a sliding-window layer kept exact): transformers' own,
    static when the cache has a fixed capacity."""
    if max_cache_len is None:
        return DynamicLayer() if sliding_window is None else DynamicSlidingWindowLayer(sliding_window=sliding_window)
    if sliding_window is None:
        return _STATIC_LAYER(max_cache_len=max_cache_len)
    return StaticSlidingWindowLayer(max_cache_len=max_cache_len, sliding_window=sliding_window)


def sliding_windows(text_config, num_layers: int) -> dict[int, int]:
    """{layer index: window} of the sliding-window layers, as transformers' DynamicCache reads them:
    config.layer_types when given, else every layer when config.sliding_window is set."""
    window = getattr(text_config, "sliding_window", None)
    if not window:
        return {}
    types = getattr(text_config, "layer_types", None) or ["sliding_attention"] * num_layers
    return {i: window for i in range(num_layers) if types[i] == "sliding_attention"}


def exact_sliding_windows(text_config, num_layers: int, mode: str) -> dict[int, int]:
    """{layer index: window} of the sliding-window layers kept exact (window-sized) under `mode`."""
    windows = sliding_windows(text_config, num_layers)
    if mode == "compressed":
        return {}
    if mode == "auto":
        return {i: w for i, w in windows.items() if w < SLIDING_COMPRESS_MIN_WINDOW}
    return windows


def _check_layer_types(text_config, num_layers: int) -> None:
    types = getattr(text_config, "layer_types", None)
    if types is None:
        if getattr(text_config, "attention_chunk_size", None) is not None:
            raise ValueError("TurboQuantCache does not support chunked attention (attention_chunk_size)")
        return
    unsupported = sorted(set(types) - set(ATTENTION_LAYER_TYPES))
    if unsupported:
        raise ValueError(
            f"TurboQuantCache supports layer types {ATTENTION_LAYER_TYPES}; this model also has {unsupported}"
        )
    if len(types) < num_layers:
        raise ValueError(f"config.layer_types lists {len(types)} layers but the model has {num_layers}")


__all__ = ["TurboQuantCache", "TurboQuantCacheFullError", "TurboQuantLayer", "LayerStep", "ATTENTION_NAME",
           "STEP_ATTRIBUTE"]
