"""Host time of one decode layer step on the kernel path, measurable without a GPU.

At B=1 a decode step is bound by the host (on an H200 the attention kernel takes ~0.03 ms, the cache's update and
the "turboquant" attention ~0.4 ms of host time per layer under cProfile).
This times what our Python and the step's tensor ops cost: `TurboQuantCache.update` (store) plus
`turboquant_attention_forward` (attention + split reduction) for one layer, with every Triton launch stubbed and
the tensors on the CPU. It is not a GPU figure (there each tensor op and launch also pays the driver; profile
generate() on the device for that) but it moves with the host-side code, so host-side changes can be compared here, side by side in one run.

    python -m eval.host_overhead --presets 4bit,k8v4 --batch 1 --steps 2000 --out eval/results/host_overhead

Prints a table (us per layer step, median of --rounds) and writes OUT/results.json and OUT/table.md; --profile
prints the top functions of one more round.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import time
from pathlib import Path

import torch

from .common import markdown_table, md_header, run_metadata, write_json


@contextlib.contextmanager
def stubbed_launches():
    """The kernel path on CPU tensors as on an H200 (its launch choices), every launch a no-op; restored after."""
    from tq_hf import ops
    from tq_hf.kernels import attention, device, fast_launch

    cpu = torch.device("cpu")
    patches = [
        (ops, "use_kernels", lambda t: True),
        (fast_launch.LaunchSite, "__call__", lambda self, *args: None),
        (attention, "launch_fitting", lambda kernel, grid, args, constants, block_n, stages:
         fast_launch.LaunchSite(None, grid, {})),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        with device.assumed_traits(cpu, device.H200):  # CPU tensors planned as on an H200
            yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def layer_step(preset: str, batch: int, context: int, heads: tuple[int, int, int] = (32, 8, 128)):
    """A one-layer TurboQuantCache of `context` tokens (stored by the reference) and a callable decode step."""
    from transformers import LlamaConfig

    import tq_hf  # noqa: F401  (registers the attention function)
    from tq_hf.attention import turboquant_attention_forward

    hq, hk, d = heads
    cfg = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hk, head_dim=d,
                      num_hidden_layers=1, intermediate_size=64, vocab_size=64)
    cfg._attn_implementation = "turboquant"
    cache = tq_hf.TurboQuantCache(cfg, preset=preset)
    dtype = torch.float16
    cache.update(torch.randn(batch, hk, context, d, dtype=dtype), torch.randn(batch, hk, context, d, dtype=dtype), 0)
    q = torch.randn(batch, hq, 1, d, dtype=dtype)
    k, v = torch.randn(batch, hk, 1, d, dtype=dtype), torch.randn(batch, hk, 1, d, dtype=dtype)
    module = torch.nn.Module()
    module.is_causal = True

    def step():
        keys, values = cache.update(k, v, 0)
        turboquant_attention_forward(module, q, keys, values, None, scaling=d**-0.5)
    return step


def time_steps(step, steps: int) -> float:
    """Mean microseconds per call over `steps` calls."""
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return 1e6 * (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m eval.host_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="4bit,k8v4", help="comma-separated TurboQuantCache presets")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096, help="tokens in the cache before the timed steps")
    ap.add_argument("--steps", type=int, default=2000, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="print the top functions of one more round")
    ap.add_argument("--out", default="eval/results/host_overhead")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steadier figures; restored below
    try:
        rows = _measure(args)
    finally:
        torch.set_num_threads(threads)
    report = {"meta": run_metadata("eval.host_overhead", argv), "rows": rows}
    print(write_outputs(Path(args.out), report))
    return report


def write_outputs(out: Path, report: dict) -> str:
    """OUT/results.json and OUT/table.md (the command at its top); returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", report)
    table = markdown_table(["preset", "B", "context", "us per layer step (median)", "rounds"],
                           [[r["preset"], r["batch"], r["context"], f"{r['us_per_layer_step']:.1f}",
                             " / ".join(f"{x:.1f}" for x in r["rounds_us"])] for r in report["rows"]])
    head = md_header("Host time of one decode layer step (Triton launches stubbed, CPU tensors)",
                     report["meta"]["command"], f"CPU: {report['meta']['machine']['platform']}, 1 torch thread")
    (out / "table.md").write_text(head + "\n" + table + "\n")
    return table


def _measure(args) -> list[dict]:
    """One row per preset: the median over --rounds of the mean us per decode layer step."""
    rows = []
    for preset in args.presets.split(","):
        step = layer_step(preset, args.batch, args.context)
        with stubbed_launches():
            for _ in range(20):  # plans made, caches warm
                step()
            per_round = [time_steps(step, args.steps) for _ in range(args.rounds)]
            if args.profile:
                prof = cProfile.Profile()
                prof.runcall(time_steps, step, args.steps)
                print(f"== {preset}")
                pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        rows.append({"preset": preset, "batch": args.batch, "context": args.context, "steps": args.steps,
                     "us_per_layer_step": statistics.median(per_round), "rounds_us": per_round})
    return rows


if __name__ == "__main__":
    main()
