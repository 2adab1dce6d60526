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
def _seed():
    torch.manual_seed(0)
