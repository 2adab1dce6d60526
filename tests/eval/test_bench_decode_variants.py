import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from eval.bench_decode_variants import causal_mask, parser


def test_causal_mask_is_sdpa_lower_right():
    """The fp16 baseline's mask for Lq new tokens at the end of S: each query sees the history and itself,
    as SDPA's lower-right causal bias does (fp32, fresh inputs)."""
    assert causal_mask(1, 50, "cpu") is None
    q, k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 37, 16), torch.randn(1, 2, 37, 16)
    mask = causal_mask(5, 37, "cpu")
    assert mask.sum().item() == sum(37 - 5 + i + 1 for i in range(5))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(16)
    want = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    lower_right = causal_lower_right(5, 37)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=lower_right), want, rtol=1e-5, atol=1e-5)


def test_several_shapes_in_one_run():
    """--shape takes one head shape or several (timed in turn in one process), each checked as the benchmark
    parses it; a malformed one is refused by name before any GPU work."""
    assert parser().parse_args([]).shape == [(32, 8, 128)]
    assert parser().parse_args(["--shape", "9/3/64", "8/4/256"]).shape == [(9, 3, 64), (8, 4, 256)]
    with pytest.raises(SystemExit):
        parser().parse_args(["--shape", "9/4/64"])
