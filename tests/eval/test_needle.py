"""eval.needle: prompt construction, judging, the prefill+generate path, and the CLI end to end."""

import json
import random

import pytest
import torch

from eval import common, needle


def _hay(tokenizer, n=3000):
    return tokenizer(common.wiki_text()[:n], add_special_tokens=False).input_ids


@pytest.mark.parametrize("kind", needle.NEEDLES)
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_prompt_has_the_length_and_the_needle_at_its_depth(tiny_model, kind, depth):
    _, tok = tiny_model
    p = needle.build_prompt(tok, _hay(tok), 301, depth, kind, trial=1, rng=random.Random(0))
    assert len(p.context) + len(p.question) == 301
    text = tok.decode(p.context)
    intro = needle.PASSKEY_INTRO if kind == "passkey" else needle.SENTENCE_INTRO
    assert text.startswith(intro) and p.needle in text
    hay = text[len(intro):].replace(p.needle, "", 1)
    at = text.index(p.needle) - len(intro)
    if depth == 0.0:
        assert text[len(intro):].lstrip().startswith(p.needle)
    elif depth == 1.0:
        assert text.rstrip().endswith(p.needle)
    else:  # snapped forward to the next sentence end (byte tokens: one character each)
        assert depth * len(hay) - 2 <= at <= depth * len(hay) + 64, (at, len(hay))
        if at > round(depth * len(hay)) + 1:  # it moved, so it moved to a sentence end
            assert hay[:at].rstrip()[-1] in ".!?\n", hay[:at]
    assert all(k.lower() in p.needle.lower() for k in p.keys)


def test_judge():
    p = needle.Prompt([], [], ["48213"], "The pass key is 48213.")
    assert p.judge(" 48213. Remember") and not p.judge(" 4821")
    s = needle.Prompt([], [], ["paprika"], "")
    assert s.judge(" smoked Paprika.") and not s.judge(" salt")


def test_too_short_context_is_rejected(tiny_model):
    _, tok = tiny_model
    with pytest.raises(ValueError, match="too short"):
        needle.build_prompt(tok, _hay(tok), 64, 0.5, "passkey", 0, random.Random(0))


def test_prefilled_generation_matches_plain_generate(tiny_model):
    """The answer path (prefill the context into the cache, then generate) = generate from scratch."""
    model, tok = tiny_model
    p = needle.build_prompt(tok, _hay(tok), 260, 0.5, "passkey", 0, random.Random(3))
    got = needle.answer(model, tok, p, common.cache_spec("fp16"), 6, "cpu")
    full = torch.tensor([p.context + p.question])
    ref = model.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=6, do_sample=False,
                         pad_token_id=tok.eos_token_id)
    assert got == tok.decode(ref[0, full.shape[1]:], skip_special_tokens=True)


def test_cli_end_to_end(tmp_path, tiny_text):
    out = tmp_path / "needle"
    needle.main(["--model", "random:tiny", "--text-file", str(tiny_text), "--lengths", "256,320",
                 "--depths", "0,1", "--presets", "4bit-all,naive-int4", "--max-new-tokens", "3", "--out", str(out)])
    names = {p.name for p in out.iterdir()}
    assert names == {"results.json", "table.md", "needle_fp16.png", "needle_4bit-all.png", "needle_naive-int4.png"}
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["records"]) == 2 * 2 * 2  # lengths x depths x needle kinds
    assert [r["preset"] for r in saved["results"]] == ["fp16", "4bit-all", "naive-int4"]
    for r in saved["results"]:
        assert len(r["grid"]) == 2 and len(r["grid"][0]) == 2
        expect = sum(rec["correct"][r["preset"]] for rec in saved["records"]) / 8
        assert r["accuracy"] == pytest.approx(expect)
    assert all(rec["tokens"] in (256, 320) for rec in saved["records"])
    assert saved["meta"]["command"].startswith("python -m eval.needle")
