"""eval.chunked on a random-init tiny Llama: the feeds, the logits it compares, and the CLI end to end."""

import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from scipy.stats import entropy

from eval import chunked, common

PROMPT, STEPS = 50, 10
# No exact ring and no exact prefix: a 60-token context reads the compressed pool (the 128-token ring
# of the default config would hold all of it exactly).
LOSSY = "4bit-all@recent_window=0@exact_prefix_tokens=0"
CELL = re.compile(r"^-?\d[\d.e+-]* \(\d+\.\d%\)$")


@pytest.fixture(scope="module")
def sharp_model():
    """The tiny random Llama with a 40x output head: peaked distributions, so KL tells logits apart."""
    model, _, _ = common.load_model("random:tiny")
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    return model


@pytest.fixture
def ids():
    return torch.randint(0, 257, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(7))


def _specs(*names):
    ref = common.cache_spec("fp16")
    extra = {"dynamic": dataclasses.replace(ref, name="dynamic")}
    return [ref, *[extra[n] if n in extra else common.cache_spec(n) for n in names]]


@pytest.mark.parametrize("feed,first,forwards", [("one", 50, 1), ("7", 7, 8), ("1", 1, 50), ("3+rest", 3, 2),
                                                 ("64+rest", 50, 1), ("100", 50, 1)])
def test_feed_bounds_cover_the_prompt_once(feed, first, forwards):
    bounds = chunked.feed_bounds(50, feed)
    assert bounds[0] == (0, first) and bounds[-1][1] == 50 and len(bounds) == forwards
    assert all(a[1] == b[0] and b[0] < b[1] for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("feed", ["0", "two", "3+", "rest", "0+rest", "3+4"])
def test_bad_feed_is_named(feed):
    with pytest.raises(ValueError, match="supported: 'one'"):
        chunked.feed_bounds(50, feed)


@pytest.mark.parametrize("feed", ["one", "7", "1", "3+rest"])
def test_reference_logits_are_those_of_one_plain_forward(sharp_model, ids, feed):
    """Prompt positions and decode steps line up with the positions of a cache-free forward over the text."""
    run = chunked.fed_logits(sharp_model, _specs()[0], ids, chunked.feed_bounds(PROMPT, feed))
    with torch.inference_mode():
        plain = torch.log_softmax(sharp_model(ids, use_cache=False).logits[0].float(), -1)
    assert run.prompt.shape[0] == PROMPT and run.decode.shape[0] == STEPS
    torch.testing.assert_close(run.prompt, plain[:PROMPT], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(run.decode, plain[PROMPT:], rtol=1e-4, atol=1e-3)


def test_compare_matches_scipy():
    g = torch.Generator().manual_seed(3)
    ref = torch.log_softmax(torch.randn(23, 13, generator=g) * 3, -1)
    other = torch.log_softmax(torch.randn(23, 13, generator=g) * 3, -1)
    got = chunked.compare(ref, other)
    expect = np.mean([entropy(np.exp(r), np.exp(o)) for r, o in zip(ref.double().numpy(), other.double().numpy())])
    assert got["kl"] == pytest.approx(expect, rel=1e-4) and got["count"] == 23
    assert got["top1"] == pytest.approx(float((ref.argmax(-1) == other.argmax(-1)).float().mean()))
    assert chunked.compare(ref[:0], other[:0]) == {"kl": None, "top1": None, "count": 0}
    with pytest.raises(ValueError, match="differ in shape"):
        chunked.compare(ref, other[1:])


def test_dynamic_cache_against_itself_scores_zero_and_a_shifted_comparison_does_not(sharp_model, ids):
    ref_spec, dynamic = _specs("dynamic")
    ref = chunked.fed_logits(sharp_model, ref_spec, ids, chunked.feed_bounds(PROMPT, "one"))
    run = chunked.fed_logits(sharp_model, dynamic, ids, chunked.feed_bounds(PROMPT, "7"))
    same = chunked.compare(ref.decode, run.decode)
    assert abs(same["kl"]) < 1e-5 and same["top1"] == 1.0
    shifted = chunked.compare(ref.decode[1:], run.decode[:-1])  # step i against step i + 1
    assert shifted["kl"] > 0.1 and shifted["top1"] < 1.0


def test_evaluate_feeds_rows_and_tables(sharp_model, ids):
    feeds = ["one", "7", "3+rest"]
    rows = chunked.evaluate_feeds(sharp_model, ids, PROMPT, _specs("dynamic", LOSSY), feeds)
    assert [(r["preset"], r["feed"]) for r in rows] == [(p, f) for f in feeds for p in ("fp16", "dynamic", LOSSY)]
    for r in rows:
        assert r["forwards"] == len(chunked.feed_bounds(PROMPT, r["feed"])) and r["decode"]["count"] == STEPS
        assert r["prompt"]["count"] == PROMPT - chunked.feed_bounds(PROMPT, r["feed"])[0][1]
        exact = r["preset"] != LOSSY
        for part in ("decode", "prompt"):
            kl = r[part]["kl"]
            if kl is None:  # one prefill: no prompt position comes after the first forward
                assert r["feed"] == "one" and part == "prompt"
            elif exact:  # DynamicCache is exact under any feeding
                assert abs(kl) < 1e-5 and r[part]["top1"] == 1.0
            else:  # the compressed pool reaches the scores
                assert kl > 1e-3
    text = chunked.chunked_tables(rows, feeds)
    tables = [[line for line in block.splitlines() if line.startswith("|")] for block in text.split("###")[1:]]
    decode, ratios, prompt = tables
    assert decode[0] == "| preset | one prefill | chunks of 7 | 3+rest |"
    assert [line.split(" | ")[0] for line in decode[2:]] == ["| fp16", "| dynamic", f"| {LOSSY}"]
    assert all(CELL.match(c.strip()) for line in decode[2:] for c in line.strip("|").split("|")[1:])
    assert ratios[0] == "| preset | chunks of 7 | 3+rest | worst | <= 1.2x |" and len(ratios) == 4
    assert prompt[0] == "| preset | chunks of 7 (43 pos.) | 3+rest (47 pos.) |"


def test_merged_prompts_score_like_their_logits_pooled(sharp_model, ids):
    """Two prompts' rows merged equal compare() over both prompts' logits concatenated."""
    other = torch.randint(0, 257, ids.shape, generator=torch.Generator().manual_seed(8))
    specs, feeds = _specs(LOSSY), ["one", "7"]
    rows = [chunked.evaluate_feeds(sharp_model, x, PROMPT, specs, feeds) for x in (ids, other)]
    merged = chunked.merge_rows(rows)
    assert [(r["preset"], r["feed"]) for r in merged] == [(r["preset"], r["feed"]) for r in rows[0]]
    bounds = chunked.feed_bounds(PROMPT, "7")
    refs = [chunked.fed_logits(sharp_model, specs[0], x, bounds) for x in (ids, other)]
    runs = [chunked.fed_logits(sharp_model, specs[1], x, bounds) for x in (ids, other)]
    for part, start in (("decode", 0), ("prompt", 7)):
        expect = chunked.compare(torch.cat([getattr(r, part)[start:] for r in refs]),
                                 torch.cat([getattr(r, part)[start:] for r in runs]))
        got = merged[3][part]
        assert got["count"] == expect["count"]
        assert got["kl"] == pytest.approx(expect["kl"], rel=1e-4) and got["top1"] == pytest.approx(expect["top1"])
    assert merged[1]["prompt"]["kl"] is None and merged[1]["decode"]["count"] == 2 * STEPS


def test_turns_reused_cache_reads_the_pool_and_a_fresh_one_does_not(sharp_model):
    g = torch.Generator().manual_seed(11)
    t = torch.randint(0, 257, (80,), generator=g).tolist()
    conv = chunked.Conversation(turn1=t[:30], answer1=t[30:36], turn2=t[:60], answer2=t[60:70])
    rows = chunked.evaluate_turns(sharp_model, conv, _specs(LOSSY))
    ref, lossy = rows
    assert abs(ref["reused"]["decode"]["kl"]) < 1e-5 and ref["fresh"]["decode"]["kl"] == 0
    assert ref["reused"]["turn2_prompt"]["count"] == 60 - 35 and ref["fresh"]["turn2_prompt"]["count"] == 60
    assert abs(ref["reused"]["turn2_prompt"]["kl"]) < 1e-5
    assert abs(lossy["fresh"]["turn2_prompt"]["kl"]) < 1e-5  # exact prefill: the whole conversation at once
    assert lossy["reused"]["turn2_prompt"]["kl"] > 1e-3  # turn 2's new tokens read turn 1 from the pool
    assert lossy["fresh"]["decode"]["kl"] > 1e-3 and lossy["reused"]["decode"]["kl"] > 1e-3


def test_cli_end_to_end(tmp_path, tiny_text):
    out = tmp_path / "chunked"
    report = chunked.main(["--model", "random:tiny", "--text-file", str(tiny_text), "--presets", LOSSY,
                           "--feeds", "one,16,3+rest", "--all", "--prompts", "2", "--prompt-tokens", "100",
                           "--decode-steps", "8",
                           "--generate-tokens", "6", "--generate-chunks", "16,40", "--turn1-tokens", "60",
                           "--turn2-tokens", "30", "--answer-tokens", "5", "--out", str(out)])
    assert {p.name for p in out.iterdir()} == {"results.json", "table.md"}
    saved = json.loads((out / "results.json").read_text())
    assert "partial" not in saved and saved["meta"]["command"].startswith("python -m eval.chunked")
    assert (out / "table.md").read_text().splitlines()[2] == f"Command: `{saved['meta']['command']}`"
    assert list(saved["feeds"]) == ["one", "16", "3+rest", "1"] and saved["feeds"]["1"][-1] == [99, 100]
    assert all(r["decode"]["count"] == 2 * 8 for r in saved["chunked"])
    assert len(saved["chunked"]) == 2 * 4 and len(saved["generate"]) == 2 * 3 and len(saved["multi_turn"]) == 2
    for r in saved["generate"]:
        assert r["count"] == 6 and len(r["generated"]) == 6
        if r["preset"] == "fp16":  # generate()'s logits line up with one forward over the tokens it chose
            assert abs(r["kl"]) < 1e-5 and r["top1"] == 1.0
    assert saved["conversation"]["decode_steps"] == 8
    assert report["multi_turn"][0]["preset"] == "fp16" and abs(report["multi_turn"][0]["reused"]["decode"]["kl"]) < 1e-5
    table = (out / "table.md").read_text()
    for heading in ("Decode steps", "chunked / one prefill", "generate(prefill_chunk_size", "Multi-turn"):
        assert heading in table
    assert "2 prompts of 100 tokens" in table
    assert "| preset | one prefill | chunks of 16 | 3+rest | chunks of 1 |" in table


@pytest.mark.parametrize("argv", [["--feeds", "one,two"], ["--prompt-tokens", "0"], ["--generate-chunks", "x"],
                                  ["--generate-chunks", "0"], ["--prompts", "0"]])
def test_cli_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit):
        chunked.parse_args(argv)
