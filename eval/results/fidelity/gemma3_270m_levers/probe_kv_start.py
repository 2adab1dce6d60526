"""Probe: does a sliding-window layer misread its window mask as left padding?

eval.perplexity calls the model without a 2-D attention_mask. The "turboquant" attention then
derives each row's first real position (kv_start) from the 4-D mask's columns nobody sees; on a
sliding layer that includes every key older than the window, so kv_start jumps forward and the
exact prefix (exact_prefix_tokens) is overlaid at positions kv_start .. kv_start + P - 1, i.e. on
the wrong tokens. This script feeds one window the eval's way (128-token prefill, 128-token
chunks), with and without an explicit all-ones attention_mask, and prints kv_start per layer kind
and the window's NLL / KL vs fp16.

Run: OMP_NUM_THREADS=1 python eval/results/fidelity/gemma3_270m_levers/probe_kv_start.py
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
from eval import common  # noqa: E402

TOKENS, CHUNK = 1024, 128
PRESETS = ["4bit@exact_prefix_tokens=0", "4bit", "4bit@exact_prefix_tokens=32"]


@torch.inference_mode()
def run(model, ids, spec, with_mask: bool):
    common.set_attention(model, spec.attn_implementation)
    cache = spec.build(model.config)
    out = []
    for start in range(0, ids.shape[1], CHUNK):
        kwargs = common.with_cache(model, cache)
        if with_mask:
            kwargs["attention_mask"] = torch.ones(1, start + CHUNK, dtype=torch.long)
        logits = model(input_ids=ids[:, start:start + CHUNK], use_cache=True, **kwargs).logits
        out.append(torch.log_softmax(logits[0].float(), -1))
    starts = {}
    for i in (0, 5):  # a sliding layer and a global layer
        layer = getattr(cache, "layers", [None] * 6)[i]
        ks = getattr(layer, "kv_start", None)
        starts[i] = None if ks is None else ks.tolist()
    return torch.cat(out), starts


def main() -> None:
    torch.set_num_threads(1)
    model, tokenizer, _ = common.load_model("/work/notes/gemma3.gguf")
    text, _ = common.load_text("wiki")
    ids = tokenizer(text[: 8 * TOKENS + 1000], return_tensors="pt").input_ids[:, :TOKENS]
    targets = ids[0, 1:]
    ref, _ = run(model, ids, common.cache_spec("fp16"), False)
    ref = ref[:-1]
    ref_nll = -ref.gather(-1, targets[:, None]).mean().item()
    print(f"fp16 NLL {ref_nll:.4f}")
    for name in PRESETS:
        for with_mask in (False, True):
            logp, starts = run(model, ids, common.cache_spec(name), with_mask)
            logp = logp[:-1]
            nll = -logp.gather(-1, targets[:, None]).mean().item()
            kl = (ref.exp() * (ref - logp)).sum(-1).mean().item()
            print(f"{name:32s} attention_mask={'ones' if with_mask else 'none':4s} "
                  f"dPPL {100 * (torch.tensor(nll - ref_nll).exp().item() - 1):+6.2f}%  KL {kl:.4f}  "
                  f"kv_start after last chunk: sliding layer 0 {starts[0]}, global layer 5 {starts[5]}", flush=True)


if __name__ == "__main__":
    main()
