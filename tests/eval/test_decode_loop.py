"""eval.decode_loop runs its compiled manual loop end to end (on CPU: a tiny model, inductor, no figures)."""

import json

import pytest

from eval import decode_loop


@pytest.mark.slow
def test_cli_end_to_end(tmp_path):
    decode_loop.main(["--lengths", "40", "--caches", "fp16", "4bit", "--steps", "2", "--warmup", "2",
                      "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [(r["cache"], r["context"]) for r in rows] == [("fp16", 40), ("4bit", 40)]
    assert rows[1]["cache_bytes"] > 0
    assert "| 40 | 4bit |" in (tmp_path / "table.md").read_text()
