"""Kernel tests run on CUDA when there is one, else on CPU through the Triton interpreter.

TRITON_INTERPRET must be set before triton is imported, hence here rather than in a fixture.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
