"""Host time of a cache layer's held decode launches on a GPU: tensors passed as tensors, or as addresses.

Triton's launcher calls data_ptr() on every tensor argument and asks the driver to translate the address
(cuPointerGetAttribute); an int argument is taken as the address. A layer's held decode launches (the store, the
attention and its split reduction; kernels.HeldStore, kernels.HeldAttention) pass addresses on the direct path
(fast_launch.LaunchSite.run_direct): the lasting tensors' computed once, the new tokens', query's and output's per
call. This replays a one-layer cache's own last decode launches (B=1, Llama-3.1-8B attention shapes) both ways, in
batches of --launches with the GPU behind (no synchronization inside a batch: the time is the host's), alternating
the two for --rounds, and checks both write the same bytes.

    python -m eval.launch_overhead [--presets 4bit,k8v4] [--context 4096] [--launches 300] [--rounds 7]

Writes OUT/results.json and OUT/table.md (the command at its top).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from .common import markdown_table, md_header, run_metadata, write_json
from .host_overhead import HEADS, _attention_module, _model_config


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _layer_with_held_launches(preset: str, context: int, device: str = "cuda"):
    """A one-layer TurboQuantCache on `device`, prefilled with `context` tokens and stepped until its launches are
    held; returns (layer, the last held store call's arguments, the last held attention call's)."""
    import tq_hf
    from tq_hf.attention import turboquant_attention_forward
    from tq_hf.kernels import HeldAttention, HeldStore

    hq, hk, d = HEADS
    cache = tq_hf.TurboQuantCache(_model_config(HEADS, "turboquant"), preset=preset)
    rand = lambda h, n: torch.randn(1, h, n, d, device=device, dtype=torch.float16)  # noqa: E731
    cache.update(rand(hk, context), rand(hk, context), 0)
    module = _attention_module(HEADS)
    seen = {}
    launches = {HeldStore: HeldStore.launch, HeldAttention: HeldAttention.launch}

    def recording(cls):
        def launch(self, *args):
            seen[cls] = args
            return launches[cls](self, *args)
        return launch

    try:
        for cls in launches:
            setattr(cls, "launch", recording(cls))
        for _ in range(8):
            keys, values = cache.update(rand(hk, 1), rand(hk, 1), 0)
            turboquant_attention_forward(module, rand(hq, 1), keys, values, None, scaling=d**-0.5)
    finally:
        for cls, launch in launches.items():
            setattr(cls, "launch", launch)
    _sync()
    if set(seen) != set(launches):
        raise RuntimeError(f"{preset}: a decode step did not hold its launches (seen: {sorted(c.__name__ for c in seen)})")
    return cache.layers[0], seen[HeldStore], seen[HeldAttention]


def _same_writes(first, second, targets: list[torch.Tensor]) -> bool:
    """Whether `first` and `second` write the same bytes into `targets`, each poisoned before (so a launch that
    writes nothing shows), and both write something; the targets are restored after."""
    saved = [t.clone() for t in targets]
    poison = [torch.full_like(t, 0x5A if t.dtype == torch.uint8 else -7) for t in targets]
    results = []
    for fn in (first, second):
        for t, p in zip(targets, poison):
            t.copy_(p)
        fn()
        _sync()
        results.append([t.clone() for t in targets])
    for t, s in zip(targets, saved):
        t.copy_(s)
    wrote = any(not torch.equal(a, p) for a, p in zip(results[0], poison))
    return wrote and all(torch.equal(a, b) for a, b in zip(*results))


def _host_us(fn, launches: int) -> float:
    """Microseconds of host time per call over a batch of calls queued behind the GPU."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(launches):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * elapsed / launches


def measure(preset: str, context: int, launches: int, rounds: int) -> list[dict]:
    layer, store_call, attention_call = _layer_with_held_launches(preset, context)
    held_s, held_a = layer.launches.store, layer.launches.attention
    if not (held_s._plan.site.direct() and held_a._plan.attention.direct()):
        raise RuntimeError("the held launches do not take the direct path here (Triton version, launch hooks)")
    pool, _, _, _, ring_k, ring_v, seq_lens, _ = held_s._tensors
    ways = {  # each way's launches and what they write
        "attention + reduction": (lambda: held_a.launch_tensors(*attention_call), lambda: held_a.launch(*attention_call),
                                  [attention_call[1]]),
        "store": (lambda: held_s.launch_tensors(*store_call), lambda: held_s.launch(*store_call),
                  [t for t in (pool, ring_k, ring_v, seq_lens) if t is not None]),
    }
    rows = []
    for name, (by_tensors, by_addresses, written) in ways.items():
        same = _same_writes(by_tensors, by_addresses, written)
        times = {"tensors": [], "addresses": []}
        for _ in range(rounds):
            times["tensors"].append(_host_us(by_tensors, launches))
            times["addresses"].append(_host_us(by_addresses, launches))
        best = {k: min(v) for k, v in times.items()}
        rows.append({"preset": preset, "context": context, "launch": name, "tensors_us": best["tensors"],
                     "addresses_us": best["addresses"], "saved_us": best["tensors"] - best["addresses"],
                     "rounds_us": times, "same_bytes": same})
        print(f"{preset} {name}: tensors {best['tensors']:.2f} us, addresses {best['addresses']:.2f} us, "
              f"same bytes {same}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m eval.launch_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="4bit,k8v4", help="comma-separated TurboQuantCache presets")
    ap.add_argument("--context", type=int, default=4096, help="tokens in the cache before the decode steps")
    ap.add_argument("--launches", type=int, default=300, help="calls per timed batch (fewer than the launch queue)")
    ap.add_argument("--rounds", type=int, default=7, help="batches per way, alternated; the minimum is reported")
    ap.add_argument("--out", default="eval/results/launch_overhead")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("eval.launch_overhead times launches on a CUDA GPU; none is available")
    rows = [row for preset in args.presets.split(",") for row in measure(preset, args.context, args.launches,
                                                                          args.rounds)]
    meta = run_metadata("eval.launch_overhead", argv)
    report = {"meta": meta, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", report)
    table = markdown_table(["preset", "context", "held launch", "tensors, us per call", "addresses, us per call",
                            "saved, us", "same bytes"],
                           [[r["preset"], r["context"], r["launch"], f"{r['tensors_us']:.2f}",
                             f"{r['addresses_us']:.2f}", f"{r['saved_us']:.2f}", r["same_bytes"]] for r in rows])
    head = md_header("Host time of the held decode launches (B=1, 32/8/128, fp16)", meta["command"],
                     f"GPU: {meta['machine']['cuda_device']}",
                     f"best of {args.rounds} batches of {args.launches} calls queued behind the GPU")
    (out / "table.md").write_text(f"{head}\n{table}\n")
    print(table)
    return report


if __name__ == "__main__":
    main()
