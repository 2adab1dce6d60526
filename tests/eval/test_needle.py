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
    p = needle.build_prompt(tok, _hay(tok), 601, depth, kind, trial=1, rng=random.Random(0))
    assert len(p.context) + len(p.question) == 601
    text = tok.decode(p.context)
    system = needle.PASSKEY_SYSTEM if kind == "passkey" else needle.SENTENCE_SYSTEM
    intro = system + "\n\n"  # the byte tokenizer has no chat template: plain framing
    assert text.startswith(intro) and p.needle in text
    hay = text[len(intro):].replace(p.needle, "", 1)
    at = text.index(p.needle) - len(intro)
    if depth == 0.0:
        assert text[len(intro):].lstrip().startswith(p.needle)
    elif depth == 1.0:
        assert text.rstrip().endswith(p.needle)
    else:  # snapped forward to the next sentence end (byte tokens: one character each)
        assert depth * len(hay) - 3 <= at <= depth * len(hay) + 64, (at, len(hay))
        if at > round(depth * len(hay)) + 2:  # it moved, so it moved to a sentence end
            assert hay[:at].rstrip()[-1] in ".!?\n", hay[:at]
    assert all(k.lower() in p.needle.lower() for k in p.keys)
    question = tok.decode(p.question)
    assert question.startswith("\n\nWhat is") and question.rstrip().endswith(" is"), question


class _ChatTokenizer:
    """Stands in for an instruct tokenizer: ChatML template rendering, byte tokens."""

    chat_template = "chatml"

    def __init__(self, tok):
        self.tok = tok

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + \
            "<|im_start|>assistant\n"

    def __call__(self, text, add_special_tokens):
        return self.tok(text, add_special_tokens=add_special_tokens)

    def decode(self, ids):
        return self.tok.decode(ids)


def test_chat_template_prompt_puts_the_haystack_in_the_user_turn(tiny_model):
    """With a chat template: system turn, user turn = haystack + needle + question, then the
    assistant turn and the answer's start; the context ends inside the user turn."""
    _, tok = tiny_model
    chat = _ChatTokenizer(tok)
    p = needle.build_prompt(chat, _hay(tok), 400, 0.5, "passkey", 0, random.Random(1))
    assert len(p.context) + len(p.question) == 400
    context, question = tok.decode(p.context), tok.decode(p.question)
    assert context.startswith(f"<|im_start|>system\n{needle.PASSKEY_SYSTEM}<|im_end|>\n<|im_start|>user\n")
    assert p.needle in context and "<|im_end|>" not in context.split("user\n", 1)[1]
    assert question == (f"\n\n{needle.PASSKEY_QUESTION[0]}<|im_end|>\n<|im_start|>assistant\n"
                        f"{needle.PASSKEY_QUESTION[1]}")


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
    p = needle.build_prompt(tok, _hay(tok), 500, 0.5, "passkey", 0, random.Random(3))
    got = needle.answer(model, tok, p, common.cache_spec("fp16"), 6, "cpu")
    full = torch.tensor([p.context + p.question])
    ref = model.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=6, do_sample=False,
                         pad_token_id=tok.eos_token_id)
    assert got == tok.decode(ref[0, full.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("name", ["fp16", "4bit-all", "k3v4", "naive-int4"])
def test_shared_prefill_writes_what_the_models_prefill_writes(tiny_model, name):
    """The shortcut (fp16 context K/V written into the cache through update()) and the model's own
    prefill forward into that cache leave caches the question reads alike: same next-token logits
    for every question position. Exact prefill attention makes them agree up to fp32 rounding (a
    rounding difference can flip a quantization code, hence the tolerance, far below the
    compression error itself)."""
    model, tok = tiny_model
    p = needle.build_prompt(tok, _hay(tok), 400, 0.5, "passkey", 0, random.Random(5))
    spec = common.cache_spec(name)
    question = torch.tensor([p.question])
    kv = needle.context_kv(model, p, "cpu")
    logits = {}
    for path, shared in (("forward", None), ("shared", kv)):
        cache = needle.prefilled_cache(model, p, spec, "cpu", shared)
        assert cache.get_seq_length() == len(p.context)
        with torch.inference_mode():
            logits[path] = model(input_ids=question, use_cache=True, **common.with_cache(model, cache)).logits
    assert torch.isfinite(logits["shared"]).all()
    diff = (logits["shared"] - logits["forward"]).abs().max().item()
    assert diff < 2e-3, f"{name}: shared-prefill logits differ from the forward-prefill ones by {diff:.2e}"
    if name != "fp16":  # and the cache under test really changed what the question reads
        with torch.inference_mode():
            dense = needle.prefilled_cache(model, p, common.cache_spec("fp16"), "cpu", kv)
            ref = model(input_ids=question, use_cache=True, **common.with_cache(model, dense)).logits
        assert (ref - logits["shared"]).abs().max().item() > 10 * diff, f"{name}: compression left no trace"


def test_cli_end_to_end(tmp_path, tiny_text):
    out = tmp_path / "needle"
    needle.main(["--model", "random:tiny", "--text-file", str(tiny_text), "--lengths", "512,600",
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
        for n in (512, 600):
            at_n = [rec for rec in saved["records"] if rec["length"] == n]
            assert r["accuracy_by_length"][str(n)] == pytest.approx(
                sum(rec["correct"][r["preset"]] for rec in at_n) / len(at_n))
            ref_ok = [rec for rec in at_n if rec["correct"]["fp16"]]
            parity = r["parity_vs_fp16_by_length"][str(n)]
            assert parity is None if not ref_ok else parity == pytest.approx(
                sum(rec["correct"][r["preset"]] for rec in ref_ok) / len(ref_ok))
    table = (out / "table.md").read_text()
    assert "Per length (4 prompts each)" in table and "| 512 tok | 600 tok |" in table
    assert "written into each fresh cache under test through the cache's update()" in saved["method"]
    assert all(rec["tokens"] in (512, 600) for rec in saved["records"])
    assert saved["meta"]["command"].startswith("python -m eval.needle")


def test_lengths_past_the_models_context_are_refused(tiny_model):
    model, _ = tiny_model  # random:tiny has 4096 positions
    needle.check_fits(model.config, [4086], 10)
    with pytest.raises(ValueError, match="exceeds the model's context of 4096"):
        needle.check_fits(model.config, [1024, 4090], 10)
