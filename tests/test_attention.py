"""The "turboquant" attention and mask functions: fallback semantics, the compressed path on
odd shapes against reference math, and the errors users get."""

from __future__ import annotations

import contextlib
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from models import PLAIN_LEVERS, FAMILIES, assert_close, fake_quantize, left_padded_batch, tiny_model, tq_config, with_cache
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, LlamaConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from tq_hf import TurboQuantCache, TurboQuantConfig, reference
from tq_hf.attention import NO_PADDING, PADDING_ATTRIBUTE, turboquant_attention_forward, turboquant_mask
from tq_hf.cache import STEP_ATTRIBUTE


@pytest.fixture(autouse=True)
def _no_grad():
    """Forwards as in inference. (With grad enabled, codec constants that another test first built
    under torch.inference_mode fail autograd: reference.key_codec caches inference tensors.)"""
    with torch.no_grad():
        yield


def test_import_registers_attention_and_mask():
    assert ALL_ATTENTION_FUNCTIONS["turboquant"] is turboquant_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["turboquant"] is turboquant_mask


@pytest.mark.parametrize("family", FAMILIES)
def test_without_turboquant_cache_it_matches_eager(family):
    """Fallback = HF semantics (sdpa, or eager math for softcap/sinks), padded batch, with and without cache."""
    ids, mask, _ = left_padded_batch([11, 4, 8], seed=1)
    ours, eager = tiny_model(family, "turboquant"), tiny_model(family, "eager")
    real = mask.bool()[:, :, None]
    for kwargs in ({}, with_cache(DynamicCache())):
        kwargs2 = with_cache(DynamicCache()) if kwargs else {}
        got = ours(input_ids=ids, attention_mask=mask, **kwargs).logits
        want = eager(input_ids=ids, attention_mask=mask, **kwargs2).logits
        assert_close(got * real, want * real, atol=2e-5, rtol=1e-5, what=f"{family} logits (real tokens)")


# ---- the compressed path on its own -------------------------------------------------------------------
def module(groups: int):
    return SimpleNamespace(is_causal=True, training=False, num_key_value_groups=groups)


@pytest.mark.parametrize("rows,prompt,decode", [(5, 123, 3), (1, 17, 1), (2, 64, 2)])
@pytest.mark.parametrize("features", [
    {}, {"sliding_window": 7}, {"softcap": 5.0}, {"sinks": True}, {"padding": True},
    {"sliding_window": 20, "softcap": 30.0, "sinks": True, "padding": True},
])
def test_compressed_attention_matches_reference_math(rows, prompt, decode, features):
    """Queries over the pool == reference.dense_attention over the fake-quantized K/V (fp32)."""
    hq, hk, d = 6, 2, 64
    cfg = TurboQuantConfig(full_precision_layers=(), prefill_attention="compressed", **PLAIN_LEVERS)
    llama = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hk, head_dim=d,
                        num_hidden_layers=1, vocab_size=8, intermediate_size=8)
    llama._attn_implementation = "turboquant"
    cache = TurboQuantCache(llama, tq_config=cfg)
    window, softcap = features.get("sliding_window"), features.get("softcap")
    sinks = torch.randn(hq) if features.get("sinks") else None
    pads = torch.randint(0, prompt // 2, (rows,)) if features.get("padding") else torch.zeros(rows, dtype=torch.long)
    real = torch.arange(prompt)[None, :] >= pads[:, None]
    all_k = all_v = None
    for step, n in enumerate([prompt] + [1] * decode):
        k, v, q = torch.randn(rows, hk, n, d) * 2, torch.randn(rows, hk, n, d), torch.randn(rows, hq, n, d) * 2
        qk, qv = fake_quantize(k, v, cfg)
        all_k = qk if all_k is None else torch.cat([all_k, qk], 2)
        all_v = qv if all_v is None else torch.cat([all_v, qv], 2)
        if step:
            real = torch.cat([real, torch.ones(rows, 1, dtype=torch.bool)], 1)
        s = all_k.shape[2]
        hf_mask = turboquant_mask(batch_size=rows, q_length=n, kv_length=s, q_offset=s - n, kv_offset=0,
                                  mask_function=_causal(window), attention_mask=real, local_size=window)
        key, value = cache.update(k, v, 0)
        assert getattr(key, STEP_ATTRIBUTE).layer is cache.layers[0]
        out, weights = turboquant_attention_forward(module(hq // hk), q, key, value, hf_mask, scaling=0.11,
                                                    sliding_window=window, softcap=softcap, s_aux=sinks)
        assert weights is None
        seq = torch.full((rows,), s)
        ref_mask = reference.attention_mask(n, s, seq, pads, window)
        want = reference.dense_attention(q, all_k, all_v, ref_mask, 0.11, sinks, softcap)
        assert_close(out, want.transpose(1, 2), atol=2e-5, rtol=1e-5, what=f"step {step} {features}")
    kv_start = cache.layers[0].kv_start  # None when HF skipped the mask: nothing was padded
    assert (kv_start.tolist() if kv_start is not None else [0] * rows) == pads.tolist()


def _causal(window):
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    return causal_mask_function if window is None else sliding_window_causal_mask_function(window)


def test_padding_inside_rows_falls_back_to_the_full_mask():
    """A 2-D mask with holes (not a left-pad prefix) still gives HF semantics."""
    model = tiny_model("llama")
    cfg = tq_config(prefill_attention="compressed")
    ids, mask, _ = left_padded_batch([10, 10], seed=3)
    mask[0, 4] = 0  # a hole in the middle of row 0
    from models import FakeQuantCache

    cache = TurboQuantCache(model.config, tq_config=cfg)
    got = model(input_ids=ids, attention_mask=mask, **with_cache(cache)).logits
    want = model(input_ids=ids, attention_mask=mask, **with_cache(FakeQuantCache(model.config, cfg))).logits
    assert cache.layers[1].needs_full_mask
    real = mask.bool()[:, :, None]
    assert_close(got * real, want * real, atol=2e-5, rtol=1e-5, what="holes in the padding mask")


def test_mask_function_never_skips_at_decode_and_carries_padding():
    real = torch.ones(2, 9, dtype=torch.bool)
    decode = turboquant_mask(batch_size=2, q_length=1, kv_length=9, q_offset=8, attention_mask=real)
    assert decode is not None and decode.shape == (2, 1, 1, 9)
    assert getattr(decode, PADDING_ATTRIBUTE) is real
    assert turboquant_mask(batch_size=2, q_length=9, kv_length=9, attention_mask=real) is None  # like sdpa
    assert turboquant_mask(batch_size=2, q_length=1, kv_length=9, q_offset=8) is None  # no 2-D mask, no read: sdpa's
    earlier = turboquant_mask(batch_size=2, q_length=1, kv_length=9, q_offset=6)  # a query before the last key
    assert getattr(earlier, PADDING_ATTRIBUTE) is NO_PADDING  # the model got no 2-D mask: nothing is padded
    assert torch.equal(earlier[:, 0, 0], torch.arange(9).expand(2, 9) <= 6)



@pytest.mark.parametrize("dtype", [torch.bool, torch.long])
def test_one_query_mask_is_sdpas_mask_where_it_takes_the_padding_as_is(dtype):
    """At a one-query step over a plain causal mask the mask function hands back the 2-D padding mask as a 4-D
    view instead of building it; it must equal HF's materialized sdpa mask for random padding, and every other
    case (sliding window, custom mask function, a query not at the last key, a device offset) goes to sdpa_mask."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    g = torch.Generator().manual_seed(7)
    for rows, kv, offset in ((1, 9, 0), (3, 17, 0), (2, 12, 5)):
        padding = (torch.rand(rows, offset + kv, generator=g) > 0.4).to(dtype)
        padding[:, -1] = 1
        cases = [dict(q_offset=offset + kv - 1),  # the view
                 dict(q_offset=offset + kv - 3),  # a query before the last key: keys after it are masked
                 dict(q_offset=offset + kv - 1, local_size=4, mask_function=sliding_window_causal_mask_function(4)),
                 dict(q_offset=torch.tensor(offset + kv - 1))]
        view = turboquant_mask(batch_size=rows, q_length=1, kv_length=kv, kv_offset=offset, attention_mask=padding,
                               q_offset=offset + kv - 1)
        assert view.dtype == torch.bool and view.data_ptr() == padding.data_ptr() + offset * padding.element_size() \
            or dtype != torch.bool, "a bool padding mask is viewed, not copied"
        for extra in cases:
            kwargs = dict(batch_size=rows, q_length=1, kv_length=kv, kv_offset=offset, attention_mask=padding, **extra)
            got = turboquant_mask(**kwargs)
            want = sdpa_mask(**{**kwargs, "allow_is_causal_skip": False, "attention_mask": padding.bool()})
            assert got.shape[1:] == want.shape[1:] and got.shape[0] in (1, rows)
            assert torch.equal(got.bool().expand_as(want), want), extra
            assert getattr(got, PADDING_ATTRIBUTE) is padding


# ---- sliding-window layers: left padding vs keys the window hides ---------------------------------
def _chunked_logits(model, ids, cache, chunk: int, mask=None) -> torch.Tensor:
    """Feed ids in chunks through one cache (as eval.perplexity does), with or without a 2-D mask."""
    out = []
    for i in range(0, ids.shape[1], chunk):
        kwargs = {} if mask is None else {"attention_mask": mask[:, : i + chunk]}
        out.append(model(input_ids=ids[:, i : i + chunk], **kwargs, **with_cache(cache)).logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_sliding_layers_without_a_2d_mask_see_no_padding(family):
    """model(input_ids) with no attention_mask, chunk by chunk past the sliding window: the keys the
    window hides must not be taken for left padding (they were, and the exact prefix tokens were
    then overlaid on the wrong positions). Same logits as with an explicit all-ones mask."""
    model = tiny_model(family)
    ids, _, _ = left_padded_batch([20, 20], seed=21)
    cfg = tq_config(prefill_attention="compressed", sliding_layers="compressed")
    without = _chunked_logits(model, ids, TurboQuantCache(model.config, tq_config=cfg), 5)
    ones = torch.ones_like(ids)
    with_mask = _chunked_logits(model, ids, TurboQuantCache(model.config, tq_config=cfg), 5, ones)
    assert_close(without, with_mask, atol=1e-5, rtol=1e-5, what=f"{family}: no mask vs all-ones mask")


def test_visible_columns_tell_padding_from_the_window():
    """The fallback for masks that lost their padding record (built elsewhere, moved across devices)."""
    from tq_hf.attention import _visible_columns

    seen = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1],   # window hides 0-3, no padding visible
                         [0, 0, 0, 0, 0, 0, 1, 1],   # padding reaches into the window (0-5)
                         [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    got = _visible_columns(seen, start=7, sliding_window=4)  # first query at 7 sees 4..7
    assert got.tolist() == [[True] * 8, seen[1].tolist(), [True] * 8]
    assert torch.equal(_visible_columns(seen, start=7, sliding_window=None), seen)  # full attention: as seen
    assert torch.equal(_visible_columns(seen, start=2, sliding_window=4), seen)  # window covers column 0

# ---- no state leaks -----------------------------------------------------------------------------
def test_no_state_survives_into_a_forward_without_the_cache():
    model = tiny_model("gemma3")
    ids, mask, _ = left_padded_batch([9, 6], seed=2)
    before = model(input_ids=ids, attention_mask=mask).logits
    cache = TurboQuantCache(model.config, tq_config=tq_config(prefill_attention="compressed"))
    with_tq = model(input_ids=ids, attention_mask=mask, **with_cache(cache)).logits
    after = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(before, after)
    real = mask.bool()[:, :, None]
    assert (with_tq * real - before * real).abs().max() > 1e-3  # the cache really changed the attention



# ---- the eager decode step waits on nothing --------------------------------------------------------
# aten ops after which a CUDA host waits for the device: a value read back (item, bool, int) or an output sized by
# the data (nonzero and kin). One per layer and token would serialize the host's launches with the device's work.
DEVICE_READS = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "unique",
                          "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave", "bincount"})


class _DeviceReads(TorchDispatchMode):
    """Counts the DEVICE_READS ops dispatched under it."""

    def __init__(self):
        super().__init__()
        self.seen = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in DEVICE_READS:
            self.seen[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _prefill_and_decode(model, cache, ids, mask, steps: int, reads=None):
    """A prefill, then `steps` one-token forwards (under `reads` where given)."""
    model(input_ids=ids, attention_mask=mask, **with_cache(cache))
    for _ in range(steps):
        mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
        with reads or contextlib.nullcontext():
            model(input_ids=ids[:, -1:], attention_mask=mask, **with_cache(cache))


@pytest.mark.parametrize("preset", ["4bit", "k8v4", "3bit"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("lengths", [(9, 14), (150, 200)], ids=["centering-open", "settled"])
def test_eager_decode_step_reads_nothing_back_from_the_device(family, preset, lengths):
    """The kernel path as a GPU runs it (launches stubbed, planned as on an H200), left-padded rows: from a cache's
    first decode step on, a one-token forward dispatches no op that waits for the device, in the cache's update, the
    mask or the attention; on prompts short of the key-centering means' window (the general update) and past it
    (a settled layer's steady step). A first cache warms the memoized codec constants, computed once on the CPU."""
    from eval.host_overhead import stubbed_launches

    model = tiny_model(family)
    ids, mask, _ = left_padded_batch(lengths, seed=3)
    reads = _DeviceReads()
    with stubbed_launches():
        _prefill_and_decode(model, TurboQuantCache(model.config, preset=preset), ids, mask, 1)
        cache = TurboQuantCache(model.config, preset=preset)
        _prefill_and_decode(model, cache, ids, mask, 3, reads)
    assert cache.get_seq_length() == ids.shape[1] + 3
    assert not reads.seen, f"a decode step waits for the device in {dict(reads.seen)}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["4bit", "k8v4", "3bit"])
def test_gpu_eager_decode_steps_do_not_synchronize(preset):
    """torch's own sync detector over real decode steps on the GPU (left padding, a sliding-window family)."""
    model = tiny_model("gemma3", dtype=torch.float16, device="cuda")
    ids, mask, _ = left_padded_batch([9, 14], seed=3, device="cuda")
    _prefill_and_decode(model, TurboQuantCache(model.config, preset=preset), ids, mask, 1)
    cache = TurboQuantCache(model.config, preset=preset)
    model(input_ids=ids, attention_mask=mask, **with_cache(cache))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
            logits = model(input_ids=ids[:, -1:], attention_mask=mask, **with_cache(cache)).logits
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(logits).all()

# ---- errors -----------------------------------------------------------------------------------------
def test_output_attentions_is_rejected_by_name():
    model = tiny_model("llama")
    ids, mask, _ = left_padded_batch([5], seed=0)
    for kwargs in ({}, with_cache(TurboQuantCache(model.config, tq_config=tq_config()))):
        with pytest.raises(ValueError, match="output_attentions"):
            model(input_ids=ids, attention_mask=mask, output_attentions=True, **kwargs)


def test_cross_attention_and_training_dropout_are_rejected_over_the_cache():
    llama = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                        num_hidden_layers=1, vocab_size=8, intermediate_size=8)
    llama._attn_implementation = "turboquant"
    cfg = TurboQuantConfig(full_precision_layers=(), prefill_attention="compressed", **PLAIN_LEVERS)
    q = torch.randn(1, 2, 3, 64)
    class CrossAttention(torch.nn.Module):  # a class that says so (asked twice: its answer is remembered)
        is_cross_attention = True
        is_causal = True
        num_key_value_groups = 1

    for mod, kwargs, message in (
        (SimpleNamespace(is_causal=False, training=False, num_key_value_groups=1), {}, "cross-attention"),
        (SimpleNamespace(is_causal=True, training=False, num_key_value_groups=1, is_cross_attention=True), {},
         "cross-attention"),
        (CrossAttention(), {}, "cross-attention"),
        (CrossAttention(), {}, "cross-attention"),
        (SimpleNamespace(is_causal=True, training=True, num_key_value_groups=1), {"dropout": 0.1}, "dropout"),
    ):
        key, value = TurboQuantCache(llama, tq_config=cfg).update(torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64), 0)
        with pytest.raises(ValueError, match=message):
            turboquant_attention_forward(mod, q, key, value, None, **kwargs)
