"""TurboQuantCache over several devices, checked without GPUs.

- Per-layer placement: each layer's pool and tables live on the device of the K/V that layer
  receives (what accelerate's device_map relies on). "meta" stands in for a second device, with the
  store recorded instead of run there (meta tensors cannot run its data-dependent indexing).
- Tensor-parallel shards: a layer fed a divisor of the config's KV heads (what each rank's
  projections yield under tp_plan) stores exactly the heads a full cache stores for that slice.
- accelerate's hooks (a device_map with "disk" layers) and transformers' tensor parallelism (gloo,
  2 processes under torchrun) on CPU, through eval.multi_gpu, against the model on one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import assert_close
from transformers import LlamaConfig

from eval import multi_gpu
from tq_hf import TurboQuantCache, TurboQuantConfig, ops
from tq_hf.cache import TurboQuantLayer

REPO = Path(__file__).resolve().parents[1]
DIM = 32


def config(kv_heads: int, layers: int = 3) -> LlamaConfig:
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2 * kv_heads, num_key_value_heads=kv_heads, head_dim=DIM,
                      num_hidden_layers=layers, vocab_size=32, intermediate_size=64)
    cfg._attn_implementation = "turboquant"
    return cfg


def kv(rows: int, tokens: int, heads: int, device="cpu"):
    return (torch.randn(rows, heads, tokens, DIM) * 3).to(device), torch.randn(rows, heads, tokens, DIM).to(device)


def layer_tensors(layer: TurboQuantLayer) -> dict[str, torch.Tensor]:
    return multi_gpu.cache_layer_tensors(layer)


# ---- per-layer placement ----------------------------------------------------------------------
def test_each_layer_lives_on_the_device_of_its_own_key_states(monkeypatch):
    """Layer 0 on cpu, layer 1 on meta, layer 2 (full precision) on cpu: prefill, growth, decode,
    beam reorder and padding starts all stay on each layer's device; no store mixes devices."""
    real_store = ops.store
    stores = []

    def recording_store(pool, layout, key, value, slots, **kwargs):
        devices = {t.device.type for t in (pool, key, value, slots)}
        devices |= {t.device.type for t in kwargs.values() if isinstance(t, torch.Tensor)}
        stores.append(devices)
        if devices == {"cpu"}:
            real_store(pool, layout, key, value, slots, **kwargs)

    monkeypatch.setattr(ops, "store", recording_store)
    tq = TurboQuantConfig.from_preset("4bit", full_precision_layers=(2,), key_centering=True)
    cache = TurboQuantCache(config(kv_heads=2), tq_config=tq)
    alone = TurboQuantCache(config(kv_heads=2), tq_config=tq)  # layer 0 as on a single device
    devices = ["cpu", "meta", "cpu"]
    for step, tokens in enumerate([37, 1, 1, 40]):  # prefill, decode, decode, a chunk that grows the pool
        for i, device in enumerate(devices):
            k, v = kv(2, tokens, 2)
            cache.update(k.to(device), v.to(device), i)
            if i == 0:
                alone.update(k, v, 0)
        if step == 0:
            for layer in (*cache.layers[:2], alone.layers[0]):
                layer.set_padding(torch.tensor([0, 3]), contiguous=True, max_start=3)  # the mask lives on cpu
    cache.reorder_cache(torch.tensor([1, 0]))
    alone.layers[0].reorder_cache(torch.tensor([1, 0]))
    assert stores and all(len(d) == 1 for d in stores), f"a store mixed devices: {stores}"
    assert {next(iter(d)) for d in stores} == {"cpu", "meta"}
    for i, device in enumerate(devices[:2]):
        layer = cache.layers[i]
        tensors = layer_tensors(layer)
        assert {"pool", "block_table", "seq_lens", "kv_start", "key_offset"} <= set(tensors), sorted(tensors)
        wrong = {n: str(t.device) for n, t in tensors.items() if t.device.type != device}
        assert not wrong, f"layer {i} (key_states on {device}) keeps tensors elsewhere: {wrong}"
        assert layer.pool.shape[0] == layer.capacity * 2 and layer.length == 79
    assert cache.layers[2].keys.device.type == "cpu"
    for got, want in zip(cache.layers[0].dequantized(), alone.layers[0].dequantized()):  # the real cpu stores
        assert_close(got, want, atol=0, what="cpu layer of a mixed-device cache vs the same layer alone")


# ---- tensor-parallel shards -------------------------------------------------------------------
@pytest.mark.parametrize("centering", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_a_shard_of_kv_heads_stores_what_the_full_cache_stores_for_those_heads(world, centering):
    """Rank r of `world` sees heads [r*H/world, (r+1)*H/world): its pool holds H/world heads and
    dequantizes to the full cache's slice; bytes are the full cache's / world.

    Exact without key_centering; with it the per-head key mean is summed in another order over a
    narrower tensor (1-ulp differences, as on a real TP rank), hence atol 1e-5 on keys ~N(0, 9).
    """
    heads = 4
    atol = 1e-5 if centering else 0.0
    tq = TurboQuantConfig.from_preset("4bit", full_precision_layers=(), key_centering=centering, exact_prefix_tokens=2)
    full = TurboQuantCache(config(heads, 1), tq_config=tq)
    shards = [TurboQuantCache(config(heads, 1), tq_config=tq) for _ in range(world)]
    per = heads // world
    for tokens in (19, 1, 1, 5):
        k, v = kv(3, tokens, heads)
        full.update(k, v, 0)
        for r, shard in enumerate(shards):
            shard.update(k[:, r * per:(r + 1) * per].contiguous(), v[:, r * per:(r + 1) * per].contiguous(), 0)
    fk, fv = full.layers[0].dequantized()
    for r, shard in enumerate(shards):
        layer = shard.layers[0]
        assert layer.pool.shape[1] == per and layer.layout.num_kv_heads == per
        sk, sv = layer.dequantized()
        assert_close(sk, fk[:, r * per:(r + 1) * per], atol=atol, what=f"rank {r}/{world} keys")
        assert_close(sv, fv[:, r * per:(r + 1) * per], atol=0, what=f"rank {r}/{world} values")
        assert shard.memory_footprint() * world == full.memory_footprint()
        assert shard.fp16_equivalent_bytes() * world == full.fp16_equivalent_bytes()


@pytest.mark.parametrize("bad_heads", [3, 8])
def test_kv_heads_that_are_no_shard_of_the_config_fail_clearly(bad_heads):
    cache = TurboQuantCache(config(4, 1), tq_config=TurboQuantConfig.from_preset("4bit", full_precision_layers=()))
    with pytest.raises(ValueError, match=r"divisor of 4.*got \[2, %d, 5, 32\]" % bad_heads):
        cache.update(*kv(2, 5, bad_heads), 0)


def test_a_layer_keeps_the_head_count_of_its_first_update_until_reset():
    """A shard's later updates must match it; reset() forgets it, not the config's count."""
    cache = TurboQuantCache(config(4, 1), tq_config=TurboQuantConfig.from_preset("4bit", full_precision_layers=()))
    cache.update(*kv(2, 5, 2), 0)
    with pytest.raises(ValueError, match="KV heads"):
        cache.update(*kv(2, 1, 4), 0)
    cache.reset()
    cache.update(*kv(2, 5, 4), 0)
    assert cache.layers[0].pool.shape[1] == 4 and cache.layers[0].layout.num_kv_heads == 4
    cache.reset()
    with pytest.raises(ValueError, match="divisor of 4"):
        cache.update(*kv(2, 5, 3), 0)


# ---- eval.multi_gpu's verdicts ----------------------------------------------------------------
def test_token_comparison_tells_near_ties_from_divergence():
    logits = torch.zeros(3, 2, 5)
    logits[1, 1, 4], logits[1, 1, 2] = 1.0, 0.99  # step 1, row 1: a near-tie between tokens 4 and 2
    logits[2, 0, 1], logits[2, 0, 3] = 1.0, 0.0
    reference = {"tokens": torch.tensor([[0, 0, 1], [0, 4, 0]]), "logits": logits}
    assert multi_gpu.compare_tokens(reference, {"tokens": reference["tokens"].clone()}, 0.05)["verdict"] == "identical"
    tie = multi_gpu.compare_tokens(reference, {"tokens": torch.tensor([[0, 0, 1], [0, 2, 0]])}, 0.05)
    assert tie["verdict"] == "near-tie" and tie["ok"] and tie["first_diff_step"] == 1 and tie["row"] == 1
    assert tie["reference_margin"] == pytest.approx(0.01, abs=1e-6)
    bad = multi_gpu.compare_tokens(reference, {"tokens": torch.tensor([[0, 0, 3], [0, 4, 0]])}, 0.05)
    assert bad["verdict"] == "DIVERGED" and not bad["ok"] and bad["first_diff_step"] == 2


def test_even_device_map_covers_every_layer():
    dm = multi_gpu.even_device_map(5, ["cuda:0", "cuda:1"])
    assert [dm[f"model.layers.{i}"] for i in range(5)] == ["cuda:0"] * 3 + ["cuda:1"] * 2
    assert dm["model.embed_tokens"] == "cuda:0" and dm["lm_head"] == "cuda:1"
    with pytest.raises(ValueError, match="disk only"):
        multi_gpu.even_device_map(2, ["disk"])


# ---- end to end on CPU: accelerate hooks and tensor parallelism ---------------------------------
SMALL = ["--model", "random:tiny,layers=4,vocab=256", "--dtype", "float32", "--prompt-len", "24",
         "--new-tokens", "5", "--compress-all"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_device_map_with_disk_layers_generates_as_on_one_device(tmp_path, dtype):
    """accelerate's hooks run layers 2-3 from disk: same tokens and logits as the model on one device.

    bfloat16 guards the reference: a one-device model that was not loaded from the checkpoint
    (RoPE buffers cast to half precision) gave logits 4e-3 apart on CPU and other tokens on H200s.
    """
    args = [*SMALL, "--devices", "cpu,disk", "--device-map", "even", "--out", str(tmp_path)]
    args[args.index("--dtype") + 1] = dtype
    assert multi_gpu.main(args) == 0
    report = json.loads((tmp_path / "device_map.json").read_text())
    assert (tmp_path / "device_map.md").read_text().splitlines()[2] == f"Command: `{report['meta']['command']}`"
    assert report["device_map"]["model.layers.3"] == "disk"
    layers = report["layers"]
    assert [r["kind"] for r in layers] == ["compressed"] * 4
    assert [r["mapped_to"] for r in layers] == ["cpu", "cpu", "disk", "disk"]
    assert all(r["ok"] and r["cache_devices"] == ["cpu"] for r in layers)
    for kind in multi_gpu.CACHE_KINDS:
        assert report["tokens"][kind]["verdict"] == "identical", report["tokens"]
        assert report["max_logit_diff"][kind] <= 1e-5


@pytest.mark.slow
def test_tensor_parallel_under_torchrun_on_cpu(tmp_path):
    """2 gloo ranks, tp_plan="auto": each rank's pools hold 2 of 4 KV heads, half the bytes, same tokens."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "eval.multi_gpu", "--tp", *SMALL, "--out", str(tmp_path)]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "tp.json").read_text())
    assert report["ok"] and report["world_size"] == 2
    ranks = [r for r in report["ranks"] if r["cache"] == "turboquant"]
    assert len(ranks) == 2
    for r in ranks:
        assert r["single_kv_heads"] == [2] * 4 and r["kv_heads"] == [1] * 4, r  # random:tiny has 2 KV heads
        assert r["kv_bytes"] * 2 == r["single_kv_bytes"] and r["tokens"]["verdict"] == "identical"
