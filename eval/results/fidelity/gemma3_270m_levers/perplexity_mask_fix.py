"""eval.perplexity with a candidate fix for the sliding-window kv_start bug (see README.md here).

Bug: without a 2-D attention_mask (eval.perplexity calls model(input_ids=...)), the "turboquant"
attention derives kv_start from the 4-D mask's columns no query sees; on a sliding-window layer
those are the keys older than the window, so kv_start lands inside the sequence and the exact
prefix (exact_prefix_tokens) is overlaid on the wrong positions. Candidate fix (belongs in
tq_hf/attention.py, not applied there): when the mask function is given no 2-D padding mask,
attach an all-true one, i.e. "no padding", exactly what generate()'s all-ones mask would say.
This script applies it as a monkeypatch, then runs eval.perplexity.main with the same arguments.

Run: python eval/results/fidelity/gemma3_270m_levers/perplexity_mask_fix.py <eval.perplexity args>
"""

from __future__ import annotations

import shlex
import sys

import torch

sys.path.insert(0, ".")
import tq_hf  # noqa: E402,F401  (registers "turboquant")
from tq_hf import attention as tq_attention  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402

from eval import common, perplexity  # noqa: E402

_original_mask = tq_attention.turboquant_mask


def mask_without_padding_means_none(*args, **kwargs):
    """turboquant_mask, but a mask built without a 2-D padding mask says "no padding" explicitly."""
    mask = _original_mask(*args, **kwargs)
    if mask is not None and kwargs.get("attention_mask") is None:
        setattr(mask, tq_attention.PADDING_ATTRIBUTE,
                torch.ones(mask.shape[0], mask.shape[-1], dtype=torch.bool, device=mask.device))
    return mask


def main() -> None:
    ALL_MASK_ATTENTION_FUNCTIONS.register(tq_attention.ATTENTION_NAME, mask_without_padding_means_none)
    start_run = common.start_run

    def start_run_recording_this_script(module, argv, threads):
        meta = start_run(module, argv, threads)
        meta["command"] = "python " + " ".join([sys.argv[0], *map(shlex.quote, sys.argv[1:])])
        return meta

    common.start_run = start_run_recording_this_script
    perplexity.main(sys.argv[1:])


if __name__ == "__main__":
    main()
