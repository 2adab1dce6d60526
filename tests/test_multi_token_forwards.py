"""Forwards of several tokens over a non-empty cache (chunked prefill, a chat's next turn): each attends its own
tokens exactly and the older history as a decode step would, and the key-centering means do not depend on how a
prompt was cut into forwards."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from models import FakeQuantCache, assert_close, generate, left_padded_batch, tiny_model, with_cache
from tq_hf import TurboQuantCache, TurboQuantConfig
from tq_hf.layout import ring_record_bytes

ATOL = 1e-4  # fp32 logits, same math in another order
PROMPT = 200  # > the ring (recent_window 128), < the tiny models' 256 positions


@torch.no_grad()
def feed(model, cache, ids, chunk: int | None) -> torch.Tensor:
    """The prompt through `cache` in forwards of `chunk` tokens (None: one forward); the logits of every position."""
    step = ids.shape[1] if chunk is None else chunk
    out = []
    for i in range(0, ids.shape[1], step):
        x = ids[:, i : i + step]
        pos = torch.arange(i, i + x.shape[1], device=ids.device)[None]
        out.append(model(input_ids=x, position_ids=pos, use_cache=True, **with_cache(cache)).logits)
    return torch.cat(out, 1)


@torch.no_grad()
def forced_decode(model, cache, ids, start: int, steps: int) -> torch.Tensor:
    """`steps` one-token forwards of ids[:, start:] after the cache holds `start` tokens; their logits."""
    out = []
    for i in range(start, start + steps):
        pos = torch.tensor([[i]], device=ids.device)
        out.append(model(input_ids=ids[:, i : i + 1], position_ids=pos, use_cache=True, **with_cache(cache)).logits)
    return torch.cat(out, 1)


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 90, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunk, history", [(1, 0), (32, 0), (96, 0), (32, 512), (64, 160)])
@pytest.mark.parametrize("preset", ["4bit", "k8v4"])
def test_chunked_prefill_matches_the_oracle_and_keeps_the_first_layer_state(preset, chunk, history):
    """Against the oracle fed the same forwards (exact semantics, to float32 rounding); and layer 0, whose K/V do
    not depend on attention, ends with the same means and codes as after one prefill."""
    model = tiny_model("llama")
    # (an exact ring: with int8 records the history a chunk stores again under settling means comes from the records)
    cfg = TurboQuantConfig.from_preset(preset, dense_layer_kl=None, recent_format="exact", exact_dtype="model",
                                       chunk_history_tokens=history)
    ids = prompt(PROMPT + 6)
    whole = TurboQuantCache(model.config, tq_config=cfg)
    feed(model, whole, ids[:, :PROMPT], None)
    ours, oracle = TurboQuantCache(model.config, tq_config=cfg), FakeQuantCache(model.config, cfg)
    logits = feed(model, ours, ids[:, :PROMPT], chunk)
    assert_close(logits, feed(model, oracle, ids[:, :PROMPT], chunk), atol=ATOL, what=f"chunks of {chunk}")
    a, b = ours.layers[0], whole.layers[0]
    if cfg.key_centering:
        assert_close(a.key_offset, b.key_offset, atol=1e-6, rtol=1e-6, what="layer 0 means")
    # the codes of every position, up to float32 rounding: the projections of one token and of a chunk round
    # differently (~1e-7), and a key coordinate on a rounding boundary may then take the neighbouring code
    for x, y, what in zip(a.dequantized(), b.dequantized(), ("keys", "values")):
        moved = ((x - y).abs() > 1e-4).any(-1).float().mean()
        assert moved <= 0.01, f"layer 0 {what}: {moved:.2%} of (position, head) pairs differ after chunks of {chunk}"
    assert_close(forced_decode(model, ours, ids, PROMPT, 6), forced_decode(model, oracle, ids, PROMPT, 6),
                 atol=ATOL, what="decode after chunks")


# int8 records: without key_centering (under settling means a chunk stores the ring's history again from its
# records, which the oracle does not model); the history's records center the keys by a mean of their own
@pytest.mark.parametrize("chunk, recent_format", [(32, "exact"), (96, "exact"), (32, "int8"), (96, "int8")])
def test_the_default_chunk_history_keeps_what_fits_in_a_dense_layers_bytes(chunk, recent_format):
    """chunk_history_tokens=None: from a run's second forward on, a layer keeps the run's latest K/V that fit within
    a dense layer's bytes of its tokens (chunk_history_room), in the ring's format (exact, or int8 records), and the
    next forward attends them. The logits match the oracle fed the same forwards; no layer holding a history
    exceeds a dense layer's bytes; the history grew past the ring and moved the logits (against
    chunk_history_tokens=0); one forward keeps none."""
    model = tiny_model("llama")
    cfg = TurboQuantConfig.from_preset("4bit", dense_layer_kl=None, recent_format=recent_format, exact_dtype="model",
                                       key_centering=recent_format == "exact")
    assert cfg.chunk_history_tokens is None
    # records: the oracle's K/V come from its own forwards (~1e-7 apart), which can move a record's code by one step
    atol = ATOL if recent_format == "exact" else 2e-3
    length = 640  # (past the tiny models' 256 positions: rotary embeddings extend)
    ids = prompt(length, seed=8)
    ours, oracle = TurboQuantCache(model.config, tq_config=cfg), FakeQuantCache(model.config, cfg)
    layer, kept = ours.layers[0], []
    logits = []
    with torch.no_grad():
        for i in range(0, length, chunk):
            x, pos = ids[:, i : i + chunk], torch.arange(i, min(i + chunk, length))[None]
            got = model(input_ids=x, position_ids=pos, use_cache=True, **with_cache(ours)).logits
            want = model(input_ids=x, position_ids=pos, use_cache=True, **with_cache(oracle)).logits
            assert_close(got, want, atol=atol, what=f"the chunk at {i}")
            logits.append(got)
            for each in ours.layers:
                rows, heads, dim = each.rows, each.layout.num_kv_heads, each.layout.head_dim
                dense = rows * heads * each.length * 2 * dim * 4  # float32 K/V (exact_dtype "model")
                assert each.chunk_history_bytes() == 0 or each.memory_footprint() <= dense, (i, each.length)
            kept.append(layer._chunk_history_tokens())
    assert kept[0] == 0, "a run's first forward keeps none"
    assert max(kept) > layer.ring_size, f"the history never outgrew the ring: {kept}"
    cfg_off = dataclasses.replace(cfg, chunk_history_tokens=0)
    off = feed(model, TurboQuantCache(model.config, tq_config=cfg_off), ids, chunk)
    assert (torch.cat(logits, 1) - off).abs().max() > 100 * ATOL, "the history changed nothing"
    single = TurboQuantCache(model.config, tq_config=cfg)
    feed(model, single, ids, None)
    assert all(each.chunk_history_bytes() == 0 for each in single.layers), "one forward keeps none"


@pytest.mark.parametrize("preset", ["3bit", "4bit"])
def test_chunks_attend_the_tokens_of_earlier_chunks_exactly(preset):
    """With chunk_history_tokens covering the prompt (and an exact ring for its start), every chunk of a chunked
    prefill attends the whole history exactly: the prompt's logits are a DynamicCache's, to float32 rounding.
    Without it the history beyond the ring is read compressed and the logits move by far more."""
    model = tiny_model("llama")
    ids = prompt(PROMPT, seed=4)
    want = feed(model, DynamicCache(), ids, None)
    moved = {}
    for history in (256, 0):
        cfg = TurboQuantConfig.from_preset(preset, dense_layer_kl=None, recent_format="exact", exact_dtype="model",
                                           chunk_history_tokens=history)
        got = feed(model, TurboQuantCache(model.config, tq_config=cfg), ids, 32)
        moved[history] = (got - want).abs().max().item()
    assert moved[256] < ATOL, f"chunks over an exact history moved the logits by {moved[256]:.2e}"
    assert moved[0] > 100 * ATOL, f"without the chunk history the logits moved only {moved[0]:.2e}"


@pytest.mark.parametrize("recent_format, dtype", [("int8", torch.float32), ("exact", torch.float32),
                                                   ("int8", torch.bfloat16)])
def test_the_chunk_history_is_transient(recent_format, dtype):
    """Kept between forwards of several tokens (counted by memory_footprint; int8 records for a float32 model whose
    ring holds records, else the model's dtype), freed by the next one-token step; a chunk after decode steps reads
    the ring again (the oracle test covers its values)."""
    model = tiny_model("llama", dtype=dtype)
    cfg = TurboQuantConfig.from_preset("4bit", dense_layer_kl=None, chunk_history_tokens=160,
                                       recent_format=recent_format)
    ids = prompt(PROMPT + 40, seed=6)
    cache = TurboQuantCache(model.config, tq_config=cfg)
    feed(model, cache, ids[:, :PROMPT], 64)
    layer = cache.layers[0]
    heads, dim = layer.layout.num_kv_heads, layer.layout.head_dim
    # the last 160 positions (40-200): the first chunk's last 24 (a trimmed copy) and the later chunks whole, keys
    # and values as int8 records (and one fp32 key-centering vector per head), or as the model gave them
    records = recent_format == "int8" and dtype == torch.float32
    history_bytes = lambda tokens: (2 * tokens * heads * ring_record_bytes(dim) + heads * dim * 4 if records
                                    else 2 * tokens * heads * dim * dtype.itemsize)
    kept = history_bytes(160)
    assert layer.chunk_history_bytes() == kept
    assert [k.shape[2] for k, _ in layer._chunk_history] == [24, 64, 64, 8]
    assert all(x.shape[2] == 160 for x in layer._chunk_history_window())
    assert layer.memory_footprint() == layer.pool_bytes() + layer.exact_side_bytes() + kept
    forced_decode(model, cache, ids, PROMPT, 1)
    assert layer.chunk_history_bytes() == 0 and layer.memory_footprint() == layer.pool_bytes() + layer.exact_side_bytes()
    feed_from = PROMPT + 1
    x = ids[:, feed_from : feed_from + 20]
    model(input_ids=x, position_ids=torch.arange(feed_from, feed_from + 20)[None], use_cache=True, **with_cache(cache))
    # a new run: its own 20 tokens kept (a next chunk attends them once the run holds the ring's 128)
    assert layer.chunk_history_bytes() == history_bytes(20)


def test_a_forward_of_several_tokens_attends_its_own_tokens_exactly():
    """A second forward longer than the ring: with every token in the pool compressed, its queries see its own
    keys exactly. Against plain fp32 attention: a cache that quantized them (as before) is off by > 1e-2."""
    model = tiny_model("llama")
    cfg = TurboQuantConfig.from_preset("3bit", recent_window=8, exact_prefix_tokens=0, key_centering=False,
                                       dense_layer_kl=None)
    ids = prompt(120, seed=1)
    ours, exact = TurboQuantCache(model.config, tq_config=cfg), DynamicCache()
    feed(model, ours, ids[:, :1], None)
    feed(model, exact, ids[:, :1], None)
    got, want = feed(model, ours, ids[:, 1:], None), feed(model, exact, ids[:, 1:], None)
    # position 0 is the only compressed key any query sees: the rest is the forward's own, exact
    k0, v0 = ours.layers[0].dequantized(tokens=1)
    assert not torch.equal(k0, exact.layers[0].keys[:, :, :1].float())
    oracle = FakeQuantCache(model.config, cfg)
    feed(model, oracle, ids[:, :1], None)
    assert_close(got, feed(model, oracle, ids[:, 1:], None), atol=ATOL, what="second forward")


@pytest.mark.parametrize("history", [0, 160])
def test_generate_with_prefill_chunks_equals_the_oracle(history):
    model = tiny_model("qwen2")
    ids, mask, _ = left_padded_batch([PROMPT - 40, PROMPT - 3], seed=2)  # row 0's padding spans the first chunk
    cfg = TurboQuantConfig.from_preset("4bit", dense_layer_kl=None, recent_format="exact", exact_dtype="model",
                                       chunk_history_tokens=history)  # (as above)
    ours = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=6,
                    prefill_chunk_size=32)
    oracle = generate(model, ids, mask, FakeQuantCache(model.config, cfg, mask), max_new_tokens=6,
                      prefill_chunk_size=32)
    assert torch.equal(ours[0], oracle[0])
    assert_close(ours[1], oracle[1], atol=ATOL, rtol=1e-4, what="chunked generate")


@pytest.mark.parametrize("padded", [False, True])
def test_the_attention_names_the_common_length_of_unpadded_rows(padded, monkeypatch):
    """What lets ops.paged_attention take the dense route: a forward of several tokens over unpadded rows passes
    the rows' common length and no kv_start; padded rows pass kv_start and no length, one-token steps no length."""
    from tq_hf import ops

    calls = []
    real = ops.paged_attention
    monkeypatch.setattr(ops, "paged_attention", lambda *a, **k: calls.append((a[0].shape[2], k)) or real(*a, **k))
    model = tiny_model("llama")
    lengths = [PROMPT - 40, PROMPT] if padded else [PROMPT, PROMPT]
    ids, mask, _ = left_padded_batch(lengths, seed=5)
    cfg = TurboQuantConfig.from_preset("4bit", dense_layer_kl=None)
    generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=3, prefill_chunk_size=64)
    chunks = [k for lq, k in calls if lq > 1]
    steps = [k for lq, k in calls if lq == 1]
    assert chunks and steps
    for k in chunks:
        if padded:
            assert k["length"] is None and k["kv_start"] is not None
        else:
            assert k["kv_start"] is None and k["length"] == k["max_seq_len"]
    assert all(k["length"] is None for k in steps)  # a decode step keeps its held plan
    if padded:
        assert all(k["kv_start"] is not None for k in steps)


def test_a_second_turn_is_close_to_one_prefill_of_the_conversation():
    """Multi-turn reuse: turn 2's decode over the cache of turn 1 vs a fresh cache fed the whole conversation.
    They differ only by what turn 1's own decode steps attended through the pool (a handful of tokens)."""
    model = tiny_model("llama")
    cfg = TurboQuantConfig.from_preset("k8v4", dense_layer_kl=None)
    ids = prompt(PROMPT, seed=3)
    cache = TurboQuantCache(model.config, tq_config=cfg)
    first, _ = generate(model, ids[:, :150], None, cache, max_new_tokens=4)
    conversation = torch.cat([first, ids[:, 150:]], 1)
    second = generate(model, conversation, None, cache, max_new_tokens=6)
    fresh = generate(model, conversation, None, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=6)
    reference = generate(model, conversation, None, DynamicCache(), max_new_tokens=6)
    kl = lambda a, b: torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True,
                                                 reduction="batchmean")
    assert torch.equal(second[0], fresh[0])
    assert kl(second[1][0], fresh[1][0]) < 1e-3  # turn 2's first forward: its own 50 tokens exact
    assert kl(second[1], reference[1]) < 2 * kl(fresh[1], reference[1]) + 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gpt_oss", "gemma2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
# 96: llama in fp16 takes the dense route (kernels/history.py); 32 with 160 history tokens: windows of 192 slots
@pytest.mark.parametrize("chunk, history", [(48, 0), (96, 0), (32, 160)])
def test_gpu_chunked_prefill_kernels_match_the_reference_path(family, dtype, chunk, history, monkeypatch):
    """The kernels over a forward's own ring (its tokens and the W before them, or the chunk history) vs
    reference.py on CUDA."""
    from tq_hf.kernels import history as dense_route  # (not `history`: the parameter of that name)

    # from 64 queries (the tiny models' 256 positions are far below the real threshold)
    monkeypatch.setattr(dense_route, "prefers_dense_route", lambda query, layout, length: query.shape[2] >= 64)
    model = tiny_model(family, dtype=dtype, device="cuda")
    ids = prompt(PROMPT + 6, seed=4).cuda()
    cfg = TurboQuantConfig.from_preset("4bit", dense_layer_kl=None, chunk_history_tokens=history)
    runs = []
    for force in ("0", "1"):
        monkeypatch.setenv("TQ_HF_FORCE_REFERENCE", force)
        cache = TurboQuantCache(model.config, tq_config=cfg)
        runs.append(torch.cat([feed(model, cache, ids[:, :PROMPT], chunk), forced_decode(model, cache, ids, PROMPT, 6)], 1))
    # max |diff| of the two paths over these 3 x 2 x 3 cases: float32 2.5e-3 under Triton's interpreter, 1.8e-3 on an
    # H100 (llama; the kernels' MMAs take 16-bit operands); float16 0.017 and 0.0625. A ring token attended through
    # the pool instead (recent_from + 1 in the kernel path) moves float32 llama's logits by 2.4e-2.
    atol = 0.1 if dtype == torch.float16 else 5e-3
    assert_close(runs[0], runs[1], atol=atol, rtol=1e-2, what=f"{family} {dtype} kernels vs reference")
