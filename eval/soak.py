"""Soak run: a TurboQuantCache through many mixed operations (or generated tokens); flat memory, no slowdown.

--mode ops (default): --ops N operations on one cache built from a model config (no weights):
decode steps, prefill chunks, crop, reorder_cache with duplicates, batch_repeat_interleave +
batch_select_indices, and reset when the rows reach --max-len. Every update goes through all layers
and the "turboquant" attention function, as a model's forward would.
--mode generate: --ops generate() rounds of --new-tokens tokens on one reused cache (reset between
rounds) with a random-init model.

Reports allocated bytes (CUDA: torch.cuda.memory_allocated; CPU: the cache's memory_footprint) at
the start, the peak and the end, the peak of the first window vs the rest (flat memory: the later
windows should not exceed the first), and ms/op per window of --window ops (no slowdown: the last
windows vs the second). Writes JSON to --out and the same figures as a markdown table beside it (.md).

    python -m eval.soak --device cuda --ops 10000 --model random:llama-3.1-8b,layers=4 --batch 8
    python -m eval.soak --mode generate --ops 200 --new-tokens 256 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import common

OPS = ("decode", "prefill", "crop", "reorder", "repeat_select", "reset")
OP_WEIGHTS = (0.70, 0.06, 0.08, 0.08, 0.06, 0.02)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["ops", "generate"], default="ops")
    p.add_argument("--ops", type=int, default=10_000, help="operations (ops mode) or generate rounds")
    p.add_argument("--window", type=int, help="operations per timing window (default: --ops / 10)")
    p.add_argument("--model", default="random:tiny", help="random:<shape> (see eval.common)")
    p.add_argument("--preset", default="4bit-all", help=f"cache; known: {', '.join(common.cache_names())}")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-len", type=int, default=512, help="ops mode: reset when rows reach this length")
    p.add_argument("--new-tokens", type=int, default=32, help="generate mode: tokens per round")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], help="default: fp16 on GPU, fp32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, help="stop early (reported) after this long")
    p.add_argument("--out", default="eval/results/soak/results.json")
    args = p.parse_args(argv)
    if args.ops < 2 or args.batch < 1 or args.max_len < 8:
        p.error("--ops >= 2, --batch >= 1, --max-len >= 8")
    args.window = args.window or max(1, args.ops // 10)
    args.dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if args.device == "cpu" else torch.float16)
    return args


def allocated(device: str, cache) -> int:
    return torch.cuda.memory_allocated() if device.startswith("cuda") else cache.memory_footprint()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class OpsDriver:
    """Applies random cache operations the way a model's forward and generate() would."""

    def __init__(self, model_config, spec, args):
        from tq_hf.attention import turboquant_attention_forward

        self.attn = turboquant_attention_forward
        self.layers, self.kv_heads, self.head_dim = common.kv_geometry(model_config)
        self.q_heads = model_config.num_attention_heads
        self.cache = spec.build(model_config)
        self.args = args
        self.gen = torch.Generator(device="cpu").manual_seed(args.seed)
        self.module = type("Attn", (), {"is_causal": True, "training": False,
                                        "num_key_value_groups": self.q_heads // self.kv_heads})()

    def rand_int(self, lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=self.gen))

    def forward(self, tokens: int) -> None:
        a = self.args
        shape = (a.batch, self.kv_heads, tokens, self.head_dim)
        for i in range(self.layers):
            k = torch.randn(shape, device=a.device, dtype=a.dtype)
            v = torch.randn(shape, device=a.device, dtype=a.dtype)
            q = torch.randn(a.batch, self.q_heads, tokens, self.head_dim, device=a.device, dtype=a.dtype)
            key, value = self.cache.update(k, v, i)
            self.attn(self.module, q, key, value, None, scaling=self.head_dim**-0.5)

    def run(self, op: str) -> str:
        a, length = self.args, self.cache.get_seq_length()
        if op == "reset" or length + 64 > a.max_len:
            self.cache.reset()
            return "reset"
        if length == 0 or op == "prefill":
            self.forward(self.rand_int(1, 64))
            return "prefill"
        if op == "crop":
            self.cache.crop(-self.rand_int(1, min(length, 32)))
        elif op == "reorder":
            self.cache.reorder_cache(torch.randint(0, a.batch, (a.batch,), generator=self.gen).to(a.device))
        elif op == "repeat_select":
            self.cache.batch_repeat_interleave(2)
            self.cache.batch_select_indices(torch.randperm(2 * a.batch, generator=self.gen)[: a.batch].to(a.device))
        else:
            self.forward(1)
        return op


def soak_ops(args) -> tuple[list[float], list[int], dict]:
    from transformers import LlamaConfig

    s = common.parse_random_spec(args.model)
    config = LlamaConfig(hidden_size=s["hidden"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                         head_dim=s["head_dim"], num_hidden_layers=s["layers"], vocab_size=8, intermediate_size=8)
    config._attn_implementation = "turboquant"
    driver = OpsDriver(config, common.cache_spec(args.preset), args)
    weights = torch.tensor(OP_WEIGHTS)
    choices = torch.multinomial(weights, args.ops, replacement=True, generator=driver.gen).tolist()
    counts: dict[str, int] = {}
    times, memory = [], []
    began = time.perf_counter()
    with torch.no_grad():
        for c in tqdm(choices, desc="soak ops", mininterval=10):
            if args.max_seconds and time.perf_counter() - began > args.max_seconds:
                break
            t0 = time.perf_counter()
            done = driver.run(OPS[c])
            sync(args.device)
            times.append(time.perf_counter() - t0)
            memory.append(allocated(args.device, driver.cache))
            counts[done] = counts.get(done, 0) + 1
    return times, memory, {"op_counts": counts, "ops_done": len(times)}


def soak_generate(args) -> tuple[list[float], list[int], dict]:
    model, _, _ = common.load_model(args.model, dtype=args.dtype, device=args.device, attn_implementation="turboquant")
    cache = common.cache_spec(args.preset).build(model.config)
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    times, memory, tokens = [], [], 0
    with torch.no_grad():
        for _ in tqdm(range(args.ops), desc="soak generate", mininterval=10):
            cache.reset()
            ids = torch.randint(0, vocab, (args.batch, 16), generator=gen).to(args.device)
            t0 = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                           min_new_tokens=args.new_tokens, do_sample=False, **common.with_cache(model, cache))
            sync(args.device)
            times.append((time.perf_counter() - t0) / args.new_tokens)  # per generated step
            memory.append(allocated(args.device, cache))
            tokens += args.batch * args.new_tokens
    return times, memory, {"generated_tokens": tokens}


def summarize(times: list[float], memory: list[int], start: int, peak: int, window: int) -> dict:
    windows = [times[i : i + window] for i in range(0, len(times), window)]
    ms = [1e3 * statistics.mean(w) for w in windows]
    first_peak = max(memory[:window])
    later_peak = max(memory[window:], default=first_peak)
    base = ms[1] if len(ms) > 2 else ms[0]  # the first window pays warm-up (kernel compiles, allocator)
    return {
        "allocated_bytes": {"start": start, "peak": peak, "end": memory[-1],
                            "peak_first_window": first_peak, "peak_after_first_window": later_peak},
        "memory_growth_after_first_window": later_peak / first_peak if first_peak else None,
        "ms_per_op_windows": [round(x, 4) for x in ms],
        "slowdown_last_vs_second_window": ms[-1] / base if base else None,
        "window_ops": window,
    }


def write_markdown(path: Path, report: dict) -> None:
    """The soak's figures as markdown: settings and operation counts, then allocated bytes and ms/op per window."""
    st, a = report["settings"], report["allocated_bytes"]
    counts = ", ".join(f"{k} {v:,}" for k, v in report.get("op_counts", {}).items())
    head = common.md_header(
        "Soak: one TurboQuantCache through many mixed operations", report["meta"]["command"],
        f"device: {report['meta']['machine']['cuda_device'] or 'CPU'}; model {st['model']}, cache {st['preset']}, "
        f"batch {st['batch']}, {st['dtype']}", f"operations: {counts}" if counts else f"mode: {st['mode']}",
        f"allocated bytes: start {a['start']:,}, peak {a['peak']:,}, end {a['end']:,}; peak after the first window / "
        f"in it {report['memory_growth_after_first_window']:.2f}",
        f"last window's ms/op vs the second's: {report['slowdown_last_vs_second_window']:.2f}")
    table = common.markdown_table(["window (ops)", "ms/op"], [
        [f"{i * report['window_ops']}-{(i + 1) * report['window_ops']}", f"{ms:.2f}"]
        for i, ms in enumerate(report["ms_per_op_windows"])])
    path.write_text(head + "\n" + table, encoding="utf-8")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny shapes: intra-op threads only add hand-offs
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated() if args.device.startswith("cuda") else 0
    times, memory, extra = (soak_ops if args.mode == "ops" else soak_generate)(args)
    peak = torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else max(memory)
    report = {
        "meta": common.run_metadata("eval.soak", argv),
        "settings": {k: v for k, v in vars(args).items() if k != "dtype"} | {"dtype": str(args.dtype)},
        **summarize(times, memory, start, peak, args.window), **extra,
    }
    common.write_json(Path(args.out), report)
    write_markdown(Path(args.out).with_suffix(".md"), report)
    a = report["allocated_bytes"]
    print(f"soak {args.mode}: {len(times)} of {args.ops} ops on {args.device}; allocated start {a['start']} peak {a['peak']} "
          f"end {a['end']} bytes; later/first-window peak {report['memory_growth_after_first_window']:.3f}; "
          f"ms/op by window {report['ms_per_op_windows']}; slowdown {report['slowdown_last_vs_second_window']:.3f}")
    return report


if __name__ == "__main__":
    main()
