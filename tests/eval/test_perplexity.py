"""eval.perplexity end to end on a random-init tiny model, and its pieces against plain references."""

import json
import math

import numpy as np
import pytest
import torch
from scipy.stats import entropy
from transformers import DynamicCache

from eval import perplexity


@pytest.mark.parametrize("length,prefill,chunk", [(123, 5, 7), (16, 16, 4), (10, 32, 3), (1, 1, 1)])
def test_chunk_bounds_cover_the_window_once(length, prefill, chunk):
    bounds = perplexity.chunk_bounds(length, prefill, chunk)
    assert bounds[0] == (0, min(prefill, length)) and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(0 < e - s <= chunk for s, e in bounds[1:])


@pytest.mark.parametrize("n,window,stride", [(1000, 256, 256), (1000, 256, 100), (257, 256, 256), (5, 8, 3)])
def test_windows_score_each_token_once(n, window, stride):
    """Overlapping windows score every token after the first; disjoint ones all but window starts
    (no context: the convention behind 48 x 1023 = 49,104 scored tokens of 49,152)."""
    scored = []
    for begin, end, first in perplexity.windows(n, window, stride):
        assert end - begin <= window
        scored += list(range(begin + first, end))
    if stride < window:
        assert scored == list(range(1, n))
    else:
        assert scored == [i for i in range(1, n) if i % window and i // window * window + 1 < n]


def test_chunked_reference_matches_one_forward(tiny_model):
    model, _ = tiny_model
    ids = torch.randint(0, 256, (1, 77))
    chunked = perplexity.window_logprobs(model, ids, DynamicCache(), 13, 9)
    with torch.inference_mode():
        whole = torch.log_softmax(model(ids).logits[0].float(), -1)
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-5)


def test_tally_kl_and_top1_match_scipy():
    g = torch.Generator().manual_seed(1)
    ref = torch.log_softmax(torch.randn(37, 11, generator=g) * 3, -1)
    other = torch.log_softmax(torch.randn(37, 11, generator=g) * 3, -1)
    targets = torch.randint(0, 11, (37,), generator=g)
    t = perplexity.Tally()
    t.add(other, targets, ref)
    expect_kl = sum(entropy(np.exp(r), np.exp(o)) for r, o in zip(ref.double().numpy(), other.double().numpy()))
    assert t.kl == pytest.approx(expect_kl, rel=1e-4)
    assert t.top1 == int((ref.argmax(-1) == other.argmax(-1)).sum())
    assert t.nll == pytest.approx(-float(other[torch.arange(37), targets].sum()), rel=1e-6)


def test_cli_end_to_end(tmp_path, tiny_text, tiny_model):
    out = tmp_path / "ppl"
    report = perplexity.main(["--model", "random:tiny", "--text-file", str(tiny_text), "--max-tokens", "700",
                              "--window", "256", "--chunk", "64", "--prefill", "32",
                              "--presets", "4bit-all,naive-int4,hadamard-int4", "--out", str(out)])
    assert {p.name for p in out.iterdir()} == {"results.json", "table.md", "perplexity.png"}
    saved = json.loads((out / "results.json").read_text())
    assert "partial" not in saved and saved["tokens"] == 700 and saved["meta"]["command"].startswith("python -m")
    assert (out / "table.md").read_text().splitlines()[2] == f"Command: `{saved['meta']['command']}`"
    rows = {r["preset"]: r for r in saved["results"]}
    assert list(rows) == ["fp16", "4bit-all", "naive-int4", "hadamard-int4"]
    for r in rows.values():
        assert {"preset", "ppl", "delta_pct", "kl", "top1", "tokens", "kv_vs_fp16"} <= set(r)
        assert r["tokens"] == 697 and math.isfinite(r["ppl"])
    ref = rows["fp16"]
    assert ref["delta_pct"] == 0 and abs(ref["kl"]) < 1e-6 and ref["top1"] == 1.0
    for name in ("4bit-all", "naive-int4", "hadamard-int4"):  # quantization reaches the scores
        assert rows[name]["kl"] > 1e-7 and rows[name]["kv_vs_fp16"] < 0.35
    # independent reference: fp16 PPL from one plain forward per window, no cache, no chunks
    model, tokenizer = tiny_model
    ids = tokenizer(tiny_text.read_text()[:8000], return_tensors="pt").input_ids[0][:700]
    nll, count = 0.0, 0
    for begin in range(0, 700, 256):
        w = ids[begin : begin + 256][None]
        with torch.inference_mode():
            logp = torch.log_softmax(model(w).logits[0].float(), -1)
        nll -= logp[:-1].gather(-1, w[0, 1:, None]).sum().item()
        count += w.shape[1] - 1
    assert ref["ppl"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert report["results"][0]["ppl"] == ref["ppl"]
    assert "4bit-all" in (out / "table.md").read_text()


def test_cli_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        perplexity.parse_args(["--window", "0"])
    with pytest.raises(SystemExit):
        perplexity.parse_args(["--window", "8", "--stride", "9"])
