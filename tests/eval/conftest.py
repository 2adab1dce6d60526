"""Shared fixtures of the eval tests: offline hub, one CPU thread, a tiny slice of the eval text."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run faster on one thread, and much faster on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_text(tmp_path_factory):
    """~3 KB of the offline Wikipedia text (text from Wikipedia, CC BY-SA 4.0) as a file."""
    from eval.common import wiki_text

    path = tmp_path_factory.mktemp("text") / "tiny.txt"
    path.write_text(wiki_text()[:3000], encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_model():
    from eval.common import load_model

    model, tokenizer, _ = load_model("random:tiny")
    return model, tokenizer
