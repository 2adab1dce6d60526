"""eval.speed on CPU with the tiny preset set: runs end to end and reports consistent figures."""

import json

import pytest
import torch

from eval import speed


def test_tensor_bytes_walks_containers_once():
    t = torch.zeros(10, dtype=torch.float16)
    assert speed.tensor_bytes([t, (t, {"a": torch.zeros(3, dtype=torch.uint8)})]) == 20 + 3


def test_points_parsing():
    args = speed.parse_args(["--preset-set", "tiny", "--points", "2x48,1X16"])
    assert args.points == [(2, 48), (1, 16)] and args.model == "random:tiny"
    with pytest.raises(SystemExit):
        speed.parse_args(["--points", "2x"])


def test_cli_end_to_end(tmp_path):
    out = tmp_path / "speed"
    # tiny contexts: the default exact ring (128 tokens) would outweigh the pool, so it is off here
    tq = "4bit-all@recent_window=0@exact_prefix_tokens=0"
    speed.main(["--preset-set", "tiny", "--caches", f"{tq},naive-int4", "--out", str(out), "--device", "cpu"])
    assert {p.name for p in out.iterdir()} == {"results.json", "table.md", "decode_ms.png", "memory.png"}
    saved = json.loads((out / "results.json").read_text())
    rows = saved["results"]
    assert len(rows) == 3 * 3  # points x caches (fp16 added)
    for r in rows:
        assert "skipped" not in r, r
        assert r["decode_ms_per_token"] > 0 and r["prefill_s"] > 0 and r["cache_bytes"] > 0
    fp16 = {(r["batch"], r["context"]): r for r in rows if r["cache"] == "fp16"}
    for r in rows:
        base = fp16[(r["batch"], r["context"])]
        if r["cache"] == "fp16":
            assert r["decode_vs_fp16"] == 1.0
            # float32 on CPU: twice the fp16 bytes of B x (S + 5) tokens, 2 layers x 2 heads x 32 dims x K,V
            assert r["cache_bytes"] == r["batch"] * (r["context"] + 4) * 2 * 2 * 32 * 2 * 4
        else:
            assert r["cache_bytes"] < base["cache_bytes"] / 2
    assert "partial" not in saved  # the finished run replaced the checkpoints


def test_a_killed_run_keeps_the_runs_it_finished(tmp_path, monkeypatch):
    """Results are checkpointed after every run: a run killed (time limit, OOM) mid-sweep keeps its figures."""
    out = tmp_path / "speed"
    real_measure, calls = speed.measure, []

    def measure_then_die(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a `timeout` kill would stop it
        return real_measure(*args, **kwargs)

    monkeypatch.setattr(speed, "measure", measure_then_die)
    with pytest.raises(KeyboardInterrupt):
        speed.main(["--preset-set", "tiny", "--caches", "naive-int4", "--out", str(out), "--device", "cpu"])
    saved = json.loads((out / "results.json").read_text())
    assert saved["partial"] is True and [r["cache"] for r in saved["results"]] == ["fp16", "naive-int4"]
    assert saved["results"][1]["decode_vs_fp16"] > 0
    assert "naive-int4" in (out / "table.md").read_text()


def test_one_context_per_cache_writes_the_table_without_plots(tmp_path):
    """A plot needs a curve: with every cache timed at one context only the table is written."""
    row = {"batch": 16, "context": 32768, "decode_ms_per_token": 7.4, "decode_vs_fp16": 0.46, "prefill_s": 5.8,
           "peak_kv_side_bytes": 2**30, "cache_bytes": 2**29, "cache_vs_fp16": 0.28}
    report = {"meta": {"command": "python -m eval.speed --points 16x32768", "machine": {"cuda_device": None}},
              "model": "m", "dtype": "torch.float16", "method": "x", "skipped": {},
              "results": [dict(row, cache="fp16"), dict(row, cache="4bit-all")]}
    speed.write_outputs(tmp_path, report)
    assert {p.name for p in tmp_path.iterdir()} == {"results.json", "table.md"}
    assert (tmp_path / "table.md").read_text().splitlines()[2] == "Command: `python -m eval.speed --points 16x32768`"


def test_compiled_rows_and_both_ratios(tmp_path):
    """fp16+compile (StaticCache) and a TurboQuantCache+compile (max_cache_len) run through generate()'s compiled
    decode in the same run as the eager rows; every row gets its ratio to both fp16 rows."""
    out = tmp_path / "speed"
    tq = "4bit-all@recent_window=0@exact_prefix_tokens=0"
    speed.main(["--preset-set", "tiny", "--points", "1x32", "--caches", f"fp16+compile,{tq},{tq}+compile",
                "--out", str(out), "--device", "cpu"])
    rows = {r["cache"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert list(rows) == ["fp16", "fp16+compile", tq, f"{tq}+compile"]
    assert rows["fp16+compile"]["decode_vs_fp16_compiled"] == 1.0 and rows["fp16"]["decode_vs_fp16"] == 1.0
    for r in rows.values():
        assert r["decode_vs_fp16"] > 0 and r["decode_vs_fp16_compiled"] > 0
    # fixed capacity: the pool holds S + 5 tokens of 4-bit codes, under the growing pool's block slack
    assert rows[f"{tq}+compile"]["cache_bytes"] <= rows[tq]["cache_bytes"]
    assert rows["fp16+compile"]["cache_bytes"] == 1 * (32 + 5) * 2 * 2 * 32 * 2 * 4  # StaticCache: S + 5 tokens, fp32


def test_compile_suffix_only_for_caches_that_have_a_compileable_form():
    with pytest.raises(ValueError, match="compile"):
        speed.resolve_caches("naive-int4+compile")


def test_next_turn_and_prompt_lookup_rows(tmp_path, monkeypatch):
    """--turn2-tokens times a next turn over each run's own cache (its forward sees the history: a cache emptied
    before it would give another length), --prompt-lookup a prompt-lookup generate(); both with fp16 ratios."""
    lengths = []
    original = speed.next_turn_seconds

    def recording(model, cache, sequences, tokens, device, extra):
        before = cache.get_seq_length()
        seconds = original(model, cache, sequences, tokens, device, extra)
        lengths.append((before, cache.get_seq_length(), sequences.shape[1]))
        return seconds

    monkeypatch.setattr(speed, "next_turn_seconds", recording)
    out = tmp_path / "speed"
    tq = "4bit-all@recent_window=0@exact_prefix_tokens=0"
    speed.main(["--preset-set", "tiny", "--points", "1x32", "--caches", f"{tq},{tq}+compile", "--turn2-tokens", "6",
                "--prompt-lookup", "3", "--out", str(out), "--device", "cpu"])
    rows = {r["cache"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert rows["fp16"]["turn2_vs_fp16"] == 1.0 and rows["fp16"]["lookup_vs_fp16"] == 1.0
    assert rows[tq]["turn2_s"] > 0 and rows[tq]["turn2_vs_fp16"] > 0 and rows[tq]["lookup_tokens_per_s"] > 0
    assert rows[f"{tq}+compile"]["turn2_s"] > 0 and rows[f"{tq}+compile"].get("lookup_tokens_per_s") is None
    # each next turn went over its run's history (32 + 5 tokens, the last not yet stored) and added 6 + 1 tokens
    assert all(before == 36 and seq == 37 and after == 37 + 6 for before, after, seq in lengths), lengths
    assert "turn 2 s" in (out / "table.md").read_text() and "lookup tokens/s" in (out / "table.md").read_text()


def test_prompt_lookup_skipped_at_batch_above_one(tmp_path):
    """transformers' assisted decoding takes one sequence: a batch-2 point times the rest and leaves lookup empty."""
    out = tmp_path / "speed"
    speed.main(["--preset-set", "tiny", "--points", "2x32", "--caches", "4bit-all", "--prompt-lookup", "3",
                "--out", str(out), "--device", "cpu"])
    rows = json.loads((out / "results.json").read_text())["results"]
    assert {r["cache"] for r in rows} == {"fp16", "4bit-all"}
    assert all(r["decode_ms_per_token"] > 0 and r.get("lookup_tokens_per_s") is None for r in rows)


def record_forward_widths(monkeypatch) -> list[int]:
    """The new tokens per row of every forward of the models eval.common loads from now on, in call order."""
    from eval import common

    widths: list[int] = []
    real_load = common.load_model

    def load_recording(*args, **kwargs):
        model, tokenizer, desc = real_load(*args, **kwargs)
        model.register_forward_pre_hook(
            lambda module, a, kw: widths.append((a[0] if a else kw["input_ids"]).shape[1]), with_kwargs=True)
        return model, tokenizer, desc

    monkeypatch.setattr(common, "load_model", load_recording)
    return widths


def test_prefill_chunk_feeds_every_cache_the_prompt_in_chunks(tmp_path, monkeypatch):
    """--prefill-chunk C: no forward of any cache (growing or compiled) sees more than C new tokens per row, the
    decode steps still run, and the fixed-size caches end holding what one prefill's do (a growing pool's slack
    depends on the sizes it grew by). The chunks run outside generate(), whose compiled prefill chunks break
    transformers' own StaticCache on a GPU."""
    widths = record_forward_widths(monkeypatch)
    tq = "4bit-all@recent_window=0@exact_prefix_tokens=0"
    caches = f"fp16+compile,{tq},{tq}+compile"
    runs = {}
    for chunk in (0, 12):
        widths.clear()
        out = tmp_path / f"chunk{chunk}"
        speed.main(["--preset-set", "tiny", "--points", "1x32", "--caches", caches, "--prefill-chunk", str(chunk),
                    "--out", str(out), "--device", "cpu"])
        runs[chunk] = ({r["cache"]: r for r in json.loads((out / "results.json").read_text())["results"]},
                       list(widths))
    (one, one_widths), (chunked, chunked_widths) = runs[0], runs[12]
    # every run (4 caches x a warm-up and a timed run): one 32-token prefill, or 31 tokens in chunks of 12, 12 and 7
    # outside generate() and its last token as generate()'s prefill
    assert max(one_widths) == 32 and one_widths.count(32) == 8  # the control
    assert max(chunked_widths) == 12 and chunked_widths.count(12) == 16 and chunked_widths.count(7) == 8
    assert len(chunked_widths) == len(one_widths) + 3 * 8
    for name, row in chunked.items():
        assert row["decode_ms_per_token"] > 0, name
        if name == "fp16" or name.endswith("+compile"):
            assert row["cache_bytes"] == one[name]["cache_bytes"], name
    with pytest.raises(SystemExit):
        speed.parse_args(["--prefill-chunk", "-1"])


def test_generate_chunks_prefill_through_generates_own_chunking(tmp_path, monkeypatch):
    """--generate-chunks C: generate(prefill_chunk_size=C) takes the whole prompt in forwards of at most C tokens per
    row (compiled for the fixed-capacity caches), then the decode steps; refused beside --prefill-chunk."""
    widths = record_forward_widths(monkeypatch)
    tq = "4bit-all@recent_window=0@exact_prefix_tokens=0"
    out = tmp_path / "chunks"
    speed.main(["--preset-set", "tiny", "--points", "1x32", "--caches", f"{tq},{tq}+compile", "--generate-chunks",
                "12", "--out", str(out), "--device", "cpu"])
    rows = json.loads((out / "results.json").read_text())
    assert "generate(prefill_chunk_size=12)" in rows["method"]
    assert {r["cache"] for r in rows["results"]} == {"fp16", tq, f"{tq}+compile"}
    assert all(r["decode_ms_per_token"] > 0 for r in rows["results"])
    # 3 caches x a warm-up and a timed run: 32 prompt tokens in forwards of 12, 12 and 8, none wider
    assert max(widths) == 12 and widths.count(12) == 12 and widths.count(8) == 6, widths
    with pytest.raises(SystemExit):
        speed.parse_args(["--generate-chunks", "8", "--prefill-chunk", "8"])
    with pytest.raises(SystemExit):
        speed.parse_args(["--generate-chunks", "-1"])


def test_prompt_lookup_left_out_for_transformers_quantized_cache(monkeypatch):
    """transformers' assisted decoding cannot crop a QuantizedCache (5.17 fails inside crop(), later versions
    refuse it): its rows take no prompt-lookup run, where every growing TurboQuant cache takes one."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from eval import common

    lookups = {}

    def fake_run(model, spec, prompt, new_tokens, device, cache=None, lookup=0, **_):
        lookups[spec.name] = lookup
        return {"prefill_s": 0.1, "decode_ms_per_token": 1.0, "cache_bytes": 1, "peak_kv_side_bytes": None}

    monkeypatch.setattr(speed, "one_run", fake_run)
    monkeypatch.setattr(common, "set_attention", lambda model, name: None)
    model = SimpleNamespace(config=LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                               num_hidden_layers=2, intermediate_size=128, vocab_size=97))
    args = speed.parse_args(["--preset-set", "tiny", "--prompt-lookup", "3", "--device", "cpu", "--repeats", "1"])
    for name in ("quanto-int4", "hqq-int4", "4bit-all"):
        speed.measure(model, common.cache_spec(name), 1, 32, args)
    assert lookups == {"quanto-int4": 0, "hqq-int4": 0, "4bit-all": 3}


def test_a_peer_cache_that_fails_is_its_rows_result(monkeypatch, capsys):
    """A failure inside another project's cache (transformers' QuantizedCache, its backend) is recorded on its row
    and the run goes on; one of this project's caches failing ends the run."""
    from eval import common

    def measure(model, spec, batch, context, args):
        if spec.name != "fp16":
            raise IndexError("too many indices for tensor of dimension 1")
        return {"decode_ms_per_token": 1.0}

    monkeypatch.setattr(speed, "measure", measure)
    args = speed.parse_args(["--preset-set", "tiny", "--points", "1x32", "--device", "cpu"])
    specs = [common.cache_spec(name) for name in ("fp16", "quanto-int4", "hqq-int4")]
    rows = speed.run_points(None, specs, args)
    assert [r.get("skipped") for r in rows] == [None] + ["failed: IndexError: too many indices for tensor of dimension 1"] * 2
    assert "IndexError" in capsys.readouterr().err
    with pytest.raises(IndexError):
        speed.run_points(None, [common.cache_spec("4bit-all")], args)
