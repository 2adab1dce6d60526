import os

import pytest
import torch

# Kernel tests run through the Triton interpreter without a GPU. It must be on before anything
# imports triton, and any test module may (tq_hf.kernels through tq_hf.ops), so it is set here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
    torch.set_num_threads(1)  # one thread per xdist worker: the workers already fill the cores


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _compress_from_first_token(request, monkeypatch):
    """Most tests exercise the compressed layer with prompts shorter than a layer's exact start
    (TurboQuantConfig.compress_from_tokens): unless a test is marked exact_start, a growing cache whose config
    leaves compress_from_tokens at its default compresses from the first token."""
    if "exact_start" in request.keywords:
        return
    from tq_hf.cache import TurboQuantCache

    exact_start = TurboQuantCache._first_layer

    def first_layer(cache, layer_idx):
        if cache.tq_config.compress_from_tokens is None:
            return cache._compressed_layer(layer_idx)
        return exact_start(cache, layer_idx)

    monkeypatch.setattr(TurboQuantCache, "_first_layer", first_layer)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
