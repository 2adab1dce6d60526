"""generate() over a TurboQuantCache, every way users call it.

The oracle is the same model generating with FakeQuantCache (a DynamicCache holding the
reference quantize-dequantize of exactly what the compressed cache stores): identical tokens and
logits within fp32 tolerance, so integration bugs cannot hide behind quantization noise. Each test
also checks that the oracle is not trivially equal to an unquantized cache.
"""

from __future__ import annotations

import os

import pytest
import torch
from models import (FAMILIES, FakeQuantCache, assert_close, generate, left_padded_batch, tiny_model, tq_config,
                    with_cache)
from transformers import DynamicCache

from tq_hf import TurboQuantCache

ATOL = 1e-4  # fp32 logits: same math in a different order (paged reference vs sdpa over dense K/V)
CODE_FLIP_ATOL = 2e-3  # ... where a long run lets one code flip at a rounding boundary (see its use)


def compare(model, ids, mask, cfg, what, device="cpu", atol=ATOL, oracle_padding=True, **kwargs):
    """Generate with TurboQuantCache and with the oracle; assert equal; return both results.

    oracle_padding=False: the oracle counts the exact prefix from position 0, as the cache does under
    another attention implementation (which never tells it where the padding ends).
    """
    torch.manual_seed(1234)
    ours = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), **kwargs)
    torch.manual_seed(1234)
    oracle = generate(model, ids, mask, FakeQuantCache(model.config, cfg, mask if oracle_padding else None), **kwargs)
    assert torch.equal(ours[0], oracle[0]), f"{what}: tokens differ\n{ours[0]}\n{oracle[0]}"
    assert_close(ours[1], oracle[1], atol=atol, rtol=1e-4, what=f"{what}: logits")
    return ours, oracle


def assert_quantization_matters(model, ids, mask, logits, **kwargs):
    _, dense = generate(model, ids, mask, DynamicCache(), **kwargs)
    steps = min(len(dense), len(logits))
    assert (dense[:steps] - logits[:steps]).abs().max() > 1e-2, "the oracle equals an unquantized cache"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_left_padded_batch_matches_fake_quant(family):
    """Sliding windows (6) are exceeded, softcap, query scaling, sinks, qkv bias, GQA, dense + compressed layers."""
    model = tiny_model(family)
    ids, mask, _ = left_padded_batch([9, 14, 5], seed=1)
    (_, logits), _ = compare(model, ids, mask, tq_config(), family, max_new_tokens=10)
    assert_quantization_matters(model, ids, mask, logits, max_new_tokens=10)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_compressed_prefill_matches_fake_quant(family):
    model = tiny_model(family)
    ids, mask, _ = left_padded_batch([12, 7], seed=2)
    compare(model, ids, mask, tq_config(prefill_attention="compressed"), f"{family} compressed prefill",
            max_new_tokens=6)


@pytest.mark.parametrize("preset", ["k8v4", "3bit"])
def test_other_presets_match_fake_quant(preset):
    model = tiny_model("qwen2")
    ids, mask, _ = left_padded_batch([10, 6], seed=3)
    compare(model, ids, mask, tq_config(preset=preset), preset, max_new_tokens=6)


@pytest.mark.parametrize("family", ["qwen2", "gpt_oss", "gemma2"])
@pytest.mark.parametrize("prefill", ["exact", "compressed"])
def test_fidelity_options_match_fake_quant(family, prefill):
    """key_centering + value_rotation + exact prefix (left padded rows) + recent ring: qkv biases (qwen2), sinks (gpt_oss, where q . mean matters), softcap."""
    model = tiny_model(family)
    ids, mask, _ = left_padded_batch([11, 6], seed=4)
    cfg = tq_config(key_centering=True, value_rotation=True, exact_prefix_tokens=3, recent_window=5,
                    prefill_attention=prefill)
    compare(model, ids, mask, cfg, f"{family} centering+rotation {prefill}", max_new_tokens=6)


@pytest.mark.parametrize("family,centering", [("llama", False), ("mistral", False), ("gemma3", False),
                                              ("llama", True), ("qwen2", True)])
def test_each_row_of_a_padded_batch_generates_as_if_alone(family, centering):
    """Also with key_centering: each row's mean is taken over its own real tokens, so neither the
    padding nor the other rows of the batch change what a row stores."""
    model = tiny_model(family)
    ids, mask, prompts = left_padded_batch([11, 4, 8], seed=4)
    cfg = tq_config(key_centering=centering)
    batched, _ = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=8)
    for row, prompt in enumerate(prompts):
        alone, _ = generate(model, prompt[None], None, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=8)
        assert torch.equal(batched[row, -8:], alone[0, -8:]), f"{family} centering={centering} row {row}"


def test_sampling_with_num_return_sequences():
    model = tiny_model("mistral")
    ids, mask, _ = left_padded_batch([7, 10], seed=5)
    (seqs, _), _ = compare(model, ids, mask, tq_config(), "sampling", max_new_tokens=8, do_sample=True,
                           num_return_sequences=3, top_k=0, temperature=1.5)
    assert seqs.shape[0] == 6 and len({tuple(s.tolist()) for s in seqs[:3]}) > 1  # samples differ


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_beam_search_with_diverging_beams(family):
    model = tiny_model(family)
    ids, mask, _ = left_padded_batch([6, 9], seed=6)
    kwargs = dict(max_new_tokens=14, num_beams=4, num_return_sequences=4, length_penalty=0.0)
    (seqs, _), _ = compare(model, ids, mask, tq_config(), f"{family} beams", **kwargs)
    new = seqs[:, ids.shape[1]:]
    first_split = min(int((new[i] != new[j]).nonzero()[0]) for i in range(4) for j in range(i) if (new[i] != new[j]).any())
    assert len({tuple(s.tolist()) for s in new}) >= 3, "beams did not diverge"
    assert first_split >= 5, f"beams diverged at new token {first_split}, not long after the prompt"


RING_FLIP_ATOL = 1e-2  # an int8 ring code flipped by fp32 noise between the two forwards moves logits by ~1e-3


@pytest.mark.parametrize("mode", ["greedy", "beams", "assisted"])
def test_int8_ring_matches_the_oracle(mode):
    """The default ring (int8 records) through generate(): left-padded greedy decoding, diverging beams (reordered
    rings), assisted decoding (verification forwards over the ring, then crops), against the oracle's int8 ring."""
    model = tiny_model("llama")
    cfg = tq_config(recent_format="int8")
    if mode == "assisted":
        ids, _, _ = left_padded_batch([10], seed=7)
        ids = torch.cat([ids, ids[:, 2:8]], 1)
        kwargs = dict(max_new_tokens=12, assistant_model=tiny_model("llama", seed=1))
        mask = torch.ones_like(ids)
    else:
        ids, mask, _ = left_padded_batch([9, 14, 5] if mode == "greedy" else [6, 9], seed=1 if mode == "greedy" else 6)
        kwargs = dict(max_new_tokens=10) if mode == "greedy" else dict(max_new_tokens=10, num_beams=4,
                                                                       num_return_sequences=4, length_penalty=0.0)
    (_, logits), _ = compare(model, ids, mask, cfg, f"int8 ring, {mode}", atol=RING_FLIP_ATOL, **kwargs)
    exact = generate(model, ids, mask, FakeQuantCache(model.config, tq_config(), mask), **kwargs)[1]
    assert (logits - exact).abs().max() > 1e-5  # the records' rounding shows: the ring is really int8


def test_assisted_decoding_crops_the_cache():
    model, assistant = tiny_model("llama"), tiny_model("llama", seed=1)
    ids, mask, _ = left_padded_batch([10], seed=7)
    ids = torch.cat([ids, ids[:, 2:8]], 1)  # repetition, so some candidates are accepted
    mask = torch.ones_like(ids)
    compare(model, ids, mask, tq_config(), "assisted", max_new_tokens=12, assistant_model=assistant)


def test_prompt_lookup_decoding():
    model = tiny_model("qwen2")
    ids, _, _ = left_padded_batch([12], seed=8)
    ids = torch.cat([ids, ids, ids[:, :5]], 1)
    compare(model, ids, torch.ones_like(ids), tq_config(), "prompt lookup", max_new_tokens=12,
            prompt_lookup_num_tokens=4)


@pytest.mark.parametrize("family", ["mistral", "gpt_oss"])
def test_chunked_prefill(family):
    model = tiny_model(family)
    ids, mask, _ = left_padded_batch([17, 5], seed=9)  # row 1's padding spans the first chunks
    (_, logits), _ = compare(model, ids, mask, tq_config(), f"{family} chunked", max_new_tokens=6,
                             prefill_chunk_size=4)
    unchunked = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=tq_config()), max_new_tokens=6)
    assert (unchunked[1] - logits).abs().max() > 1e-5  # later chunks really read the compressed cache


def test_cache_reuse_across_generate_calls():
    """Multi-turn: continue from the returned sequences plus a new user turn, reusing the cache."""
    model = tiny_model("gemma3")
    ids, mask, _ = left_padded_batch([8, 5], seed=10)
    turn = torch.randint(3, 90, (2, 4), generator=torch.Generator().manual_seed(0))
    results = []
    for cache in (TurboQuantCache(model.config, tq_config=tq_config()), FakeQuantCache(model.config, tq_config(), mask)):
        first, _ = generate(model, ids, mask, cache, max_new_tokens=5)
        ids2 = torch.cat([first, turn], 1)
        mask2 = torch.cat([mask, torch.ones(2, ids2.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        results.append(generate(model, ids2, mask2, cache, max_new_tokens=6))
        assert cache.get_seq_length() == ids2.shape[1] + 5
    assert torch.equal(results[0][0], results[1][0])
    # the two runs' K/V differ by ~1e-6 (paged vs sdpa math), enough to flip a value code sitting on a rounding
    # boundary (seen: 0.011 in one value, 4e-4 in the logits); a wrong history or mask moves them by > 0.1
    assert_close(results[0][1], results[1][1], atol=CODE_FLIP_ATOL, rtol=1e-4, what="second turn logits")


def test_other_attention_implementation_over_the_cache():
    """TurboQuantCache under sdpa gets the dequantized history: same result as the oracle under sdpa."""
    model = tiny_model("llama", attn="sdpa")
    ids, mask, _ = left_padded_batch([9, 4], seed=11)
    compare(model, ids, mask, tq_config(), "sdpa over TurboQuantCache", max_new_tokens=6, oracle_padding=False)


def test_summary_after_generate():
    model = tiny_model("llama")
    ids, mask, _ = left_padded_batch([9, 4], seed=12)
    cache = TurboQuantCache(model.config, tq_config=tq_config())
    generate(model, ids, mask, cache, max_new_tokens=5)
    line = cache.summary()
    assert "2/3 layers compressed" in line and f"{cache.get_seq_length()} tokens/row" in line
    assert 0 < cache.memory_footprint() < cache.fp16_equivalent_bytes() * 2  # fp32 dense layer included


# ---- the same on CUDA through the kernels -----------------------------------------------------------
# (family, dtype): every dense family in fp16 and bf16. gpt_oss (sinks) runs in fp32: in half precision
# on the H200 a few of its 3744 logits moved by up to 0.4 (fp16) / 1.1 (bf16) between the kernel and
# reference paths, most likely its MoE router sending last-bit differences to other experts (not
# isolated); in fp32 the comparison stays tight (interpreter, GPU launch heuristics: max |diff| 0.07).
GPU_CASES = [(f, d) for f in ["llama", "mistral", "gemma2", "gemma3", "qwen2"] for d in (torch.float16, torch.bfloat16)]
GPU_CASES += [("gpt_oss", torch.float32)]


# Kernel vs reference logits on these random models (logits std ~1.2), teacher-forced, measured
# with the Triton interpreter on CPU: max |diff| fp16 <= 0.18, bf16 <= 0.16 on llama/gpt_oss/gemma2.
GPU_LOGIT_ATOL = {torch.float16: 0.25, torch.bfloat16: 0.4, torch.float32: 0.25}


def forced_logits(model, ids, mask, cache, continuation) -> torch.Tensor:
    """Last-position logits of a prefill, then of each teacher-forced token: [1 + steps, B, V]."""
    kwargs = with_cache(cache)
    logits = [model(input_ids=ids, attention_mask=mask, **kwargs).logits[:, -1]]
    for token in continuation.T:
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        logits.append(model(input_ids=token[:, None], attention_mask=mask, **kwargs).logits[:, -1])
    return torch.stack(logits)


@pytest.mark.gpu
@pytest.mark.parametrize("family,dtype", GPU_CASES)
@pytest.mark.parametrize("prefill", ["exact", "compressed"])
def test_gpu_kernels_match_the_reference_path(family, dtype, prefill, monkeypatch):
    """Kernels vs reference.py on the same CUDA model and the same tokens: logits per dtype tolerance."""
    model = tiny_model(family, dtype=dtype, device="cuda")
    ids, mask, _ = left_padded_batch([9, 30, 5], seed=13, device="cuda")
    continuation = torch.randint(3, 90, (3, 12), generator=torch.Generator().manual_seed(0)).cuda()
    cfg = tq_config(prefill_attention=prefill)
    with torch.no_grad():
        kernels = forced_logits(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), continuation)
        monkeypatch.setenv("TQ_HF_FORCE_REFERENCE", "1")
        ref = forced_logits(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), continuation)
    assert_close(kernels, ref, atol=GPU_LOGIT_ATOL[dtype], what=f"{family} {dtype} {prefill} logits")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_features_run_through_the_kernels(dtype):
    """Beam search, chunked prefill, assisted decoding and reuse on CUDA, vs the fake-quant oracle."""
    model, assistant = tiny_model("llama", dtype=dtype, device="cuda"), tiny_model("llama", dtype=dtype,
                                                                                   device="cuda", seed=1)
    ids, mask, _ = left_padded_batch([9, 13], seed=14, device="cuda")
    cfg = tq_config()
    atol = 5e-2 if dtype == torch.float16 else 2e-1
    for kwargs in ({"num_beams": 3}, {"prefill_chunk_size": 4}, {"do_sample": True, "num_return_sequences": 2}):
        torch.manual_seed(0)
        ours = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=6, **kwargs)
        torch.manual_seed(0)
        oracle = generate(model, ids, mask, FakeQuantCache(model.config, cfg, padding_mask=mask), max_new_tokens=6, **kwargs)
        assert_close(ours[1][:1], oracle[1][:1], atol=atol, rtol=5e-2, what=f"{kwargs} first-step logits")
    single = ids[:1, -9:]
    ours = generate(model, single, None, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=8,
                    assistant_model=assistant)
    assert ours[0].shape[1] == single.shape[1] + 8


@pytest.mark.gpu
def test_gpu_decode_reads_no_dense_history(monkeypatch):
    """On CUDA the compressed path must not dequantize the history (reference.gather is never called)."""
    from tq_hf import reference

    def forbidden(*args, **kwargs):
        raise AssertionError("reference.gather called on the CUDA decode path")

    monkeypatch.setattr(reference, "gather", forbidden)
    monkeypatch.delenv("TQ_HF_FORCE_REFERENCE", raising=False)
    model = tiny_model("mistral", dtype=torch.float16, device="cuda")
    ids, mask, _ = left_padded_batch([9, 13], seed=15, device="cuda")
    generate(model, ids, mask, TurboQuantCache(model.config, tq_config=tq_config()), max_new_tokens=6)
    assert os.environ.get("TQ_HF_FORCE_REFERENCE") is None


LEVERS = dict(key_centering=True, value_rotation=True, exact_prefix_tokens=2, recent_window=4)


def test_fidelity_options_survive_crops_in_assisted_decoding():
    """recent_window after crop: positions whose ring slots were overwritten must come from the pool."""
    model, assistant = tiny_model("llama"), tiny_model("llama", seed=1)
    ids, _, _ = left_padded_batch([10], seed=7)
    ids = torch.cat([ids, ids[:, 2:8]], 1)
    compare(model, ids, torch.ones_like(ids), tq_config(**LEVERS), "assisted+levers", max_new_tokens=12,
            assistant_model=assistant)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_fidelity_options_with_chunked_prefill(family):
    model = tiny_model(family)
    ids, mask, _ = left_padded_batch([17, 5], seed=9)  # row 1's first real tokens arrive in a later chunk
    compare(model, ids, mask, tq_config(**LEVERS), f"{family} chunked+levers", max_new_tokens=6,
            prefill_chunk_size=4)


def test_fidelity_options_with_beam_search():
    model = tiny_model("mistral")
    ids, mask, _ = left_padded_batch([9, 6], seed=5)
    compare(model, ids, mask, tq_config(**LEVERS), "beams+levers", max_new_tokens=8, num_beams=3,
            do_sample=False)


# ---- sliding-window layers kept exact and window-sized (the default, sliding_layers="exact") --------
@pytest.mark.parametrize("family", ["gemma3", "mistral", "gpt_oss"])
def test_exact_sliding_layers_match_the_oracle_and_stay_window_sized(family):
    """Left-padded batch generating far past the window (6): same tokens/logits as the oracle (whose
    sliding layers hold their full exact history, windowed by the mask); the sliding layers hold at
    most their window while the compressed layer holds everything."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from tq_hf.cache import TurboQuantLayer

    model = tiny_model(family)
    ids, mask, _ = left_padded_batch([9, 14, 5], seed=31)
    cfg = tq_config(sliding_layers="exact")
    compare(model, ids, mask, cfg, f"{family} exact sliding layers", max_new_tokens=12)
    cache = TurboQuantCache(model.config, tq_config=cfg)
    generate(model, ids, mask, cache, max_new_tokens=12)
    window = model.config.sliding_window
    for layer, kind in zip(cache.layers, getattr(model.config, "layer_types", None) or ["sliding_attention"] * 3):
        if kind == "sliding_attention":
            assert isinstance(layer, DynamicSlidingWindowLayer) and layer.keys.shape[2] < window
        else:
            assert isinstance(layer, TurboQuantLayer) and layer.get_seq_length() == ids.shape[1] + 11


def test_assisted_decoding_with_exact_sliding_layers():
    """generate() crops the cache after rejected candidates; the window-sized sliding layers allow it
    (a prompt 3x past the window), and tokens match the oracle."""
    model, assistant = tiny_model("gemma3"), tiny_model("gemma3", seed=1)
    ids, _, _ = left_padded_batch([20], seed=7)
    compare(model, ids, None, tq_config(sliding_layers="exact"), "assisted, exact sliding layers",
            max_new_tokens=12, assistant_model=assistant)
