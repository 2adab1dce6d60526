"""A compiled decode step in a manual loop (gpt-fast style) against the bytes a token must read.

One fixed-capacity cache (fp16 `StaticCache`, or `TurboQuantCache(max_cache_len=...)`), a prompt
prefilled eagerly, then `torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)` run
step after step with no generate() around it; the steady-state step time (CUDA events, median)
is compared with the byte floor: the weights (lm_head included) plus the KV cache read once, at
the copy bandwidth measured in the same run. Model: a random-init Llama with Llama-3.1-8B shapes.

Two timings: "step" synchronizes after every step (as generate() does, which checks its stopping criteria
on the host each token: the host's part of a step adds to the device's), "pipelined" runs the steps back
to back with the position advanced on the device and one synchronization at the end (as gpt-fast's loop
runs: the host prepares the next replay while the device works); "host" is the host's time per step there, and
"host per call" the compiled call's alone, with dynamo's guard evaluation and without it (torch.compiler.set_stance's
skip_guard_eval_unsafe).

    python -m eval.decode_loop --layers 32 --lengths 32768 131072 --caches fp16 4bit

--profile-steps N profiles N more steps (torch.profiler): the kernels per step, their busy time per step (the
step time less it is the host's and the launches' gaps), the costliest kernels, and the host's operators by
their own time (dynamo's guard lookup, the CUDA graph's launch, ...).

Writes OUT/results.json and OUT/table.md. On a CPU it runs the same path on a tiny model (a check
of the script, no figures).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from . import common

GIB = 2**30


def copy_bandwidth(device: str, nbytes: int = 2 * GIB) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / min(times[1:])


def make_cache(name: str, config, capacity: int):
    from transformers import StaticCache

    if name == "fp16":
        return StaticCache(config=config, max_cache_len=capacity)
    from tq_hf import TurboQuantCache

    return TurboQuantCache(config, preset=name, max_cache_len=capacity)


def cache_bytes(cache) -> int:
    """Bytes a decode step reads from the cache at its current length (compressed or dense)."""
    if hasattr(cache, "memory_footprint"):
        return cache.memory_footprint()
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers if layer.is_initialized)


def kernel_profile(events, steps: int, top: int = 12) -> dict:
    """Device kernels of `steps` profiled steps (torch.profiler events): per step their count and busy time, and the
    `top` costliest by total time (name, calls per step, microseconds per call); the host's `top` operators by their
    own time ("host_top", when the events hold CPU ones)."""
    totals: dict[str, list] = {}
    host: dict[str, list] = {}
    for ev in events:
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            entry = host.setdefault(ev.name, [0, 0.0])
            entry[0] += 1
            entry[1] += getattr(ev, "self_cpu_time_total", 0.0)
            continue
        entry = totals.setdefault(ev.name, [0, 0.0])
        entry[0] += 1
        entry[1] += ev.device_time
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    host_ranked = sorted(((k, v) for k, v in host.items() if v[1] > 0), key=lambda kv: -kv[1][1])[:top]
    return {"kernels_per_step": sum(n for n, _ in totals.values()) / steps,
            "busy_ms_per_step": sum(t for _, t in totals.values()) / steps / 1e3,
            "top": [{"kernel": name[:100], "per_step": n / steps, "us_per_call": t / n} for name, (n, t) in ranked],
            "host_top": [{"op": name[:100], "per_step": n / steps, "us_per_step": t / steps}
                         for name, (n, t) in host_ranked]}


def run_point(model, name: str, length: int, steps: int, warmup: int, device: str, profile_steps: int = 0) -> dict:
    # (StaticCache writes at its own running length: each call takes a slot, the host timings' 6 x steps too)
    capacity = length + warmup + 8 * steps + profile_steps + 1
    cache = make_cache(name, model.config, capacity)
    ids = torch.randint(3, model.config.vocab_size, (1, length), device=device)
    kwargs = common.with_cache(model, cache)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs)  # the eager prefill
    token = out.logits[:, -1:].argmax(-1)
    step = torch.compile(model.forward, mode="reduce-overhead" if device == "cuda" else "default", fullgraph=True)
    pos = torch.tensor([[length]], device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def advance() -> None:  # one decode step: the next token at the next position (advanced on the device)
        nonlocal token, pos
        logits = step(input_ids=token, position_ids=pos, cache_position=pos[0], use_cache=True, **kwargs).logits
        token = logits[:, -1:].argmax(-1).clone()
        pos = pos + 1

    def event():
        return torch.cuda.Event(enable_timing=True) if device == "cuda" else None

    times = []
    pipelined = host = None
    with torch.no_grad():
        for i in range(warmup + steps):
            start, end = event(), event()
            if start:
                start.record()
            advance()
            if end:
                end.record()
                sync()
                if i >= warmup:
                    times.append(start.elapsed_time(end))
        if device == "cuda" and steps:
            start, end = event(), event()
            start.record()
            t0 = time.perf_counter()
            for _ in range(steps):
                advance()
            host = (time.perf_counter() - t0) * 1e3 / steps
            end.record()
            sync()
            pipelined = start.elapsed_time(end) / steps
        # the compiled call's own host time, then without dynamo's guard evaluation (nothing changes between these
        # calls, so set_stance's unsafe skip runs the same graph): how much of it the guards are
        call = lambda: step(input_ids=token, position_ids=pos, cache_position=pos[0], use_cache=True, **kwargs)  # noqa: E731
        host_call = host_ms(call, steps, sync)
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            host_unguarded = host_ms(call, steps, sync)
        profile = None
        if profile_steps and device == "cuda":
            from torch.profiler import ProfilerActivity, profile as profiler

            with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(profile_steps):
                    advance()
                sync()
            profile = kernel_profile(prof.events(), profile_steps)
    return {"cache": name, "context": length, "step_ms": statistics.median(times) if times else None,
            "pipelined_ms": pipelined, "host_ms": host, "host_call_ms": host_call, "host_call_unguarded_ms": host_unguarded,
            "cache_bytes": cache_bytes(cache), "profile": profile}


def host_ms(call, calls: int, sync) -> float:
    """Host milliseconds per call of `call`, `calls` back to back (best of 3 rounds; the device drained before each)."""
    best = float("inf")
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - t0) * 1e3 / calls)
    sync()
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eval.decode_loop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--caches", nargs="+", default=["fp16", "4bit"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--profile-steps", type=int, default=0,
                   help="profile this many more steps (CUDA only): kernels per step, busy time, the costliest")
    p.add_argument("--out", default="eval/results/decode_loop")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = f"random:llama-3.1-8b,layers={args.layers}" if device == "cuda" else "random:tiny"
    model, _, description = common.load_model(shape, dtype=torch.float16 if device == "cuda" else torch.float32,
                                               device=device, attn_implementation="turboquant")
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    bandwidth = copy_bandwidth(device) if device == "cuda" else None
    rows = []
    for length in args.lengths:
        for name in args.caches:
            row = run_point(model, name, length, args.steps, args.warmup, device, args.profile_steps)
            if bandwidth and row["step_ms"]:
                row["floor_ms"] = 1e3 * (weights + row["cache_bytes"]) / bandwidth
                row["vs_floor"] = row["step_ms"] / row["floor_ms"]
                if row["pipelined_ms"]:
                    row["pipelined_vs_floor"] = row["pipelined_ms"] / row["floor_ms"]
            rows.append(row)
            print(row, flush=True)
            torch.compiler.reset()
            if device == "cuda":
                torch.cuda.empty_cache()
    for row in rows:
        ref = next((r for r in rows if r["cache"] == "fp16" and r["context"] == row["context"]), None)
        for key in ("step_ms", "pipelined_ms"):
            if ref and ref.get(key) and row.get(key):
                row[f"{key[:-3]}_vs_fp16"] = row[key] / ref[key]
    report = {"meta": common.run_metadata("eval.decode_loop", argv), "model": description, "weights_bytes": weights,
              "copy_bandwidth_gbs": bandwidth / 1e9 if bandwidth else None, "steps": args.steps,
              "warmup": args.warmup, "results": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "results.json", report)
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    table = common.markdown_table(
        ["S", "cache", "step ms", "vs fp16", "pipelined ms", "vs fp16", "host ms per step",
         "host ms per call / without guards", "byte floor ms", "step vs floor", "pipelined vs floor", "cache GiB"],
        [[r["context"], r["cache"], fmt(r["step_ms"], ".3f"), fmt(r.get("step_vs_fp16"), ".2f"),
          fmt(r.get("pipelined_ms"), ".3f"), fmt(r.get("pipelined_vs_fp16"), ".2f"), fmt(r.get("host_ms"), ".3f"),
          f"{fmt(r.get('host_call_ms'), '.3f')} / {fmt(r.get('host_call_unguarded_ms'), '.3f')}",
          fmt(r.get("floor_ms"), ".3f"), fmt(r.get("vs_floor"), ".2f"), fmt(r.get("pipelined_vs_floor"), ".2f"),
          f"{r['cache_bytes'] / GIB:.2f}"] for r in rows])
    head = common.md_header("Compiled decode step in a manual loop", report["meta"]["command"], f"model: {description}",
                            f"copy bandwidth: {fmt(report['copy_bandwidth_gbs'], '.0f')} GB/s (read + written)",
                            f"step: median of {args.steps} synchronized steps after {args.warmup} warm-up steps (CUDA events); "
                            f"pipelined: {args.steps} more back to back, one synchronization")
    text = head + "\n" + table + "\n" + profile_tables(rows)
    (out / "table.md").write_text(text, encoding="utf-8")
    print(text)


def profile_tables(rows: list[dict]) -> str:
    """Markdown: per profiled row, kernels and busy time per step, then its costliest kernels."""
    parts = []
    for r in rows:
        prof = r.get("profile")
        if not prof:
            continue
        parts.append(f"\n## S={r['context']}, {r['cache']}: {prof['kernels_per_step']:.0f} kernels and "
                     f"{prof['busy_ms_per_step']:.3f} ms of device time per step\n\n" + common.markdown_table(
                         ["kernel", "calls per step", "us per call", "us per step"],
                         [[k["kernel"], f"{k['per_step']:.1f}", f"{k['us_per_call']:.2f}",
                           f"{k['per_step'] * k['us_per_call']:.1f}"] for k in prof["top"]]) + "\n")
        if prof.get("host_top"):
            parts.append("\nHost operators by their own time:\n\n" + common.markdown_table(
                ["operator", "calls per step", "us per step"],
                [[k["op"], f"{k['per_step']:.1f}", f"{k['us_per_step']:.1f}"] for k in prof["host_top"]]) + "\n")
    return "".join(parts)


if __name__ == "__main__":
    main()
