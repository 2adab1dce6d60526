"""Hostile inputs: huge activations, NaN/inf, wrong dtype/device/shape, threads, cache-less forwards.

Contract tested here (and written in the README's "Supported models and limits" section):
  * |x| up to 3e38 (float32) or 1e5 (bfloat16): values come back within one quantization step,
    keys exactly as the reference reconstructs them (scale-equivariant), attention finite.
  * NaN/inf are not checked (that would cost a host sync per step): they propagate, confined to
    the (row, KV head) that carries them; other rows and heads are bit-identical to a clean run,
    and cropping the bad token away restores the row. key_centering's mean ignores them.
  * Everything else that cannot work raises a ValueError/TypeError naming the problem.
"""

from __future__ import annotations

import threading

import pytest
import torch
from models import assert_close, fake_quantize, generate, tiny_model, tq_config, with_cache
from transformers import LlamaConfig

from tq_hf import TurboQuantCache, TurboQuantConfig, ops, reference
from tq_hf.attention import turboquant_attention_forward

HQ, HK, D = 4, 2, 32
SCALE = D**-0.5
MODULE = type("Attn", (), {"is_causal": True, "training": False})()


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def new_cache(layers: int = 2, dense_layers=(), **overrides) -> TurboQuantCache:
    cfg = LlamaConfig(hidden_size=HQ * D, num_attention_heads=HQ, num_key_value_heads=HK, head_dim=D,
                      num_hidden_layers=layers, vocab_size=8, intermediate_size=8)
    cfg._attn_implementation = "turboquant"
    # element-wise error bounds hold for the base format; value_rotation mixes elements (see test below)
    base = dict(value_rotation=False, exact_prefix_tokens=0, recent_window=0)
    tq = TurboQuantConfig.from_preset(overrides.pop("preset", "4bit"), full_precision_layers=dense_layers,
                                      prefill_attention="compressed", **{**base, **overrides})
    return TurboQuantCache(cfg, tq_config=tq)


def attend(cache, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
    """Compressed attention of q [B, Hq, Lq, D] over the layer, as attention.py calls it: [B, Hq, Lq, D]."""
    layer = cache.layers[layer_idx]
    return ops.paged_attention(q, layer.pool, layer.layout, layer.block_table, layer.seq_lens, SCALE,
                               kv_start=layer.kv_start, max_seq_len=layer.length, key_offset=layer.key_offset)


def causal(rows: int, lq: int, s: int) -> torch.Tensor:
    return reference.attention_mask(lq, s, torch.full((rows,), s))


def value_step(v: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """One quantization step of each token's values, float64 [..., 1]: its range / (2**bits - 1), plus
    the bfloat16 rounding of the stored midpoint (which is all a constant token has)."""
    x = v.double()
    hi, lo = x.amax(-1, keepdim=True), x.amin(-1, keepdim=True)
    return (hi - lo) / ((1 << bits) - 1) + (hi + lo).abs() / 2 * 2**-8


# ---- huge magnitudes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,big", [(torch.float32, 3e38), (torch.bfloat16, 1e5)])
def test_huge_values_stay_within_one_step_and_attention_is_finite(dtype, big):
    torch.manual_seed(1)
    rows, s = 3, 37
    k = torch.randn(rows, HK, s, D).to(dtype)
    v = torch.randn(rows, HK, s, D)
    v[0, 0, 5, 3], v[1, 1, 0, :] = big, -big  # one outlier element; one token all at -big
    v[2, :, 7, ::2], v[2, :, 7, 1::2] = big, -big  # the full range in one token
    v = v.to(dtype)
    cache = new_cache()
    cache.update(k, v, 0)
    _, got_v = cache.layers[0].dequantized()
    assert got_v.isfinite().all(), "dequantized values overflowed"
    err = (got_v.double() - v.double()).abs()
    assert (err <= value_step(v)).all(), f"value error {float((err / value_step(v)).max()):.3f} steps"
    q = torch.randn(rows, HQ, 2, D).to(dtype)
    out = attend(cache, 0, q)
    assert out.isfinite().all()
    # attention is a convex combination: within the largest visible step of the exact-value attention
    k_hat, _ = fake_quantize(k.float(), v.float(), cache.tq_config, cache.layers[0].key_offset)
    exact = reference.dense_attention(q, k_hat, v.float(), causal(rows, 2, s), SCALE)
    bound = value_step(v).amax(dim=(1, 2, 3))[:, None, None, None] * 1.01 + 1e-6
    if dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2**-8  # the bf16 output rounding
    assert ((out.double() - exact.double()).abs() <= bound).all()


def test_huge_keys_are_reconstructed_scale_equivariantly():
    """Keys x 2**127 (|x| up to ~3e38) dequantize to exactly 2**127 x the small keys' reconstruction
    (power-of-two scaling is exact), so huge keys lose no more than ordinary ones; where that product
    exceeds the float32 range the reference yields +-inf (documented limit), never NaN."""
    torch.manual_seed(2)
    small = torch.randn(2, HK, 40, D)
    small = small / small.abs().amax(-1, keepdim=True) * 1.7  # amax 1.7 x 2**127 = 2.9e38 per token
    big = small * 2.0**127
    assert big.abs().max() > 2.8e38 and big.isfinite().all()
    caches = [new_cache(), new_cache()]
    caches[0].update(small, small, 0)
    caches[1].update(big, big, 0)
    k_small, _ = caches[0].layers[0].dequantized()
    k_big, _ = caches[1].layers[0].dequantized()
    assert not k_big.isnan().any()
    scaled = k_small * 2.0**127
    assert torch.equal(k_big, scaled), "huge keys are not reconstructed as the scaled small keys"
    assert k_big.isfinite().float().mean() > 0.99  # overflow only where the reconstruction overshoots 3.4e38
    # attention over 2**120-scaled keys with 2**-120-scaled queries == the unscaled attention
    mid = new_cache()
    mid.update(small * 2.0**120, small, 0)
    q = torch.randn(2, HQ, 1, D) + 4.0  # away from 0: no subnormal query elements after scaling
    got = attend(mid, 0, q * 2.0**-120)
    want = attend(caches[0], 0, q)
    assert got.isfinite().all()
    assert_close(got, want, atol=1e-5, rtol=1e-5, what="scaled keys/queries")


@pytest.mark.parametrize("big", [3e38, float("inf"), float("nan")])
def test_key_centering_mean_survives_hostile_first_tokens(big):
    """key_centering's per-row means over the first update stay finite (overflowing sums and NaN/inf
    ignored), and only the (row, head) that holds the bad tokens is affected."""
    k, v = torch.randn(2, HK, 6, D), torch.randn(2, HK, 6, D)
    k[0, 0, :3, 0] = big
    cache = new_cache(key_centering=True)
    cache.update(k, v, 0)
    offset = cache.layers[0].key_offset
    assert offset.shape == (2, HK, D) and offset.isfinite().all()
    assert_close(offset[1], k[1].mean(dim=1), atol=1e-6, rtol=1e-6, what="untouched row: the plain mean")
    assert_close(offset[0, 1:], k[0, 1:].mean(dim=1), atol=1e-6, rtol=1e-6, what="untouched heads of row 0")
    if big == 3e38:
        assert offset[0, 0, 0] == pytest.approx(3 * 3e38 / 6, rel=1e-6)


# ---- NaN / inf: propagation confined to the (row, KV head) that carries them ----------------------------
@pytest.mark.parametrize("centering", [False, True])
@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_stay_in_their_row_and_head(where, bad, centering):
    """With key_centering, a bad key in the first update also leaves the row's mean computed
    without that element, so after the crop the row is finite and within quantization noise of
    the clean run rather than bit-identical."""
    torch.manual_seed(3)
    rows, s = 3, 20
    k, v = torch.randn(rows, HK, s, D), torch.randn(rows, HK, s, D)
    q = torch.randn(rows, HQ, 1, D)
    clean, dirty = new_cache(key_centering=centering), new_cache(key_centering=centering)
    clean.update(k, v, 0)
    (k if where == "key" else v)[1, 0, 9, 4] = bad  # row 1, KV head 0, token 9
    dirty.update(k, v, 0)
    ref, out = attend(clean, 0, q), attend(dirty, 0, q)
    group = HQ // HK  # query heads 0 .. group-1 read KV head 0
    assert not out[1, :group].isfinite().any(), "the carrying (row, head) should show NaN/inf, not hide it"
    keep = torch.ones_like(out, dtype=torch.bool)
    keep[1, :group] = False
    assert torch.equal(out[keep], ref[keep]), "NaN/inf leaked into other rows or heads"
    dirty.crop(-(s - 9))  # drop the bad token and everything after it
    clean.crop(-(s - 9))
    restored, want = attend(dirty, 0, q), attend(clean, 0, q)
    if centering and where == "key":
        assert restored.isfinite().all() and torch.equal(restored[keep], want[keep])
        assert_close(restored, want, atol=0.05, rtol=0, what="the cropped row vs the clean run (other mean)")
    else:
        assert torch.equal(restored, want), "cropping the bad token did not restore the row"


# ---- clear errors -------------------------------------------------------------------------------------------
def kv(rows=2, tokens=3, heads=HK, dim=D, dtype=torch.float32):
    return torch.randn(rows, heads, tokens, dim, dtype=dtype), torch.randn(rows, heads, tokens, dim, dtype=dtype)


@pytest.mark.parametrize("make,error,match", [
    (lambda: kv(dtype=torch.float64), TypeError, "dtype torch.float64.*supports torch.float16"),
    (lambda: (torch.ones(2, HK, 3, D, dtype=torch.int64),) * 2, TypeError, "dtype torch.int64"),
    (lambda: (kv()[0], kv()[1].half()), None, None),  # mixed float dtypes: accepted (each quantized as float32)
    (lambda: kv(dim=64), ValueError, "head_dim 32"),
    (lambda: kv(heads=3), ValueError, "2 KV heads"),
    (lambda: (torch.randn(2, 3, D), torch.randn(2, 3, D)), ValueError, r"\[batch, .*got \[2, 3, 32\]"),
    (lambda: (kv(tokens=1)[0], kv(tokens=2)[1]), ValueError, "must have the same shape"),
    (lambda: (kv()[0].to("meta"), kv()[1].to("meta")), ValueError, "on meta but this cache layer lives on cpu"),
    (lambda: (kv()[0], kv()[1].to("meta")), ValueError, "value_states is on meta"),
    (lambda: (kv()[0].numpy(), kv()[1]), TypeError, "must be a torch.Tensor"),
])
def test_bad_updates_after_a_good_one_raise_clear_errors(make, error, match):
    cache = new_cache()
    cache.update(*kv(), 0)
    if error is None:
        cache.update(*make(), 0)
        assert cache.get_seq_length(0) == 6
        return
    with pytest.raises(error, match=match):
        cache.update(*make(), 0)
    assert cache.get_seq_length(0) == 3  # nothing half-written


def test_first_update_with_wrong_shape_or_dtype_raises():
    with pytest.raises(ValueError, match="head_dim 32"):
        new_cache().update(*kv(dim=48), 0)
    with pytest.raises(TypeError, match="dtype torch.float64"):
        new_cache().update(*kv(dtype=torch.float64), 0)
    with pytest.raises(ValueError, match=r"key_states \(cpu\) and value_states \(meta\) must be on the same device"):
        new_cache().update(kv()[0], kv()[1].to("meta"), 0)
    with pytest.raises(ValueError, match="head_dim 40 is not supported; supported: multiples of 16 from 32 to 256"):
        TurboQuantCache(LlamaConfig(hidden_size=80, num_attention_heads=2, head_dim=40, num_hidden_layers=1))
    with pytest.raises(ValueError, match="rotation='hadamard' needs a power-of-two head_dim, got 48"):
        TurboQuantCache(LlamaConfig(hidden_size=96, num_attention_heads=2, head_dim=48, num_hidden_layers=1))


@pytest.mark.parametrize("idx", [2, 7, -1, "0", 1.0])
def test_layer_index_that_does_not_exist(idx):
    with pytest.raises(ValueError, match=rf"layer_idx .* does not exist: this TurboQuantCache has 2 layers"):
        new_cache().update(*kv(), idx)


@pytest.mark.parametrize("dense_layers", [(), (0,)])
def test_mismatched_batch_sizes_between_layers(dense_layers):
    cache = new_cache(dense_layers=dense_layers)
    cache.update(*kv(rows=2), 0)
    with pytest.raises(ValueError, match="layer 1 got a batch of 3 rows but layer 0 .* holds 2"):
        cache.update(*kv(rows=3), 1)
    cache.update(*kv(rows=2), 1)  # the right batch still works
    cache.reset()
    cache.update(*kv(rows=3), 1)  # after reset any batch starts afresh


def test_non_contiguous_inputs_equal_contiguous_ones():
    """Sliced, transposed and broadcast (stride-0) K/V, and transposed queries: same result as contiguous."""
    torch.manual_seed(4)
    wide = torch.randn(2, 7, HK, 2 * D)
    k = wide[..., ::2].transpose(1, 2)  # [2, HK, 7, D], strides everywhere
    v = torch.randn(1, HK, 1, D).expand(2, HK, 7, D)  # stride 0 over batch and tokens
    q = torch.randn(2, 2, HQ, D).transpose(1, 2)
    assert not (k.is_contiguous() or v.is_contiguous() or q.is_contiguous())
    a, b = new_cache(), new_cache()
    a.update(k, v, 0)
    b.update(k.contiguous(), v.contiguous(), 0)
    assert torch.equal(a.layers[0].pool, b.layers[0].pool)
    assert torch.equal(attend(a, 0, q), attend(b, 0, q.contiguous()))


def test_query_that_cannot_attend_the_layer_raises():
    cache = new_cache()
    k, v = kv(rows=2, tokens=4)
    key, value = cache.update(k, v, 0)
    for q, error, match in [
        (torch.randn(3, HQ, 4, D), ValueError, "query must be \\[batch 2"),  # wrong batch
        (torch.randn(2, 3, 4, D), ValueError, "a multiple of 2 query heads"),
        (torch.randn(2, HQ, 4, 64), ValueError, "head_dim 32"),
        (torch.randn(2, HQ, 4, D, dtype=torch.float64), TypeError, "query has dtype torch.float64"),
        (torch.randn(2, HQ, 4, D, device="meta"), ValueError, "query is on meta"),
    ]:
        with pytest.raises(error, match=match):
            turboquant_attention_forward(MODULE, q, key, value, None, scaling=SCALE)


# ---- isolation --------------------------------------------------------------------------------------------
def test_two_caches_in_two_threads_do_not_see_each_other():
    """Two tiny models generating at once (and two generate calls on one model) == each run alone."""
    models = [tiny_model("llama", seed=0), tiny_model("llama", seed=1)]
    prompts = [torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(s)) for s in (5, 6)]
    jobs = [(models[0], prompts[0]), (models[1], prompts[1]), (models[0], prompts[1])]

    def run(model, ids):
        return generate(model, ids, cache=TurboQuantCache(model.config, tq_config=tq_config()), max_new_tokens=6)

    alone = [run(m, p) for m, p in jobs]
    together: list = [None] * len(jobs)
    barrier = threading.Barrier(len(jobs))
    errors = []

    def worker(i):
        try:
            with torch.no_grad():
                barrier.wait()
                together[i] = run(*jobs[i])
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, ((seq_a, logits_a), (seq_b, logits_b)) in enumerate(zip(alone, together)):
        assert torch.equal(seq_a, seq_b), f"job {i}: tokens differ when run concurrently"
        assert_close(logits_b, logits_a, atol=0, what=f"job {i} logits")


def test_forward_without_cache_after_one_with_it():
    model, ids = tiny_model("llama"), torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(7))
    fresh = tiny_model("llama")(input_ids=ids, use_cache=False).logits
    cache = TurboQuantCache(model.config, tq_config=tq_config())
    model(input_ids=ids, **with_cache(cache))
    model(input_ids=ids[:, -1:], **with_cache(cache))  # a decode step: its key tensors carry the layer step
    assert_close(model(input_ids=ids, use_cache=False).logits, fresh, atol=0, what="no cache after a cache")
    assert_close(model(input_ids=ids).logits, fresh, atol=1e-6, what="default (DynamicCache) after a cache")


def test_default_levers_keep_bf16_activations_of_1e5_finite():
    """value_rotation rotates before quantizing: |v| up to 1e5 in bf16 stays finite and close in norm."""
    cache = new_cache(value_rotation=True, exact_prefix_tokens=4, recent_window=8)
    k = torch.randn(2, HK, 40, D).to(torch.bfloat16) * 1e5
    v = torch.randn(2, HK, 40, D).to(torch.bfloat16) * 1e5
    cache.update(k, v, 0)
    q = torch.randn(2, HQ, 1, D, dtype=torch.bfloat16)
    out = attend(cache, 0, q)
    assert torch.isfinite(out).all()
    dk, dv = cache.layers[0].dequantized(torch.float32)
    rel = (dv - v.float()).norm(dim=-1) / v.float().norm(dim=-1)
    assert torch.isfinite(dk).all() and float(rel.max()) < 0.2, float(rel.max())
