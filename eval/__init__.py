"""Evaluation of tq_hf against the uncompressed cache and peer KV-cache quantizers.

One command each, results as data (results.json, table.md) plus plots, with the command,
model, text and versions inside:

    python -m eval.perplexity --help   # sliding-window PPL, KL and top-1 vs fp16, cache in the loop
    python -m eval.needle --help       # needle-in-a-haystack grid, parity vs fp16
    python -m eval.speed --help        # generate() decode ms/token, prefill, peak KV memory (GPU)

eval.common holds what they share: model and text loading, the registry of caches under test
(fp16 reference, TurboQuant presets, HF QuantizedCache, fake-quant peers) and run metadata.
"""
