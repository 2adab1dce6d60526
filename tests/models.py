"""Tiny random-init models of each supported family, and the fake-quantized DynamicCache that
TurboQuantCache must match exactly (shared by test_cache, test_attention and test_generate)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402
from transformers.cache_utils import DynamicLayer  # noqa: E402

import tq_hf  # noqa: E402,F401  (registers "turboquant")
from tq_hf import reference  # noqa: E402
from tq_hf.cache import chunk_history_room, exact_sliding_windows  # noqa: E402
from tq_hf.config import TurboQuantConfig  # noqa: E402
from tq_hf.layout import BlockLayout, value_planes  # noqa: E402

# Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine thread hand-offs
# made each forward ~100x slower (12.6 s vs 0.1 s for one 10-token generate).
torch.set_num_threads(1)

VOCAB = 96
WINDOW = 6  # sliding window short enough that test prompts exceed it
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.15,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
_ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention"]


def _config(family: str):
    from transformers import (Gemma2Config, Gemma3TextConfig, GptOssConfig, LlamaConfig, MistralConfig,
                              Qwen2Config)

    if family == "llama":
        return LlamaConfig(**_COMMON)
    if family == "mistral":
        return MistralConfig(**_COMMON, sliding_window=WINDOW)
    if family == "qwen2":  # q/k/v projections carry biases
        return Qwen2Config(**_COMMON)
    if family == "gemma2":  # softcapped logits, query_pre_attn_scalar != head_dim, sliding + global layers
        return Gemma2Config(**_COMMON, sliding_window=WINDOW, attn_logit_softcapping=20.0,
                            final_logit_softcapping=30.0, query_pre_attn_scalar=20, layer_types=_ALTERNATING)
    if family == "gemma3":
        return Gemma3TextConfig(**_COMMON, sliding_window=WINDOW, query_pre_attn_scalar=20,
                                layer_types=_ALTERNATING)
    if family == "gpt_oss":  # attention sinks (s_aux), sliding + full layers, MoE
        cfg = dict(_COMMON, intermediate_size=64)
        return GptOssConfig(**cfg, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                            layer_types=_ALTERNATING)
    raise ValueError(f"unknown family {family!r}")


FAMILIES = ("llama", "mistral", "qwen2", "gemma2", "gemma3", "gpt_oss")


def tiny_model(family: str, attn: str = "turboquant", dtype=torch.float32, device="cpu", seed: int = 0,
               layers: int | None = None):
    """A tiny random-init causal LM (fp32 by default), in eval mode, deterministic per seed; `layers`: another
    layer count than the 3 (families without layer_types)."""
    config = _config(family)
    if layers is not None:
        config.num_hidden_layers = layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    if family == "gpt_oss":  # sinks init to zero-ish; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    if hasattr(model.config, "qwen2") or family == "qwen2":
        with torch.no_grad():  # biases start at zero; give them real values
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # fixed-length outputs: rows compare position by position
    return model.to(device).eval()


# The base format without the fidelity levers, for tests that check one mechanism in isolation.
PLAIN_LEVERS = dict(key_centering=False, value_rotation=False, exact_prefix_tokens=0, recent_window=0)


def tq_config(**overrides) -> TurboQuantConfig:
    """4bit with the middle layer of the 3 compressed and the last kept dense (both kinds exercised).

    The levers stay on, with a ring and prefix small enough for tiny prompts to reach the pool. The ring is exact
    (recent_format "exact"): an int8 ring's codes flip at rounding boundaries under fp32 noise between the cache's
    and the oracle's forwards (~1e-3 in the logits), which the oracle tests' tolerance would have to absorb; the
    int8 ring has its own tests with that tolerance. The exact tokens stay in the model's dtype (exact_dtype "model"):
    the oracle holds the history exactly, so bfloat16 exact starts of float32 models have their own tests.
    Sliding-window layers are compressed too (the harder path: the window applied over the pool);
    the default, window-sized exact sliding layers, has its own tests.
    """
    levers = dict(exact_prefix_tokens=2, recent_window=4, sliding_layers="compressed", recent_format="exact",
                  exact_dtype="model")
    return TurboQuantConfig.from_preset(overrides.pop("preset", "4bit"), full_precision_layers=(-1,),
                                        **{**levers, **overrides})


# ---- the independent reference: DynamicCache with quantize-dequantized K/V -----------------------
def fake_quantize(key: torch.Tensor, value: torch.Tensor, cfg: TurboQuantConfig, key_offset=None):
    """What the compressed cache reconstructs for these K/V [B, H, L, D] (float32).

    key_offset: the key_centering mean, [H, D] shared or [B, H, D] per row (None: no centering).
    """
    d = key.shape[-1]
    offset = None if key_offset is None else key_offset[:, None, :] if key_offset.dim() == 2 else key_offset[:, :, None, :]
    v_rot = reference.value_rotation_matrix(cfg, d)
    k_codes, k_scale = reference.quantize_keys(key, cfg, offset)
    planes = value_planes(cfg, d)
    v_codes, v_scale, v_mid = reference.quantize_values(value, cfg.value_bits, v_rot, planes)
    return (reference.dequantize_keys(k_codes, k_scale, cfg, d, offset),
            reference.dequantize_values(v_codes, v_scale, v_mid, cfg.value_bits, d, v_rot, planes))


class FakeQuantLayer(DynamicLayer):
    """Holds the exact history and returns what TurboQuantCache reconstructs from it: every position
    quantize-dequantized with the row's current key_centering means, the exact prefix (positions
    kv_start[b] + s, s < P), and the exact ring (the last W positions; for a forward of several tokens over
    a non-empty history, the W positions before it and its own tokens). A first prefill in "exact" mode
    attends over its own K/V. A forward of several tokens right after others (a run of such forwards, unbroken by a
    one-token forward, a crop or a row change) attends the positions the run kept instead of the ring's, once they
    are at least the ring's W: after each forward of the run, the latest min(size, kept before + its tokens), size
    being chunk_history_tokens, or with None chunk_history_room of the tokens then held (none after the run's first
    forward); as int8 records where the ring holds records and the model is float32 (their keys centered by the mean
    of the keys of the run's first forward that kept any), else as they came.

    The means (the spec, independent of cache.py): each row's real positions [kv_start, kv_start + W)
    that have arrived (W = recent_window), whatever forwards they came in; without a ring (W = 0), the real
    tokens of the first update. (A growing cache: a fixed-capacity one settles them at its first update.)
    """

    def __init__(self, cfg: TurboQuantConfig, cache: "FakeQuantCache"):
        super().__init__()
        self.cfg = cfg
        self.cache = cache
        self.key_offset = None
        self.recent_from = 0
        self.settles_means = cfg.recent_window > 0
        # the current run of forwards of several tokens: (first, end, tokens kept after it, what it may keep)
        self.run = None
        self.run_offset = None  # int8-record history: the mean of the keys of the run's first forward that kept any

    def update(self, key_states, value_states, *args, **kwargs):
        start = self.get_seq_length()
        new = key_states.shape[2]
        keys, values = super().update(key_states, value_states)  # the exact history
        rows, length = keys.shape[0], keys.shape[2]
        first_real = self.cache.kv_start_for(rows).to(keys.device)
        pos = torch.arange(length, device=keys.device)
        if self.cfg.key_centering and (self.settles_means or self.key_offset is None):
            real = pos[None, :] >= first_real[:, None]
            if self.settles_means:
                real &= pos[None, :] < first_real[:, None] + self.cfg.recent_window
            weights = real[:, None, :, None]
            means = torch.where(weights, keys.float(), 0.0).sum(2) / weights.sum(2).clamp_min(1)
            if self.key_offset is not None:  # rows complete before this update keep their means
                done = (first_real + self.cfg.recent_window <= start)[:, None, None]
                means = torch.where(done, self.key_offset, means)
            self.key_offset = means
        k, v = fake_quantize(keys.cpu(), values.cpu(), self.cfg, None if self.key_offset is None else self.key_offset.cpu())
        k, v = k.to(keys.device, keys.dtype), v.to(keys.device, values.dtype)
        # the prefix and ring hold the exact tokens in cfg.exact_dtype (bfloat16 for a float32 model); a forward's
        # own tokens are attended as they are
        held_k, held_v = (x.to(self.cfg.exact_dtype_for(x.dtype)).to(x.dtype) for x in (keys, values))
        k = _prefix_from(k, held_k, first_real, self.cfg.exact_prefix_tokens)
        v = _prefix_from(v, held_v, first_real, self.cfg.exact_prefix_tokens)
        forward_window = start > 0 and new > 1 and self.cfg.prefill_attention == "exact"
        exact_from = None  # where the run's kept tokens begin, when this forward attends them
        layout = BlockLayout(self.cfg, keys.shape[1], keys.shape[3])
        room = lambda n: chunk_history_room(layout, n, self.cfg.exact_dtype_for(keys.dtype).itemsize,
                                            keys.element_size())
        size = self.cfg.chunk_history_tokens
        offset = self.run_offset  # (the history this forward reads was kept with it)
        if new > 1 and self.run is not None and self.run[1] == start:
            held, size_then = self.run[2], self.run[3]
            if forward_window and size_then > self.cfg.recent_window and held >= max(self.cfg.recent_window, 1):
                exact_from = start - held
            keep = room(start + new) if size is None else size  # the spec's room (within a dense layer's bytes)
            self.run = (self.run[0], start + new, min(keep, held + new), keep)
        else:  # a run's first forward: chunk_history_tokens=None keeps none of it
            keep = 0 if size is None else size
            self.run = (start, start + new, min(keep, new), keep) if new > 1 else None
            self.run_offset = None
        if self.run is not None and self.run[2] > 0 and self.run_offset is None:
            self.run_offset = key_states.float().mean(2, keepdim=True)
        lo = max(self.recent_from, (start if forward_window else length) - self.cfg.recent_window)
        if self.cfg.recent_window or forward_window:
            # the ring: int8 records of the tokens as given (recent_format "int8"), or the exact tokens
            mean = None if self.key_offset is None else self.key_offset.to(keys.device)[:, :, None, :]
            ring_k, ring_v = ((ring_round_trip(keys[:, :, lo:], mean), ring_round_trip(values[:, :, lo:]))
                              if self.cfg.ring_records else (held_k[:, :, lo:], held_v[:, :, lo:]))
            k[:, :, lo:], v[:, :, lo:] = ring_k, ring_v
        if exact_from is not None:  # the run's kept history
            hist_k, hist_v = keys[:, :, exact_from:start], values[:, :, exact_from:start]
            if self.cfg.ring_records and keys.element_size() > 2:  # (int8 records for a float32 model's history)
                hist_k, hist_v = ring_round_trip(hist_k, offset), ring_round_trip(hist_v)
            k[:, :, exact_from:start], v[:, :, exact_from:start] = hist_k, hist_v
        if forward_window:
            k[:, :, start:], v[:, :, start:] = keys[:, :, start:], values[:, :, start:]
        if start == 0 and self.cfg.prefill_attention == "exact":
            return key_states, value_states
        return k, v

    def crop(self, max_length):
        self.run = None
        if self.cfg.recent_window:
            self.recent_from = max(self.recent_from, self.get_seq_length() - self.cfg.recent_window)
        super().crop(max_length)

    def reorder_cache(self, beam_idx):
        self.run = None
        super().reorder_cache(beam_idx)
        self._select_offsets(beam_idx)

    def batch_repeat_interleave(self, repeats: int):
        self.run = None
        super().batch_repeat_interleave(repeats)
        if self.key_offset is not None:
            self.key_offset = self.key_offset.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices):
        self.run = None
        super().batch_select_indices(indices)
        self._select_offsets(indices)

    def _select_offsets(self, indices):
        if self.key_offset is not None:  # one key_centering mean per row: rows carry theirs
            self.key_offset = self.key_offset[indices.to(self.key_offset.device)]


def ring_round_trip(x: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """x as an int8 ring record holds it (the spec, independent of the kernels): y = x - offset (a key's
    key_centering mean), per 16 elements round(y / s) * s with s = absmax / 127 rounded up to a bfloat16, + offset,
    in x's dtype."""
    y = x.float() - (0.0 if offset is None else offset.float())
    groups = y.unflatten(-1, (-1, 16))
    s = groups.abs().amax(-1, keepdim=True) / 127
    up = s.to(torch.bfloat16).float()
    up = torch.where(up < s, up + torch.ldexp(torch.ones_like(up), torch.frexp(up).exponent - 8), up)  # a step up
    codes = torch.floor(groups / torch.where(up > 0, up, 1.0) + 0.5).clamp(-127, 127)
    out = (codes * up).flatten(-2)
    return (out if offset is None else out + offset.float()).to(x.dtype)


def _prefix_from(quantized, exact, start, p):
    """quantized [B, H, S, D] with positions start[b] + s (s < p) taken from exact (a plain loop)."""
    out = quantized.clone()
    if not p:
        return out
    for b in range(out.shape[0]):
        lo = int(start[b])
        out[b, :, lo : lo + p] = exact[b, :, lo : lo + p]
    return out


class FakeQuantCache(DynamicCache):
    """DynamicCache whose compressed layers (per cfg) hold exactly what TurboQuantCache reconstructs.

    padding_mask [B, S] (the prompt's 2-D attention mask) gives each row's first real position for
    exact_prefix_tokens; rows expanded by generate() (beams, num_return_sequences) repeat it.
    """

    def __init__(self, model_config, cfg: TurboQuantConfig, padding_mask=None):
        n = model_config.num_hidden_layers
        dense = cfg.full_precision_layer_set(n)
        super().__init__()
        # sliding-window layers kept exact: full history, the mask windows it
        dense = dense | set(exact_sliding_windows(model_config.get_text_config(decoder=True), n, cfg.sliding_layers))
        self.layers = [DynamicLayer() if i in dense else FakeQuantLayer(cfg, self) for i in range(n)]
        self.layer_class_to_replicate = None
        self.kv_start = None if padding_mask is None else (padding_mask == 0).int().cumprod(-1).sum(-1)

    def kv_start_for(self, rows: int) -> torch.Tensor:
        if self.kv_start is None:
            return torch.zeros(rows, dtype=torch.long)
        return self.kv_start.repeat_interleave(rows // self.kv_start.shape[0])


# ---- generate() helpers that work on transformers 5.17 and >= 5.24 --------------------------------
NEW_CACHE_KWARG = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24)


def with_cache(cache) -> dict:
    """generate/forward kwargs passing `cache` (renamed from past_key_values in 5.24)."""
    return {"cache": cache} if NEW_CACHE_KWARG else {"past_key_values": cache}


def generate(model, input_ids, attention_mask=None, cache=None, **kwargs):
    """Greedy by default; returns (sequences, per-step logits [steps, B, V])."""
    kwargs = {"max_new_tokens": 8, "do_sample": False, **kwargs}
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, return_dict_in_generate=True,
                         output_logits=True, **(with_cache(cache) if cache is not None else {}), **kwargs)
    return out.sequences, torch.stack(out.logits)


def left_padded_batch(lengths, seed: int = 0, device="cpu"):
    """Random prompts of the given lengths, left padded with 0: (input_ids, attention_mask, prompts)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device), [p.to(device) for p in prompts]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float = 0.0, what: str = ""):
    """allclose with a message saying where and by how much it failed."""
    assert actual.shape == expected.shape, f"{what}: shape {list(actual.shape)} != {list(expected.shape)}"
    a, e = actual.float(), expected.float()
    bad = ~torch.isclose(a, e, atol=atol, rtol=rtol) | (a.isnan() != e.isnan())
    if bad.any():
        err = (a - e).abs().nan_to_num(float("inf"))
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} elements differ beyond atol={atol} rtol={rtol}; "
            f"max |diff| {float(err.max()):.3g}; first at {idx}: {float(a[idx]):.6g} vs {float(e[idx]):.6g}"
        )
