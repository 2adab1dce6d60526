"""A fixed-capacity TurboQuantCache (max_cache_len) under torch.compile, on CPU (reference path).

The graph checks compile with backend="eager" (dynamo traces the whole step: graph breaks and
recompiles show exactly as with inductor, without a C++ build per test) and one test runs inductor.
What is checked: one graph for the whole decode step, no graph break, no recompilation from one
step to the next (torch._dynamo.config.error_on_recompile), and the same tokens as the eager
growing cache, whose own equality with an independent oracle tests/test_generate.py checks. The
eager fixed-capacity cache must equal the growing cache: same positions, same bytes stored.
"""

from __future__ import annotations

import functools
import inspect
import traceback

import pytest
import torch
import torch._dynamo
from models import assert_close, generate, left_padded_batch, tiny_model, tq_config, with_cache
from torch._dynamo.utils import counters
from transformers import CompileConfig
from transformers.cache_utils import StaticLayer

from tq_hf import PRESETS, TurboQuantCache, TurboQuantCacheFullError, TurboQuantConfig, reference
from tq_hf.cache import TurboQuantLayer

ATOL = 1e-5  # fp32 logits: the fixed cache reads the same bytes through a longer (masked) block table
STEPS = 10  # decode steps after the first compiled one (the warm-up that traces)
COMPILED_FP16_ATOL = 8e-2  # fp16 logits, compiled (inductor) vs eager; the tokens must still be identical


@pytest.fixture
def dynamo():
    """A clean dynamo (no graphs from earlier tests), recompiles raising, counters cleared."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield counters
    torch._dynamo.reset()


def assert_one_graph(stats):
    assert dict(stats["graph_break"]) == {}, f"graph breaks: {dict(stats['graph_break'])}"
    assert stats["stats"]["unique_graphs"] == 1, f"graphs: {dict(stats['stats'])}"


@torch.no_grad()
def decode_loop(model, cache, forward, ids, steps=STEPS + 1):
    """Prefill eagerly, then greedy decode through `forward` (positions given, no mask: nothing padded)."""
    out = model(input_ids=ids, use_cache=True, **with_cache(cache))
    token = out.logits[:, -1:].argmax(-1)
    tokens, logits = [token], [out.logits[:, -1]]
    # transformers versions whose models still take cache_position derive it from the cache length unless given
    takes_cache_position = "cache_position" in inspect.signature(model.model.forward).parameters
    for pos in range(ids.shape[1], ids.shape[1] + steps):
        extra = {"cache_position": torch.tensor([pos], device=ids.device)} if takes_cache_position else {}
        out = forward(input_ids=token, position_ids=torch.full_like(token, pos), use_cache=True, **with_cache(cache),
                      **extra)
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(token)
        logits.append(out.logits[:, -1].clone())  # a CUDA graph's next replay overwrites its outputs
    return torch.cat(tokens, 1), torch.stack(logits)


def compile_config(**kwargs) -> CompileConfig:
    """generate()'s compile settings for a CPU test: dynamo with the eager backend, on any device."""
    config = CompileConfig(**{"backend": "eager", "fullgraph": True, "mode": None, **kwargs})
    config._compile_all_devices = True  # generate() compiles on CUDA-like devices only, unless told
    return config


def prompts(batch=2, length=11, seed=0):
    return torch.randint(3, 90, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---- the manual decode loop: torch.compile(model.forward, fullgraph=True) -----------------------
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_compiled_decode_step_is_one_graph_with_the_eager_tokens(preset, dynamo):
    model = tiny_model("llama")
    cfg = tq_config(preset=preset)
    ids = prompts()
    eager = decode_loop(model, TurboQuantCache(model.config, tq_config=cfg), model.forward, ids)
    compiled = decode_loop(model, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=64),
                           torch.compile(model.forward, fullgraph=True, backend="eager"), ids)
    assert_one_graph(dynamo)
    assert torch.equal(compiled[0], eager[0]), f"{preset}: tokens differ\n{compiled[0]}\n{eager[0]}"
    assert_close(compiled[1], eager[1], atol=ATOL, rtol=1e-5, what=f"{preset} logits")


def test_compiled_decode_step_with_an_int8_ring(dynamo):
    """recent_format "int8": the compiled step's store writes its token's records (their slot from the device
    positions) and the attention reads them as the eager step does: one graph, the same tokens, the same logits
    (the records hold the same codes: both paths round the same fp32 vectors)."""
    model = tiny_model("llama")
    cfg = tq_config(recent_format="int8")
    ids = prompts()
    eager = decode_loop(model, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=64), model.forward, ids)
    compiled = decode_loop(model, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=64),
                           torch.compile(model.forward, fullgraph=True, backend="eager"), ids)
    assert_one_graph(dynamo)
    assert torch.equal(compiled[0], eager[0]), f"tokens differ\n{compiled[0]}\n{eager[0]}"
    assert_close(compiled[1], eager[1], atol=ATOL, rtol=1e-5, what="int8 ring logits")


def test_compiled_step_as_the_first_compressed_forward_compiles_once(dynamo, monkeypatch):
    """A process whose first forward over compressed history is the compiled one (an exact prefill, then the
    compiled loop: what a manual loop or generate() does) must not trace a write of a host-side memo: the next step's
    guards would see it changed and compile again (error_on_recompile raises)."""
    import tq_hf.attention

    monkeypatch.setattr(tq_hf.attention, "_CROSS_ATTENTION_CLASSES", {})
    model = tiny_model("llama")
    decode_loop(model, TurboQuantCache(model.config, tq_config=tq_config(), max_cache_len=64),
                torch.compile(model.forward, fullgraph=True, backend="eager"), prompts(), steps=4)
    assert_one_graph(dynamo)
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(tq_hf.attention, "_CROSS_ATTENTION_CLASSES", {})  # generate()'s own compile path alike
    ids, mask, _ = left_padded_batch([7, 11], seed=3)
    generate(model, ids, mask, TurboQuantCache(model.config, tq_config=tq_config(), max_cache_len=40), max_new_tokens=6,
             compile_config=compile_config())
    assert_one_graph(dynamo)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("sliding", ["exact", "compressed"])
def test_compiled_decode_of_other_families(family, sliding, dynamo):
    """Sliding windows, softcapping, attention sinks. Sliding layers kept exact are transformers' own
    StaticSlidingWindowLayer, whose host-int length makes dynamo compile once more (then dynamic), exactly as
    under a StaticCache: two graphs, no more."""
    model = tiny_model(family)
    cfg = tq_config(sliding_layers=sliding)
    ids = prompts(length=9)
    eager = decode_loop(model, TurboQuantCache(model.config, tq_config=cfg), model.forward, ids)
    with torch._dynamo.config.patch(error_on_recompile=sliding == "compressed"):
        compiled = decode_loop(model, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=32),
                               torch.compile(model.forward, fullgraph=True, backend="eager"), ids)
    if sliding == "compressed":
        assert_one_graph(dynamo)
    else:
        assert dict(dynamo["graph_break"]) == {} and dynamo["stats"]["unique_graphs"] <= 2, dict(dynamo["stats"])
    assert torch.equal(compiled[0], eager[0])
    assert_close(compiled[1], eager[1], atol=ATOL, rtol=1e-5, what=f"{family} {sliding} logits")


@pytest.mark.slow
def test_inductor_compiles_the_decode_step(dynamo):
    """The default backend on CPU: the custom ops run inside an inductor graph (the pool mutated in place)."""
    model = tiny_model("llama")
    ids = prompts()
    eager = decode_loop(model, TurboQuantCache(model.config, tq_config=tq_config()), model.forward, ids, steps=9)
    compiled = decode_loop(model, TurboQuantCache(model.config, tq_config=tq_config(), max_cache_len=48),
                           torch.compile(model.forward, fullgraph=True), ids, steps=9)
    assert_one_graph(dynamo)
    assert torch.equal(compiled[0], eager[0])
    assert_close(compiled[1], eager[1], atol=1e-4, rtol=1e-4, what="inductor logits")


def test_compiled_steps_keep_the_cache_state_readable(dynamo):
    """After compiled steps the host length follows the device lengths, and eager steps continue the cache."""
    model = tiny_model("llama")
    ids = prompts()
    cache = TurboQuantCache(model.config, tq_config=tq_config(), max_cache_len=40)
    decode_loop(model, cache, torch.compile(model.forward, fullgraph=True, backend="eager"), ids, steps=5)
    assert cache.get_seq_length() == ids.shape[1] + 5
    layer = next(layer for layer in cache.layers if isinstance(layer, TurboQuantLayer))
    assert layer.seq_lens.tolist() == [ids.shape[1] + 5] * ids.shape[0]
    cache.crop(-2)
    assert cache.get_seq_length() == ids.shape[1] + 3


@pytest.mark.slow
def test_a_compiled_prefill_runs_its_first_update_eagerly(dynamo):
    """generate()'s chunked prefill (compiled on transformers >= 5.24) runs its settling chunks uncompiled, then
    decodes as usual; a prefill inside a compiled region (a manual loop's) takes a graph break for each layer's
    first update (host logic: padding, means, prefix bound), which fullgraph refuses."""
    model = tiny_model("llama")
    ids, mask, _ = left_padded_batch([5, 9], seed=10)
    cfg = tq_config()
    eager = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=6,
                     prefill_chunk_size=4)
    with torch._dynamo.config.patch(error_on_recompile=False):
        compiled = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=24),
                            max_new_tokens=6, prefill_chunk_size=4, compile_config=compile_config(fullgraph=False))
    assert torch.equal(compiled[0], eager[0])
    assert_close(compiled[1], eager[1], atol=ATOL, rtol=1e-5, what="chunked prefill logits")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="_untraced_update|disable"), torch.no_grad():
        cache = TurboQuantCache(model.config, tq_config=cfg, max_cache_len=24)
        torch.compile(model.forward, fullgraph=True, backend="eager")(input_ids=prompts(), **with_cache(cache))


def test_generate_compiles_the_chunks_after_the_settling_ones_without_graph_breaks(dynamo):
    """generate(prefill_chunk_size=...) over a fixed-capacity cache of more layers than dynamo's recompile limit (8):
    the chunks in which the cache settles state on the host (the batch's first, and those while the key-centering
    means settle) run uncompiled, the others and the decode steps compile whole. Compiled, a settling chunk broke
    the graph inside the model's layer loop: dynamo then skipped the model's frame and compiled each layer's frames
    apart, one per layer index, until the limit. A second generate() after reset() compiles nothing more, and the
    tokens are the eager ones."""
    model = tiny_model("llama", layers=10)
    ids, mask, _ = left_padded_batch([9, 13], seed=4)
    cfg = tq_config()  # the last layer dense: transformers' StaticLayer allocates its buffers in the eager chunk
    eager = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=4,
                     prefill_chunk_size=4)
    cache = TurboQuantCache(model.config, tq_config=cfg, max_cache_len=24)
    with torch._dynamo.config.patch(error_on_recompile=False):  # chunks of 4 and 1 tokens, then the decode step
        compiled = generate(model, ids, mask, cache, max_new_tokens=4, prefill_chunk_size=4,
                            compile_config=compile_config(fullgraph=False))
    assert dict(dynamo["graph_break"]) == {}, f"graph breaks: {dict(dynamo['graph_break'])}"
    assert 1 <= dynamo["stats"]["unique_graphs"] <= 3, dict(dynamo["stats"])  # not one per layer
    assert torch.equal(compiled[0], eager[0])
    assert_close(compiled[1], eager[1], atol=ATOL, rtol=1e-5, what="chunked prefill logits")
    counters.clear()
    cache.reset()
    again = generate(model, ids, mask, cache, max_new_tokens=4, prefill_chunk_size=4,
                     compile_config=compile_config(fullgraph=False))  # error_on_recompile: the same graphs serve
    assert dict(dynamo["graph_break"]) == {} and dynamo["stats"]["unique_graphs"] == 0, dict(dynamo["stats"])
    assert torch.equal(again[0], eager[0])


def test_a_compiled_prefill_reserves_the_decode_scratch(dynamo, monkeypatch):
    """generate()'s chunked prefill compiles its chunks: each layer still reserves its decode steps' split scratch in
    the first chunk, which runs uncompiled, so the first captured decode step allocates none. The reference path
    splits nothing, so the kernels' need is stood in for: 4096 elements."""
    from tq_hf import ops

    monkeypatch.setattr(ops, "decode_workspace_numel", lambda *args, **kwargs: 4096)
    model = tiny_model("llama")
    ids, mask, _ = left_padded_batch([5, 9], seed=12)
    cache = TurboQuantCache(model.config, tq_config=tq_config(), max_cache_len=24)
    with torch._dynamo.config.patch(error_on_recompile=False):
        generate(model, ids, mask, cache, max_new_tokens=3, prefill_chunk_size=4,
                 compile_config=compile_config(fullgraph=False))
    assert dynamo["stats"]["unique_graphs"] >= 1  # the prefill chunks did run compiled
    scratch = [layer.decode_workspace for layer in cache.layers if isinstance(layer, TurboQuantLayer)]
    assert scratch and all(w is not None and w.numel() == 4096 and w.dtype == torch.float32 for w in scratch), scratch


@pytest.mark.slow
def test_a_compiled_prefill_sizes_the_decode_scratch_for_a_new_batch(dynamo, monkeypatch):
    """After reset() a batch of another size gets buffers of its size: its compiled prefill reserves a decode scratch
    for it too (the kernels' need stood in for: 1024 elements per row)."""
    from tq_hf import ops

    monkeypatch.setattr(ops, "decode_workspace_numel", lambda query, *args, **kwargs: 1024 * query.shape[0])
    model = tiny_model("llama")
    cache = TurboQuantCache(model.config, tq_config=tq_config(), max_cache_len=24)
    for rows in (2, 4):
        cache.reset()
        ids, mask, _ = left_padded_batch([5, 9, 7, 6][:rows], seed=12)
        with torch._dynamo.config.patch(error_on_recompile=False):
            generate(model, ids, mask, cache, max_new_tokens=2, prefill_chunk_size=4,
                     compile_config=compile_config(fullgraph=False))
        scratch = [layer.decode_workspace for layer in cache.layers if isinstance(layer, TurboQuantLayer)]
        assert scratch and all(w is not None and w.numel() == 1024 * rows for w in scratch), (rows, scratch)


def test_a_compiled_prefill_allocates_the_exact_layers_outside_the_graph(dynamo, monkeypatch):
    """generate()'s chunked prefill compiles its chunks: a dense layer's buffers (transformers' StaticLayer) are still
    allocated eagerly (in the first chunk, uncompiled; in a manual loop's compiled prefill, behind a graph break), as
    CUDA graph trees cannot hand a buffer made inside a captured chunk to the next one. Each dense layer initializes
    once, outside compilation, and the tokens match the eager run."""
    seen = []
    initialize = StaticLayer.lazy_initialization

    def recording(layer, *args, **kwargs):
        seen.append(torch.compiler.is_compiling())
        return initialize(layer, *args, **kwargs)

    model = tiny_model("llama")
    ids, mask, _ = left_padded_batch([5, 9], seed=13)
    eager = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=tq_config(), max_cache_len=24),
                     max_new_tokens=3, prefill_chunk_size=4)
    monkeypatch.setattr(StaticLayer, "lazy_initialization", recording)
    cache = TurboQuantCache(model.config, tq_config=tq_config(), max_cache_len=24)
    with torch._dynamo.config.patch(error_on_recompile=False):
        compiled = generate(model, ids, mask, cache, max_new_tokens=3, prefill_chunk_size=4,
                            compile_config=compile_config(fullgraph=False))
    assert dynamo["stats"]["unique_graphs"] >= 1  # the prefill chunks did run compiled
    dense = [layer for layer in cache.layers if isinstance(layer, StaticLayer)]
    assert dense and seen == [False] * len(dense), seen
    assert torch.equal(compiled[0], eager[0])
    seen.clear()
    with torch._dynamo.config.patch(error_on_recompile=False), torch.no_grad():
        cache = TurboQuantCache(model.config, tq_config=tq_config(), max_cache_len=24)
        torch.compile(model.forward, backend="eager")(input_ids=ids, attention_mask=mask, **with_cache(cache))
    assert seen == [False] * len(dense), seen


# ---- the fixed capacity in eager mode ---------------------------------------------------------------
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_fixed_capacity_equals_the_growing_cache_with_left_padding(preset):
    model = tiny_model("llama")
    cfg = tq_config(preset=preset)
    ids, mask, _ = left_padded_batch([7, 12, 3], seed=3)
    growing = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=10)
    fixed = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=40),
                     max_new_tokens=10)
    assert torch.equal(fixed[0], growing[0])
    assert_close(fixed[1], growing[1], atol=ATOL, rtol=1e-5, what=f"{preset} logits")


@pytest.mark.parametrize("kwargs", [
    {"num_beams": 3}, {"do_sample": True, "num_return_sequences": 2}, {"prefill_chunk_size": 4},
    {"prompt_lookup_num_tokens": 3},
], ids=["beams", "sampling", "chunked_prefill", "prompt_lookup"])
def test_generate_modes_over_a_fixed_capacity(kwargs):
    model = tiny_model("llama")
    ids, mask, _ = left_padded_batch([9, 13], seed=4)
    if "prompt_lookup_num_tokens" in kwargs:
        ids, mask = ids[:1], mask[:1]
    cfg = tq_config()
    torch.manual_seed(0)
    growing = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=8, **kwargs)
    torch.manual_seed(0)
    fixed = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=48),
                     max_new_tokens=8, **kwargs)
    assert torch.equal(fixed[0], growing[0])
    assert_close(fixed[1], growing[1], atol=ATOL, rtol=1e-5, what=f"{kwargs} logits")


def test_assisted_decoding_crops_a_fixed_capacity():
    model, assistant = tiny_model("llama"), tiny_model("llama", seed=1)
    ids = prompts(batch=1, length=9)
    cfg = tq_config()
    growing = generate(model, ids, None, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=10,
                       assistant_model=assistant)
    fixed = generate(model, ids, None, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=32),
                     max_new_tokens=10, assistant_model=assistant)
    assert torch.equal(fixed[0], growing[0])


def test_other_attention_implementation_over_a_fixed_capacity():
    """sdpa over the dequantized capacity (as over a StaticCache) equals sdpa over the growing cache's history."""
    model = tiny_model("llama", attn="sdpa")
    ids, mask, _ = left_padded_batch([6, 10], seed=5)
    cfg = tq_config()
    growing = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=6)
    fixed = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=24),
                     max_new_tokens=6)
    assert torch.equal(fixed[0], growing[0])
    assert_close(fixed[1], growing[1], atol=1e-4, rtol=1e-4, what="sdpa logits")


def test_other_attention_implementation_compiles_over_a_fixed_capacity(dynamo):
    """sdpa over a fixed-capacity cache, compiled: the dequantization (with the codebook it needs) stays out of the
    trace, so the decode step is one graph, with the eager growing cache's tokens."""
    model = tiny_model("llama", attn="sdpa")
    cfg = tq_config()
    ids = prompts()
    eager = decode_loop(model, TurboQuantCache(model.config, tq_config=cfg), model.forward, ids)
    cache = TurboQuantCache(model.config, tq_config=cfg, max_cache_len=40)
    compiled = decode_loop(model, cache, torch.compile(model.forward, fullgraph=True, backend="eager"), ids)
    assert_one_graph(dynamo)
    assert torch.equal(compiled[0], eager[0])
    assert_close(compiled[1], eager[1], atol=1e-4, rtol=1e-4, what="sdpa logits")


def test_generate_reads_nothing_back_between_compiled_steps(dynamo, monkeypatch):
    """The mask generate() builds before each compiled step takes the queries' offset from the cache: after compiled
    steps that is the device length, handed over as a tensor (as StaticLayer's), not read back (a GPU sync). Only the
    prefill's preparation (eager; sdpa_mask may check its padding there) reads a tensor."""
    model = tiny_model("llama")
    ids, mask, _ = left_padded_batch([7, 11], seed=9)
    cache = TurboQuantCache(model.config, tq_config=tq_config(), max_cache_len=40)
    generate(model, ids, mask, cache, max_new_tokens=4, compile_config=compile_config())  # traces the step
    prepared, reads = [], []
    prepare = model.prepare_inputs_for_generation

    @functools.wraps(prepare)  # generate() reads its signature
    def counted_prepare(*args, **kwargs):
        prepared.append(1)
        return prepare(*args, **kwargs)

    def recording(name):
        method = getattr(torch.Tensor, name)

        def read(self, *args):
            if any(frame.name == "counted_prepare" for frame in traceback.extract_stack()):
                reads.append((len(prepared), name))
            return method(self, *args)
        return read

    cache.reset()
    with monkeypatch.context() as patch:
        patch.setattr(model, "prepare_inputs_for_generation", counted_prepare)
        for name in ("__int__", "__index__", "__bool__", "__float__", "item", "tolist"):
            patch.setattr(torch.Tensor, name, recording(name))
        again = generate(model, ids, mask, cache, max_new_tokens=6, compile_config=compile_config())
    assert len(prepared) == 6
    steps = [(step, name) for step, name in reads if step > 1]
    assert steps == [], f"host reads of tensors (step, method) while generate() prepared a decode step: {steps}"
    eager = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=tq_config()), max_new_tokens=6)
    assert torch.equal(again[0], eager[0])


def test_a_fixed_capacity_is_reused_across_generate_calls_without_reallocating():
    model = tiny_model("llama")
    cfg = tq_config()
    cache = TurboQuantCache(model.config, tq_config=cfg, max_cache_len=32)
    ids, mask, _ = left_padded_batch([5, 8], seed=6)
    generate(model, ids, mask, cache, max_new_tokens=4)
    pools = [layer.pool for layer in cache.layers if isinstance(layer, TurboQuantLayer)]
    cache.reset()
    ids, mask, _ = left_padded_batch([9, 4], seed=7)
    again = generate(model, ids, mask, cache, max_new_tokens=6)
    fresh = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=6)
    assert torch.equal(again[0], fresh[0])
    assert_close(again[1], fresh[1], atol=ATOL, rtol=1e-5, what="reused cache logits")
    assert all(a is b for a, b in zip(pools, (l.pool for l in cache.layers if isinstance(l, TurboQuantLayer))))


def test_fixed_capacity_layers_share_their_read_only_tables(dynamo):
    """The block table and the rows' first slots are the same in every fixed-capacity layer: one pair of tensors
    (a compiled step takes and guards them once, not per layer), which decode steps and beam reorders never write,
    equal to what each layer's geometry gives; a growing cache keeps its own per layer."""
    model = tiny_model("llama")
    cfg = tq_config(preset="4bit", dense_layer_kl=None)
    cache = TurboQuantCache(model.config, tq_config=cfg, max_cache_len=64)
    ids = prompts()
    decode_loop(model, cache, torch.compile(model.forward, fullgraph=True, backend="eager"), ids)
    assert_one_graph(dynamo)
    layers = [layer for layer in cache.layers if isinstance(layer, TurboQuantLayer)]
    assert len(layers) >= 2
    first = layers[0]
    t, rows = first.layout.block_size, first.rows
    want_table = torch.arange(first.capacity)[None, :] * rows + torch.arange(rows)[:, None]
    for layer in layers:
        assert layer.block_table is first.block_table and layer._row_slots is first._row_slots
    assert torch.equal(first.block_table.long(), want_table)
    assert torch.equal(first._row_slots, torch.arange(rows) * t)
    cache.reorder_cache(torch.tensor([1, 0]))
    assert all(layer.block_table is first.block_table for layer in layers)
    assert torch.equal(first.block_table.long(), want_table)
    growing = TurboQuantCache(model.config, tq_config=cfg)
    decode_loop(model, growing, model.forward, ids, steps=2)
    own = [layer for layer in growing.layers if isinstance(layer, TurboQuantLayer)]
    assert own[0].block_table is not own[1].block_table


def test_a_fixed_capacity_takes_another_batch_size_after_reset():
    """reset() empties a fixed-capacity cache for a batch of any size: the compressed layers' pools and the dense
    layer's buffers take the new size (the same tokens as a fresh cache), a batch of the same size keeps the dense
    buffers (static addresses), and without reset() another batch size is refused."""
    model = tiny_model("llama")
    cfg = tq_config()  # the last layer dense
    cache = TurboQuantCache(model.config, tq_config=cfg, max_cache_len=32)
    ids, mask, _ = left_padded_batch([5, 8], seed=6)
    generate(model, ids, mask, cache, max_new_tokens=3)
    dense = cache.layers[-1]
    assert isinstance(dense, StaticLayer) and dense.keys.shape[0] == 2
    buffers = dense.keys.data_ptr()
    cache.reset()
    generate(model, ids, mask, cache, max_new_tokens=3)
    assert dense.keys.data_ptr() == buffers
    cache.reset()
    ids, mask, _ = left_padded_batch([9, 4, 7, 6], seed=7)
    again = generate(model, ids, mask, cache, max_new_tokens=4)
    fresh = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=32),
                     max_new_tokens=4)
    assert cache.layers[-1].keys.shape[0] == 4
    assert torch.equal(again[0], fresh[0])
    assert_close(again[1], fresh[1], atol=ATOL, rtol=1e-5, what="logits after a new batch size")
    with pytest.raises(ValueError, match="batch size changed from 4 to 2 on a non-empty TurboQuantCache; call reset"):
        generate(model, ids[:2], mask[:2], cache, max_new_tokens=2)


def test_overflow_raises_in_eager_and_stops_storing_when_compiled(dynamo):
    model = tiny_model("llama")
    ids = prompts(length=8)
    with pytest.raises(TurboQuantCacheFullError, match="max_cache_len=10"):
        decode_loop(model, TurboQuantCache(model.config, tq_config=tq_config(), max_cache_len=10), model.forward,
                    ids, steps=4)
    # every layer compressed (a full-precision layer is transformers' StaticLayer, which indexes out of bounds)
    cache = TurboQuantCache(model.config, tq_config=TurboQuantConfig.from_preset("4bit"), max_cache_len=10)
    decode_loop(model, cache, torch.compile(model.forward, fullgraph=True, backend="eager"), ids, steps=5)
    assert cache.get_seq_length() == 10  # the documented behaviour: tokens past the capacity are not stored


@pytest.mark.parametrize("bad", [0, -3, 2.5, "64"])
def test_bad_max_cache_len_is_rejected(bad):
    with pytest.raises(ValueError, match="max_cache_len must be a positive int"):
        TurboQuantCache(tiny_model("llama").config, max_cache_len=bad)


def test_compileable_only_with_a_fixed_capacity():
    model = tiny_model("mistral")  # sliding layers kept exact by default: transformers' static window layers
    assert TurboQuantCache(model.config, preset="4bit", max_cache_len=16).is_compileable
    assert not TurboQuantCache(model.config, preset="4bit").is_compileable


# ---- generate()'s own compile path ----------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_generate_compiles_the_decode_step_by_itself(family, dynamo):
    """With a compileable cache generate() compiles (model._compiled_call); left padding; same tokens as eager."""
    model = tiny_model(family)
    cfg = tq_config()
    ids, mask, _ = left_padded_batch([7, 11, 9], seed=8)
    eager = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=10)
    cache = TurboQuantCache(model.config, tq_config=cfg, max_cache_len=40)
    assert model._valid_auto_compile_criteria({"cache": cache, "past_key_values": cache},
                                              model.generation_config.__class__(compile_config=compile_config()))
    compiled = generate(model, ids, mask, cache, max_new_tokens=10, compile_config=compile_config())
    assert hasattr(model, "_compiled_call")
    assert_one_graph(dynamo)
    assert dynamo["stats"]["calls_captured"] > 0
    assert torch.equal(compiled[0], eager[0])
    assert_close(compiled[1], eager[1], atol=ATOL, rtol=1e-5, what=f"{family} generate logits")


def test_beam_search_with_a_compile_config(dynamo):
    """Beams reorder a fixed-capacity cache in place; whether generate() compiles beam search depends on the
    transformers version, so only the tokens and the absence of graph breaks are checked."""
    model = tiny_model("llama")
    ids, mask, _ = left_padded_batch([6, 9], seed=9)
    cfg = tq_config()
    eager = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg), max_new_tokens=6, num_beams=3)
    compiled = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=32),
                        max_new_tokens=6, num_beams=3, compile_config=compile_config())
    assert dict(dynamo["graph_break"]) == {} and dynamo["stats"]["unique_graphs"] <= 1
    assert torch.equal(compiled[0], eager[0])


# ---- the custom ops ------------------------------------------------------------------------------------
def test_custom_ops_pass_opcheck():
    """Schemas, fake implementations and the declared mutation agree with what the ops do (torch.library.opcheck)."""
    from tq_hf import ops
    from tq_hf.layout import BlockLayout

    layout = BlockLayout(tq_config(), 2, 32)
    index = ops.layout_index(layout)
    pool = layout.allocate(4, "cpu")
    key, value = torch.randn(2, 2, 32), torch.randn(2, 2, 32)
    slots = torch.tensor([0, layout.block_size])
    ring_k, ring_v = torch.zeros(2, 2, 4, 32), torch.zeros(2, 2, 4, 32)
    seq_lens = torch.zeros(2, dtype=torch.int32)
    torch.library.opcheck(torch.ops.tq_hf.store, (pool, index, key, value, slots, None, ring_k, ring_v, 0, seq_lens),
                          test_utils=("test_schema", "test_faketensor"))
    torch.ops.tq_hf.store(pool, index, key, value, slots, None, ring_k, ring_v, 0, seq_lens)
    positions = torch.tensor([5])  # a compiled step's: the ring's slot from the device, the lengths left alone
    torch.library.opcheck(torch.ops.tq_hf.store, (pool, index, key, value, slots, None, ring_k, ring_v, 0, None,
                                                  positions), test_utils=("test_schema", "test_faketensor"))
    before = seq_lens.clone()
    torch.ops.tq_hf.store(pool, index, key, value, slots, None, ring_k, ring_v, 0, None, positions)
    assert torch.equal(ring_k[:, :, 5 % 4], key) and torch.equal(seq_lens, before)
    table = torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)
    query = torch.randn(2, 4, 1, 32)
    args = (query, pool, index, table, seq_lens, 0.2, None, None, None, None, 2 * layout.block_size, None, None, None,
            ring_k, ring_v, 0)
    torch.library.opcheck(torch.ops.tq_hf.paged_attention, args)
    out = torch.ops.tq_hf.paged_attention(*args)
    expected = ops.paged_attention(query, pool, layout, table, seq_lens, 0.2, max_seq_len=2 * layout.block_size,
                                   recent_keys=ring_k, recent_values=ring_v)
    assert_close(out.transpose(1, 2), expected, atol=0, what="custom op vs direct call")
    means = torch.randn(2, 2, 32)  # one key_centering mean per row
    for offset in (None, means):
        torch.library.opcheck(torch.ops.tq_hf.gather, (pool, index, table, offset))
        got = torch.ops.tq_hf.gather(pool, index, table, offset)
        want = reference.gather(pool, layout, table, offset)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


# ---- CUDA graphs (GPU) -----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("preset,recent_format", [("4bit", "exact"), ("k8v4", "exact"), ("4bit", "int8")])
def test_gpu_reduce_overhead_captures_the_decode_step(preset, recent_format, dynamo):
    """mode="reduce-overhead": inductor + CUDA graphs over the Triton kernels; same tokens as the eager kernels over
    the same fixed capacity (the same launch plans), logits close to the growing cache's."""
    model = tiny_model("llama", dtype=torch.float16, device="cuda")
    cfg = tq_config(preset=preset, recent_format=recent_format)
    ids = prompts().cuda()
    growing = decode_loop(model, TurboQuantCache(model.config, tq_config=cfg), model.forward, ids)
    eager = decode_loop(model, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=64), model.forward, ids)
    assert_close(eager[1], growing[1], atol=2e-2, rtol=2e-2, what=f"{preset} fixed vs growing fp16 logits")
    compiled = decode_loop(model, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=64),
                           torch.compile(model.forward, mode="reduce-overhead", fullgraph=True), ids)
    assert_one_graph(dynamo)
    assert dynamo["inductor"].get("cudagraph_skips", 0) == 0, dict(dynamo["inductor"])
    assert torch.equal(compiled[0], eager[0])
    # inductor fuses the model's fp16 ops (norms, MLP) and rounds differently from eager: up to 0.057 seen on an H200
    assert_close(compiled[1], eager[1], atol=COMPILED_FP16_ATOL, rtol=2e-2, what=f"{preset} fp16 logits")


@pytest.mark.gpu
def test_gpu_captured_first_decode_step_allocates_no_constant(dynamo):
    """A compiled decode step whose launch plans are first made inside CUDA-graph capture (no eager decode before it
    in the process): the constants they read (rotations, tables) were made by the eager prefill, not in the graph's
    private pool (cudagraph trees reject a live tensor there that no output tracks)."""
    from tq_hf.kernels import attention as attention_kernel, codec_tensors, store as store_kernel

    for cached in (codec_tensors.codec_tensors, codec_tensors.value_rotation_tensor,
                   codec_tensors.value_rotation_units, codec_tensors.key_rotation_units):
        cached.cache_clear()
    store_kernel._PLANS.clear()
    attention_kernel._PLANS.clear()
    model = tiny_model("llama", dtype=torch.float16, device="cuda")
    cfg = tq_config(preset="4bit")
    ids = prompts().cuda()
    compiled = decode_loop(model, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=64),
                           torch.compile(model.forward, mode="reduce-overhead", fullgraph=True), ids)
    assert_one_graph(dynamo)
    eager = decode_loop(model, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=64), model.forward, ids)
    assert torch.equal(compiled[0], eager[0])


@pytest.mark.gpu
def test_gpu_other_attention_implementation_reads_the_dequantization_kernel(dynamo, monkeypatch):
    """sdpa over a TurboQuantCache on CUDA reads the history through kernels.dequantize: the logits of the reference
    path's (TQ_HF_FORCE_REFERENCE=1), and a fixed capacity under CUDA graphs keeps the eager tokens."""
    model = tiny_model("llama", attn="sdpa", device="cuda")
    cfg = tq_config()
    ids = prompts().cuda()
    eager = decode_loop(model, TurboQuantCache(model.config, tq_config=cfg), model.forward, ids)
    with monkeypatch.context() as patch:
        patch.setenv("TQ_HF_FORCE_REFERENCE", "1")
        want = decode_loop(model, TurboQuantCache(model.config, tq_config=cfg), model.forward, ids)
    assert torch.equal(eager[0], want[0])
    # the same codes (the store's contract) and the dequantization to ~2e-5; a skipped rotation moves them by ~1
    assert_close(eager[1], want[1], atol=5e-3, rtol=1e-3, what="sdpa logits, kernels vs reference")
    compiled = decode_loop(model, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=40),
                           torch.compile(model.forward, mode="reduce-overhead", fullgraph=True), ids)
    assert_one_graph(dynamo)
    assert torch.equal(compiled[0], eager[0])
    assert_close(compiled[1], eager[1], atol=5e-3, rtol=1e-3, what="sdpa logits, compiled")


def test_compiled_steps_pass_the_kernels_the_same_host_arguments(dynamo, monkeypatch):
    """The CUDA path's launchers, recorded on CPU (delegating to the reference): every compiled decode step hands
    store_kv and unified_attention the same host-side arguments (start, max_seq_len, recent_from, ...), so a
    captured CUDA graph replays launches that stay valid; positions and lengths travel as device tensors."""
    import tq_hf.kernels
    from tq_hf import ops, reference

    calls = []

    def host_args(kwargs):
        return tuple(sorted((k, v) for k, v in kwargs.items() if not isinstance(v, (torch.Tensor, tuple))))

    def store_kv(pool, layout, key, value, slots, held=None, **kwargs):  # held: eager decode steps' plans
        calls.append(("store", key.shape[0], host_args(kwargs)))
        reference.store(pool, layout, key, value, slots, **kwargs)

    def unified_attention(query, pool, layout, block_table, seq_lens, scale, out=None, held=None, **kwargs):
        calls.append(("attention", query.shape[2], host_args(kwargs)))
        kwargs.pop("workspace", None)  # the layer's own split scratch (made at its eager prefill)
        return out.copy_(reference.paged_attention(query, pool, layout, block_table, seq_lens, scale, **kwargs))

    monkeypatch.setattr(ops, "use_kernels", lambda t: True)
    monkeypatch.setattr(tq_hf.kernels, "store_kv", store_kv)
    monkeypatch.setattr(tq_hf.kernels, "unified_attention", unified_attention)
    model = tiny_model("llama")
    ids = prompts()
    eager = decode_loop(model, TurboQuantCache(model.config, tq_config=tq_config()), model.forward, ids)
    calls.clear()
    compiled = decode_loop(model, TurboQuantCache(model.config, tq_config=tq_config(), max_cache_len=64),
                           torch.compile(model.forward, fullgraph=True, backend="eager"), ids)
    assert_one_graph(dynamo)
    assert torch.equal(compiled[0], eager[0])
    per_step = 2 * 2  # a store and an attention for each of the 2 compressed layers
    decode = calls[-(STEPS + 1) * per_step:]  # every compiled step, the tracing one included
    first = decode[:per_step]
    assert [(op, tokens) for op, tokens, _ in first] == [("store", 2), ("attention", 1)] * 2  # B=2 rows, 1 query
    for i in range(1, STEPS + 1):
        assert decode[i * per_step:(i + 1) * per_step] == first, f"step {i}: {decode[i * per_step:(i + 1) * per_step]}"
    assert dict(first[1][2])["max_seq_len"] == 64 and dict(first[0][2])["start"] == 0


def test_a_compiled_forward_of_several_tokens_brings_its_own_split_scratch(monkeypatch):
    """A compiled forward of several tokens over a non-empty cache (a prefill chunk, a chat's next turn) hands the
    split kernel scratch of the call's own, the size its plan asks for, never the shared persistent buffer: that
    one, made inside a forward under cudagraph trees, lands in the graph's pool and outlives it untracked (they
    refuse that). The CUDA path's launcher recorded on CPU (delegating to the reference)."""
    import tq_hf.kernels

    seen = []

    def unified_attention(query, pool, layout, block_table, seq_lens, scale, out=None, held=None, **kwargs):
        scratch = kwargs.pop("workspace", None)
        plan = tq_hf.kernels.plan_attention(query, pool, layout, block_table, seq_lens, scale,
                                            **{k: v for k, v in kwargs.items() if k != "recent_from"})
        seen.append((query.shape[2], None if scratch is None else scratch.numel(), plan.workspace_numel, plan.split))
        return out.copy_(reference.paged_attention(query, pool, layout, block_table, seq_lens, scale, **kwargs))

    kernels_on_the_reference(monkeypatch, unified_attention)
    torch._dynamo.reset()
    logits, (compiled, eager), _ = compiled_and_eager_forwards(prompts(batch=1, length=200), 192, [(192, 200)], seen)
    assert compiled and all(lq == 8 and split for lq, _, _, split in compiled), compiled
    assert all(numel == need for _, numel, need, _ in compiled), compiled  # its own, of the plan's size
    assert all(numel is None for _, numel, _, _ in eager), eager  # eager: the shared buffer (no allocation a call)
    assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5, what="compiled chunk vs eager")
    torch._dynamo.reset()


def kernels_on_the_reference(monkeypatch, unified_attention) -> None:
    """The CUDA path on CPU tensors: ops takes the kernels' route, the store kernel stood in for by reference.store,
    the attention kernel by `unified_attention` (a recorder that delegates to the reference)."""
    import tq_hf.kernels
    from tq_hf import ops

    def store_kv(pool, layout, key, value, slots, held=None, **kwargs):
        reference.store(pool, layout, key, value, slots, **kwargs)

    monkeypatch.setattr(ops, "use_kernels", lambda t: True)
    monkeypatch.setattr(tq_hf.kernels, "store_kv", store_kv)
    monkeypatch.setattr(tq_hf.kernels, "unified_attention", unified_attention)


def compiled_and_eager_forwards(ids: torch.Tensor, prefix: int, spans: list[tuple[int, int]], record: list):
    """The tiny llama's first `prefix` tokens prefilled eagerly into a fresh fixed-capacity cache, then each span of
    ids fed through torch.compile(model.forward) (eager backend), and again through the eager forward: (the logits
    of each span, compiled ones first; `record`'s entries of each run; the cache)."""
    model = tiny_model("llama")
    logits, records = [], []
    for forward in (torch.compile(model.forward, backend="eager"), model.forward):
        cache = TurboQuantCache(model.config, tq_config=tq_config(), max_cache_len=256)
        model(input_ids=ids[:, :prefix], use_cache=True, **with_cache(cache))
        record.clear()
        for lo, hi in spans:
            positions = torch.arange(lo, hi)[None].expand(ids.shape[0], -1)
            logits.append(forward(input_ids=ids[:, lo:hi], position_ids=positions, use_cache=True,
                                  **with_cache(cache)).logits)
        records.append(list(record))
    return logits, records, cache


def test_a_compiled_chunk_of_many_queries_reads_its_length_when_it_runs(monkeypatch):
    """A compiled forward of many queries over unpadded rows takes tq_hf::chunk_attention (tagged cudagraph-unsafe:
    it reads the rows' length from the device when it runs), so it may attend through the dense copy of the history
    as an eager forward does; a forward of few queries (a verification forward) keeps tq_hf::paged_attention and the
    unified kernel. The CUDA path's launchers recorded on CPU (delegating to the reference)."""
    import tq_hf.kernels
    from tq_hf import ops

    routes = []

    def unified_attention(query, pool, layout, block_table, seq_lens, scale, out=None, held=None, **kwargs):
        kwargs.pop("workspace", None)
        routes.append(("unified", query.shape[2], None))
        return out.copy_(reference.paged_attention(query, pool, layout, block_table, seq_lens, scale, **kwargs))

    def dense_history_attention(query, pool, layout, block_table, seq_lens, scale, length, out=None, **kwargs):
        routes.append(("dense", query.shape[2], length))
        return out.copy_(reference.paged_attention(query, pool, layout, block_table, seq_lens, scale, **kwargs))

    kernels_on_the_reference(monkeypatch, unified_attention)
    monkeypatch.setattr(ops, "_dense_route_may_pay", lambda query, pool, layout, kwargs: True)
    monkeypatch.setattr(tq_hf.kernels, "dense_history_attention", dense_history_attention)
    monkeypatch.setattr(tq_hf.kernels, "dense_history_serves", lambda query, layout, length, **kw: query.shape[2] >= 64)
    assert torch.Tag.cudagraph_unsafe in torch.ops.tq_hf.chunk_attention.default.tags
    assert torch.Tag.cudagraph_unsafe not in torch.ops.tq_hf.paged_attention.default.tags
    torch._dynamo.reset()
    spans = [(100, 164), (164, 172), (172, 180)]  # a chunk of 64 queries, then two of 8
    logits, seen, cache = compiled_and_eager_forwards(prompts(batch=2, length=180), 100, spans, routes)
    compressed = sum(isinstance(layer, TurboQuantLayer) for layer in cache.layers)
    assert seen[0] == [("dense", 64, 164)] * compressed + [("unified", 8, None)] * 2 * compressed, seen[0]
    assert seen[1] == seen[0]  # the eager forwards' routes, the length read from the host
    for compiled, eager in zip(logits[:3], logits[3:]):
        assert_close(compiled, eager, atol=1e-5, rtol=1e-5, what="compiled chunk vs eager")
    torch._dynamo.reset()


def test_only_a_chunk_of_many_queries_over_a_large_capacity_takes_the_chunk_op():
    """tq_hf::chunk_attention (no CUDA graph) only where the dense route may pay: on the kernels, from
    CHUNK_MIN_QUERIES queries, without a sliding window, softcap or sinks, and enough query rows x the capacity
    (history.prefers_dense_route)."""
    from types import SimpleNamespace

    from tq_hf import ops

    model = tiny_model("llama")
    cache = TurboQuantCache(model.config, tq_config=tq_config(), max_cache_len=64)
    model(input_ids=prompts(batch=1, length=8), use_cache=True, **with_cache(cache))
    layout = next(layer for layer in cache.layers if isinstance(layer, TurboQuantLayer)).layout
    gpu, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    hq, d = model.config.num_attention_heads, model.config.head_dim
    chunk, few = torch.empty(1, hq, ops.CHUNK_MIN_QUERIES, d), torch.empty(1, hq, ops.CHUNK_MIN_QUERIES - 1, d)
    large = {"max_seq_len": 1 << 20}
    assert ops._dense_route_may_pay(chunk, gpu, layout, large)
    assert not ops._dense_route_may_pay(few, gpu, layout, large)
    assert not ops._dense_route_may_pay(chunk, cpu, layout, large)
    assert not ops._dense_route_may_pay(chunk, gpu, layout, {"max_seq_len": 256})  # too little work
    assert not ops._dense_route_may_pay(chunk, gpu, layout, {"max_seq_len": None})
    for lacking in ({"sliding_window": 4096}, {"softcap": 30.0}, {"sinks": torch.zeros(hq)}):
        assert not ops._dense_route_may_pay(chunk, gpu, layout, {**large, **lacking}), lacking


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["k8v4", "4bit"])
def test_gpu_chunked_prefill_then_captured_decode(preset):
    """generate(prefill_chunk_size=...) compiles the prefill chunks and captures the decode steps (cudagraph trees)
    with no split scratch allocated before in the process: the same tokens as the eager kernels."""
    from tq_hf.kernels import workspace

    torch._dynamo.reset()
    workspace._WORKSPACES.clear()
    workspace._PARTIALS.clear()
    model = tiny_model("llama", dtype=torch.float16, device="cuda")
    ids = prompts(batch=2, length=200).cuda()
    mask = torch.ones_like(ids)
    cfg = tq_config(preset=preset)
    compiled = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=224),
                        max_new_tokens=8, prefill_chunk_size=64)
    eager = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=224),
                     max_new_tokens=8, prefill_chunk_size=64, disable_compile=True)
    # a compiled chunk runs the layers through inductor, whose fp16 rounding differs from eager's (and the quantizer
    # may then pick a neighbouring code): tokens agree up to a near tie of the eager top two logits
    assert_same_tokens_up_to_a_near_tie(compiled, eager, ids.shape[1], tie=0.1)
    torch._dynamo.reset()


def assert_same_tokens_up_to_a_near_tie(got, want, prompt_len: int, tie: float) -> None:
    """got and want (sequences, logits [steps, B, V]) generate the same tokens, each row until a step where want's
    top two logits lie within `tie` and got took the other of them; the logits agree before that step."""
    for row in range(want[0].shape[0]):
        new, ref = got[0][row, prompt_len:], want[0][row, prompt_len:]
        differ = (new != ref).nonzero().flatten()
        steps = int(differ[0]) if differ.numel() else ref.numel()
        assert_close(got[1][:steps, row], want[1][:steps, row], atol=COMPILED_FP16_ATOL, rtol=2e-2,
                     what=f"row {row} logits before any difference")
        if steps < ref.numel():
            top = want[1][steps, row].float().topk(2)
            assert float(top.values[0] - top.values[1]) < tie and int(new[steps]) in top.indices.tolist(), (
                f"row {row} left the reference's tokens at step {steps} without a near tie: {new.tolist()} vs "
                f"{ref.tolist()}, top two logits {top.values.tolist()} for {top.indices.tolist()}")


def test_the_token_comparison_tells_a_near_tie_from_a_divergence():
    logits = torch.zeros(3, 1, 5)
    logits[:, 0, 1] = 1.0
    logits[1, 0, 4] = 0.99  # step 1: a near tie of tokens 1 and 4
    want = (torch.tensor([[7, 1, 1, 1]]), logits)
    assert_same_tokens_up_to_a_near_tie((want[0].clone(), logits), want, 1, tie=0.1)
    assert_same_tokens_up_to_a_near_tie((torch.tensor([[7, 1, 4, 3]]), logits), want, 1, tie=0.1)
    with pytest.raises(AssertionError, match="step 0 without a near tie"):
        assert_same_tokens_up_to_a_near_tie((torch.tensor([[7, 3, 1, 1]]), logits), want, 1, tie=0.1)
    with pytest.raises(AssertionError, match="logits before any difference"):
        assert_same_tokens_up_to_a_near_tie((torch.tensor([[7, 1, 4, 3]]), logits + 1), want, 1, tie=0.1)


@pytest.mark.gpu
def test_gpu_compiled_chunks_attend_through_the_dense_route(monkeypatch):
    """generate(prefill_chunk_size=...) compiles its chunks; where the dense route pays (its threshold lowered here
    to the tiny model) a compiled chunk reads its length when it runs and takes that route, as an eager chunk does:
    the same tokens up to a near tie, and the decode steps still captured."""
    import tq_hf.kernels
    from tq_hf.kernels import history

    calls = []
    dense = tq_hf.kernels.dense_history_attention

    def counted(query, *args, **kwargs):
        calls.append(query.shape[2])
        return dense(query, *args, **kwargs)

    monkeypatch.setattr(history, "dense_history_min_work", lambda layout: 0)
    monkeypatch.setattr(tq_hf.kernels, "dense_history_attention", counted)
    torch._dynamo.reset()
    model = tiny_model("llama", dtype=torch.float16, device="cuda")
    ids = prompts(batch=2, length=200).cuda()
    mask = torch.ones_like(ids)
    compiled = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=tq_config(), max_cache_len=224),
                        max_new_tokens=8, prefill_chunk_size=64)
    assert calls and set(calls) == {64}, calls  # the chunks after the first (the last, of 8, stays on the kernel)
    calls.clear()
    eager = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=tq_config(), max_cache_len=224),
                     max_new_tokens=8, prefill_chunk_size=64, disable_compile=True)
    assert calls and set(calls) >= {64}, calls
    assert_same_tokens_up_to_a_near_tie(compiled, eager, ids.shape[1], tie=0.1)
    torch._dynamo.reset()


@pytest.mark.gpu
def test_gpu_generate_compiles_by_itself_with_cuda_graphs():
    """On CUDA generate() compiles (inductor, reduce-overhead) with no compile_config, as for a StaticCache."""
    torch._dynamo.reset()
    model = tiny_model("llama", dtype=torch.float16, device="cuda")
    ids, mask, _ = left_padded_batch([7, 11], seed=11, device="cuda")
    cfg = tq_config()
    eager = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=40),
                     max_new_tokens=10, disable_compile=True)
    compiled = generate(model, ids, mask, TurboQuantCache(model.config, tq_config=cfg, max_cache_len=40),
                        max_new_tokens=10)
    assert hasattr(model, "_compiled_call")
    assert torch.equal(compiled[0], eager[0])
    assert_close(compiled[1], eager[1], atol=COMPILED_FP16_ATOL, rtol=2e-2, what="fp16 generate logits")
    torch._dynamo.reset()
