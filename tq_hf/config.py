"""TurboQuantConfig: the format of the compressed KV cache, and its presets.

Pure data and arithmetic: no tensors, no devices. Every byte size of the format is derived
here from the bit widths, so layout, kernels and memory reports can never disagree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

KEY_BITS = (3, 4, 8)  # 3/4: Lloyd-Max codebook over rotated coordinates; 8: FP8 e4m3 keys
VALUE_BITS = (3, 4)  # per-token asymmetric uniform codes
ROTATIONS = ("hadamard", "random")
BLOCK_SIZES = (16, 32, 64)
SLIDING_LAYER_MODES = ("auto", "exact", "compressed")
# sliding_layers="auto" compresses a sliding-window layer whose window is at least this long: a
# compressed layer (0.26-0.39x fp16 per token, every position kept) stays smaller than the exact
# window up to ~2.5-3.8x the window, 10k-15k tokens here; shorter windows (Gemma 3's 512-1024,
# gpt-oss's 128) are outgrown within a few thousand tokens and stay exact.
SLIDING_COMPRESS_MIN_WINDOW = 4096
SENSITIVE_LAYER_KEYS = ("fp8", "dense")  # TurboQuantConfig.sensitive_layer_keys
PREFILL_MODES = ("exact", "compressed")
EXACT_DTYPES = ("model", "16bit")  # TurboQuantConfig.exact_dtype
RECENT_FORMATS = ("auto", "int8", "exact")  # TurboQuantConfig.recent_format
HEAD_DIM_MULTIPLE = 16  # keeps every packed row a whole number of bytes and tiles 16-aligned
HEAD_DIM_RANGE = (32, 256)
MAX_RECENT_WINDOW = 4096  # exact most-recent tokens per row (a dense ring buffer)
MAX_EXACT_PREFIX = 64  # exact leading tokens per row (a dense side buffer read as one small tile)

# One 16-bit (bfloat16) field each per (token, KV head). bfloat16, not float16: activations of
# bf16 models exceed 65504, and the format must not turn them into inf.
METADATA_FIELDS = ("key_scale", "value_scale", "value_mid")
METADATA_FIELD_BYTES = 2

# The fidelity levers' defaults (value rotation, 4 exact leading tokens, a 128-token exact ring,
# per-row key centering, no full-precision layers, the first prefill's per-layer check) were chosen
# by measurement (docs/performance.md, eval/results/levers/). FP8 keys center too: without it the
# k_proj biases of Qwen2.5 move two layers' attention by 0.55 and 0.91 nats (0.014 at most with it).
PRESETS: dict[str, dict[str, int | bool]] = {
    "k8v4": {"key_bits": 8, "value_bits": 4},
    "4bit": {"key_bits": 4, "value_bits": 4},
    "k3v4": {"key_bits": 3, "value_bits": 4},
    "3bit": {"key_bits": 3, "value_bits": 3},
}


def supported_head_dims() -> str:
    lo, hi = HEAD_DIM_RANGE
    return f"multiples of {HEAD_DIM_MULTIPLE} from {lo} to {hi}"


@dataclass(frozen=True)
class TurboQuantConfig:
    """How keys and values are compressed.

    key_bits: 3 or 4 (rotation + Lloyd-Max codebook + one per-token scale) or 8 (FP8 e4m3
        with a per-token scale, no rotation).
    value_bits: 3 or 4 (per-token asymmetric uniform quantization: a midpoint and a scale).
    norm_correction: store ||k|| / ||codebook vector|| so dequantized keys keep their norm.
    rotation: "hadamard" (randomized Walsh-Hadamard, power-of-two head_dim; the GPU decode builds it in
        registers instead of reading it: 4bit S=32k B=1 9% faster on an H200) or "random" (seeded
        Haar-orthogonal matrix, any supported head_dim).
    block_size: tokens per cache block (page); 16, 32 or 64, or None (the default): the layout picks it
        per head_dim (layout.default_block_size: 64 at head_dim 128, 16 elsewhere, as measured fastest).
    full_precision_layers: layer indices kept in an ordinary dense cache (negative indices count
        from the end), e.g. (0, 1, -2, -1) for the first and last two, which the field found
        necessary at low bit widths without the levers below. Default (): on SmolLM2 they bought
        nothing once the levers were on, and cost 0.37x instead of 0.27x of fp16 bytes.
    key_centering: subtract a per-(layer, row, KV head) channel mean, measured on the row's first
        `recent_window` real tokens (those of its first update when recent_window is 0), from keys before
        quantizing. Softmax is invariant to
        the constant q . mean term, so attention needs no correction (except with attention sinks
        or softcapping, where it is added back); it removes the large per-channel key biases
        that dominate the quantization error. Per row, so rows never depend on each other.
    value_rotation: rotate values before quantizing them (outliers spread over all channels);
        the inverse rotation is applied once to the attention output.
    exact_prefix_tokens: the first real tokens of every row (attention sinks: they draw a large
        share of every query's attention) are also kept exact, in the model's dtype, and read
        from there by attention; 0 turns it off.
    recent_window: the most recent tokens of every row are also kept, in a ring buffer of this many
        tokens (recent_format), and read from there by attention (as HF's QuantizedCache keeps its
        residual); 0 turns it off. A constant, not a per-token, cost.
    recent_format: how the ring keeps its tokens. "int8": each token's key and value per KV head as int8 records
        (layout.ring_record_bytes: 0.56x a 16-bit vector's bytes at head_dim 128), a bfloat16 scale per 16 elements,
        keys less their key_centering mean, so 4bit holds 0.34x of fp16 at 1k tokens instead of 0.39x, and 0.28x
        instead of 0.32x at 4k in float32. "exact": in exact_dtype. "auto" (default): "int8" for codebook keys
        (4bit, k3v4, 3bit), whose own rounding dwarfs the records' (4k tokens, perplexity vs fp16 within 0.01-0.03
        points of the exact ring's); "exact" for FP8 keys (k8v4), whose attention is close enough to fp16 that the
        records would still show (Qwen2.5-0.5B KL +32%, simulated; docs/performance.md, "The ring in int8 records").
        While a row's key_centering means settle over several forwards (a prompt fed in chunks shorter than the
        ring), the history those forwards store again comes from the records.
    chunk_history_tokens: a forward of several tokens that follows another such forward (a prompt prefilled in
        chunks, generate(prefill_chunk_size=...), assisted decoding's verification forwards) attends the latest
        history tokens from the earlier forwards' own K/V (in the model's dtype; int8 records, their keys centered by
        a mean of their own, for a float32 model whose ring holds records: tq_hf.cache.history_as_records), besides
        its own tokens; older history from the pool as decode reads it. Without it a chunk attends the ring's tokens
        exactly and the rest compressed, and 3-bit keys then move the prompt's later positions: SmolLM2 in float32, 8
        prompts of 1000 tokens fed in chunks of 32 or 256, decode KL 1.21-1.34x one prefill's for k3v4 and 3bit;
        1.07-1.17x with the default (docs/performance.md). Decode never reads it; the layer holds those K/V until the
        next one-token step, a crop or a change of rows (memory_footprint counts them). None (default): up to 512
        tokens, kept from a run's second forward on (a prompt fed in one forward keeps none), or from the forward that
        leaves the exact start (compress_from_tokens) with the exact start's tokens, as many as keep the layer within a
        dense layer's bytes of its tokens in exact_dtype (tq_hf.cache.chunk_history_room: at head_dim 128, more than the
        ring's 128 from 273-471 tokens per row and 512 from 754-1,102 in a 16-bit model; in a float32 one 204-227 and
        474-520 for the codebook presets' records, 684 and 1,945 for k8v4), so a cache never holds more than a
        DynamicCache. An int: that many from a run's first forward, whatever the bytes (a prompt of a few hundred tokens
        fed in one forward then holds more than a dense cache until its first decode step); 0 or at most recent_window:
        the ring's tokens only.
    sliding_layers: what sliding-window layers (Gemma 2/3, gpt-oss, Mistral's window) keep.
        "auto" (default): "compressed" for windows of at least SLIDING_COMPRESS_MIN_WINDOW (4096)
        tokens (Mistral-7B-v0.1, Starcoder2, windows longer than the context), else "exact".
        "exact": HF's own window-sized dense layer, as DynamicCache keeps it: memory bounded by
        the window, no quantization error, and the format's savings come from the full-attention
        layers, the only ones that grow with the context. "compressed": every position,
        compressed, the window applied by attention (smaller than the window's fp16 bytes only
        while the context is under ~4x the window, and it keeps growing after that).
    prefill_attention: "exact" lets a first prefill attend over the prompt's own keys and
        values (they are compressed into the cache all the same); "compressed" makes it read
        the compressed cache, as decode always does.
    dense_layer_kl: at a layer's first prefill the attention measures how far quantized keys move
        its attention (tq_hf.sensitivity: the KL of the prompt's last queries, in nats); a layer
        above this keeps its K/V dense from then on, for the cache's lifetime. Most layers of most
        models stay below 0.1; Qwen2.5's first layer reaches 4-18 (its keys' norm is ~15x the
        others'). None: no check.
    sensitive_layer_keys: what a layer above dense_layer_kl gets. "fp8": FP8 keys with 4-bit values (the k8v4
        format, 2.6x fewer bytes than dense at head_dim 64) where FP8 keys keep its attention within a fifth
        of dense_layer_kl, as close as ordinary layers' keys keep theirs (Qwen2.5-Coder-0.5B's first layer:
        0.01 nats), else dense; "dense": dense at once. Presets with FP8 keys go dense.
    compress_from_tokens: a layer of a growing cache (no max_cache_len) keeps its rows' first tokens exact, as
        an ordinary dense layer, and compresses them all once a forward takes it past this many tokens per row.
        None (default): the least length from which the compressed layer (pool, growth slack, exact prefix and
        ring) never holds more bytes than the same tokens dense in exact_dtype (tq_hf.cache.break_even_tokens:
        127 at head_dim 128 for 4bit in 16 bits), and at least twice recent_window (256), so a cache is never larger
        than a DynamicCache of that dtype, short conversations attend exactly, and the first prefill that compresses
        (its per-layer check, its centering means) sees more than the ring's tokens (tq_hf.cache.exact_start_tokens). 0: compress from the first token. A fixed-capacity cache always compresses
        from the first token (its buffers are allocated once, for compiled steps).
    exact_dtype: the dtype of the tokens kept exact (the exact start, prefix and an exact ring). "16bit" (default):
        the model's when it is 16-bit, else bfloat16, so a float32 model's cache never holds more than an fp16
        cache's bytes (float32's range kept; 8 mantissa bits: SmolLM2 in float32, 4k tokens, perplexity vs fp16
        within 0.04 points of "model"'s for every preset; docs/performance.md). "model": the model's dtype (a
        float32 model's exact start then costs 2x an fp16 cache's). A forward's own tokens are attended in the
        model's dtype either way.
    seed: seeds the rotation.
    """

    key_bits: int = 4
    value_bits: int = 4
    norm_correction: bool = True
    rotation: str = "hadamard"
    block_size: int | None = None
    full_precision_layers: tuple[int, ...] = ()
    key_centering: bool = True
    value_rotation: bool = True
    exact_prefix_tokens: int = 4
    recent_window: int = 128
    recent_format: str = "auto"
    chunk_history_tokens: int | None = None
    sliding_layers: str = "auto"
    prefill_attention: str = "exact"
    dense_layer_kl: float | None = 0.5
    sensitive_layer_keys: str = "fp8"
    compress_from_tokens: int | None = None
    exact_dtype: str = "16bit"
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "full_precision_layers", tuple(self.full_precision_layers))
        _check_choice("key_bits", self.key_bits, KEY_BITS)
        _check_choice("value_bits", self.value_bits, VALUE_BITS)
        _check_choice("rotation", self.rotation, ROTATIONS)
        if self.block_size is not None and (self.block_size not in BLOCK_SIZES or type(self.block_size) is not int):
            raise ValueError(f"block_size={self.block_size!r} is not supported; supported values: "
                             f"{', '.join(map(repr, BLOCK_SIZES))}, or None (chosen per head_dim)")
        _check_choice("prefill_attention", self.prefill_attention, PREFILL_MODES)
        _check_choice("sliding_layers", self.sliding_layers, SLIDING_LAYER_MODES)
        _check_choice("sensitive_layer_keys", self.sensitive_layer_keys, SENSITIVE_LAYER_KEYS)
        _check_choice("exact_dtype", self.exact_dtype, EXACT_DTYPES)
        _check_choice("recent_format", self.recent_format, RECENT_FORMATS)
        for flag in ("norm_correction", "key_centering", "value_rotation"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in self.full_precision_layers):
            raise ValueError(
                f"full_precision_layers must be integer layer indices, got {self.full_precision_layers!r}"
            )
        if not (type(self.exact_prefix_tokens) is int and 0 <= self.exact_prefix_tokens <= MAX_EXACT_PREFIX):
            raise ValueError(
                f"exact_prefix_tokens must be an int from 0 to {MAX_EXACT_PREFIX}, got {self.exact_prefix_tokens!r}"
            )
        if not (type(self.recent_window) is int and 0 <= self.recent_window <= MAX_RECENT_WINDOW):
            raise ValueError(f"recent_window must be an int from 0 to {MAX_RECENT_WINDOW}, got {self.recent_window!r}")
        history = self.chunk_history_tokens
        if history is not None and not (type(history) is int and 0 <= history <= MAX_RECENT_WINDOW):
            raise ValueError(f"chunk_history_tokens must be None (what fits in a dense cache's bytes) or an int from 0 "
                             f"to {MAX_RECENT_WINDOW}, got {history!r}")
        kl = self.dense_layer_kl
        if kl is not None and (isinstance(kl, bool) or not isinstance(kl, (int, float)) or not kl > 0):
            raise ValueError(f"dense_layer_kl must be a positive number of nats or None (no check), got {kl!r}")
        start = self.compress_from_tokens
        if start is not None and not (type(start) is int and start >= 0):
            raise ValueError(f"compress_from_tokens must be an int >= 0 (tokens per row) or None (from the length at "
                             f"which compressing saves memory), got {start!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides) -> "TurboQuantConfig":
        """A preset ("k8v4", "4bit", "k3v4", "3bit") with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; supported presets: {', '.join(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - fields
        if unknown:
            raise ValueError(f"unknown TurboQuantConfig fields {sorted(unknown)}; fields: {sorted(fields)}")
        return cls(**{**PRESETS[name], **overrides})

    # ---- derived facts ----------------------------------------------------------------------
    @property
    def uses_codebook(self) -> bool:
        """Keys go through rotation + Lloyd-Max codebook (else FP8)."""
        return self.key_bits in (3, 4)

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError if this format cannot hold heads of `head_dim`."""
        lo, hi = HEAD_DIM_RANGE
        if not (lo <= head_dim <= hi and head_dim % HEAD_DIM_MULTIPLE == 0):
            raise ValueError(f"head_dim {head_dim} is not supported; supported: {supported_head_dims()}")
        rotates = self.uses_codebook or self.value_rotation
        if rotates and self.rotation == "hadamard" and head_dim & (head_dim - 1):
            raise ValueError(
                f"rotation='hadamard' needs a power-of-two head_dim, got {head_dim}; "
                "use rotation='random' for this model"
            )

    def full_precision_layer_set(self, num_layers: int) -> frozenset[int]:
        """Resolve (possibly negative) full_precision_layers for a model of `num_layers`."""
        out = set()
        for i in self.full_precision_layers:
            j = i + num_layers if i < 0 else i
            if not 0 <= j < num_layers:
                raise ValueError(
                    f"full_precision_layers entry {i} is out of range for a model with {num_layers} layers"
                )
            out.add(j)
        return frozenset(out)

    # ---- byte sizes: the only place they are computed ---------------------------------------
    def key_code_bytes(self, head_dim: int) -> int:
        """Packed key codes of one (token, head)."""
        return head_dim * self.key_bits // 8

    def value_code_bytes(self, head_dim: int) -> int:
        """Packed value codes of one (token, head)."""
        return head_dim * self.value_bits // 8

    @property
    def metadata_bytes(self) -> int:
        """16-bit metadata fields of one (token, head)."""
        return len(METADATA_FIELDS) * METADATA_FIELD_BYTES

    def token_head_bytes(self, head_dim: int) -> int:
        """Everything one (token, KV head) costs in the cache."""
        return self.key_code_bytes(head_dim) + self.value_code_bytes(head_dim) + self.metadata_bytes

    def fp8_key_fallback(self) -> "TurboQuantConfig | None":
        """The format a layer above dense_layer_kl tries before going dense (sensitive_layer_keys): FP8 keys with
        4-bit values and this config's levers; None when it goes dense at once."""
        if self.sensitive_layer_keys != "fp8" or self.key_bits == 8:
            return None
        return dataclasses.replace(self, key_bits=8, value_bits=4)

    @property
    def ring_records(self) -> bool:
        """Whether the ring holds int8 records (recent_format, "auto" resolved), else exact tokens."""
        return self.recent_format == "int8" or (self.recent_format == "auto" and self.uses_codebook)

    def exact_dtype_for(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the exact tokens of a model of `model_dtype` are kept in (exact_dtype)."""
        if self.exact_dtype == "model" or model_dtype in (torch.float16, torch.bfloat16):  # (16bit: 16-bit as is)
            return model_dtype
        return torch.bfloat16

    def compression_vs_fp16(self, head_dim: int) -> float:
        """Compressed bytes / fp16 bytes for keys and values of one (token, head)."""
        return self.token_head_bytes(head_dim) / (2 * 2 * head_dim)


def _check_choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed or type(value) is not type(allowed[0]):  # 4.0 == 4 and True == 1 are not sizes
        raise ValueError(f"{name}={value!r} is not supported; supported values: {', '.join(map(repr, allowed))}")
