"""Host time of one decode layer step on the kernel path, measurable without a GPU.

At B=1 a decode step is bound by the host (on an H200 the attention kernel takes ~0.03 ms, the cache's update and
the "turboquant" attention ~0.4 ms of host time per layer under cProfile).
This times what our Python and the step's tensor ops cost: `TurboQuantCache.update` (store) plus
`turboquant_attention_forward` (attention + split reduction) for one layer, with every Triton launch stubbed and
the tensors on the CPU. It is not a GPU figure (there each tensor op and launch also pays the driver; profile
generate() on the device for that) but it moves with the host-side code, so host-side changes can be compared here, side by side in one run.

    python -m eval.host_overhead --presets 4bit,k8v4 --batch 1 --steps 2000 --out eval/results/host_overhead

The comparison row "fp16 sdpa" times what transformers' own decode step does at the same shapes: a DynamicCache
update plus `sdpa_attention_forward`, with its two heavy ops stubbed the same way (torch.cat returns a view of a
preallocated buffer of the concatenated shape, sdpa an empty output), so both rows count the Python and the small
tensor ops a GPU host pays, not CPU memory traffic or math. A stubbed op costs a view here, less than the CUDA
launch it stands for, so the fp16 figure errs low (the ratio errs against TurboQuant).
The compressed pool is reserved for every timed step up front: its geometric growth (an allocation and a prefix copy
every 1/16 of the capacity) is device work on a GPU but CPU memory traffic here.

Prints a table (us per layer step: the median and the best of --rounds, each with its ratio to the fp16 sdpa row;
the device ops of one step: torch ops that are not views, plus Triton launches, each a launch on a GPU's host)
and writes OUT/results.json and OUT/table.md; --profile prints the top functions of one more round.

--queries Q times forwards of Q new tokens per layer (5-10: a verification forward of speculative decoding, each
followed by the crop of one token that assisted decoding makes). Their tensor ops do real work on the CPU (the
ring's W tokens decoded), so there the device-op count is the figure that carries over to a GPU host, not the time.

--generate-layers N adds the whole eager generate() step of a model of N such layers (Llama, hidden size 64, so the
projections are small), every heavy op stubbed alike for both caches (the projections give zeros, sdpa zeros, the
DynamicLayer's torch.cat a view, Triton launches nothing): ms per generated token, the difference between
generating 2T and T tokens over T (--generate-tokens), so the prefill and generate()'s setup drop out. It counts
everything a GPU host runs per token in Python and small tensor ops (the model's norms and rotary embedding, the
mask, generate()'s own loop), but no kernel launch's driver time.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .common import markdown_table, md_header, run_metadata, write_json

DENSE = "fp16 sdpa"  # the comparison row: DynamicCache + transformers' sdpa attention
HEADS = (32, 8, 128)  # query heads, KV heads, head_dim (Llama-3-8B's)


LAUNCHES = [0]  # Triton launches stubbed so far (stubbed_launches counts them)


class _DeviceOps(TorchDispatchMode):
    """Counts the torch ops that would launch work on a GPU: all but views (ops returning an alias of an input
    without mutating it)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        if not (schema.returns and schema.returns[0].alias_info is not None and not schema.is_mutable):
            self.count += 1
        return func(*args, **(kwargs or {}))


def device_ops(step) -> int:
    """Torch ops that are not views, plus Triton launches (under stubbed_launches), of one call of `step`."""
    before = LAUNCHES[0]
    with _DeviceOps() as counter:
        step()
    return counter.count + LAUNCHES[0] - before


@contextlib.contextmanager
def stubbed_launches():
    """The kernel path on CPU tensors as on an H200 (its launch choices), every launch a no-op; restored after."""
    from tq_hf import ops
    from tq_hf.kernels import attention, device, fast_launch

    cpu = torch.device("cpu")
    patches = [
        (ops, "use_kernels", lambda t: True),
        (fast_launch.LaunchSite, "__call__", lambda self, *args: LAUNCHES.__setitem__(0, LAUNCHES[0] + 1)),
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


@contextlib.contextmanager
def stubbed_dense_ops(whole_model: bool = False):
    """The fp16 sdpa row's heavy ops without their work (restored after): torch.cat (DynamicLayer.update's append)
    returns a view of a preallocated buffer of the concatenated shape, and torch's sdpa an empty output.
    whole_model: for a model's forward, which reads them: sdpa gives zeros, and torch.cat is real for anything but
    4-D floating tensors (generate()'s token ids)."""
    functional = torch.nn.functional
    saved = (torch.cat, functional.scaled_dot_product_attention)
    buffers: dict[tuple, torch.Tensor] = {}
    real_cat = torch.cat

    def cat_view(tensors, dim=0):
        tensors = [t for t in tensors if t.shape != (0,)]  # torch.cat skips 1-D empties (an empty DynamicLayer's)
        first = tensors[0]
        if whole_model and (first.dim() != 4 or not first.is_floating_point()):
            return real_cat(tensors, dim)
        dim %= first.dim()
        length = sum(t.shape[dim] for t in tensors)
        key = (first.dtype, first.device, tuple(first.shape[:dim]), tuple(first.shape[dim + 1:]))
        buf = buffers.get(key)
        if buf is None or buf.shape[dim] < length:
            shape = list(first.shape)
            shape[dim] = length + max(length // 4, 64)  # room for the steps to come
            buf = buffers[key] = first.new_empty(shape)
        return buf.narrow(dim, 0, length)

    def sdpa_empty(query, key, value, *args, **kwargs):
        if whole_model:
            return query.new_zeros(*query.shape[:-1], value.shape[-1])
        return query.new_empty(*query.shape[:-1], value.shape[-1])

    try:
        torch.cat, functional.scaled_dot_product_attention = cat_view, sdpa_empty
        yield
    finally:
        torch.cat, functional.scaled_dot_product_attention = saved


@contextlib.contextmanager
def stubbed_model_ops():
    """A whole model's heavy ops without their work, for both caches (restored after): the projections (F.linear)
    give zeros of their output's shape, as the dense ops' stubs do for torch.cat and sdpa."""
    functional = torch.nn.functional
    saved = functional.linear
    try:
        functional.linear = lambda x, weight, bias=None: x.new_zeros(*x.shape[:-1], weight.shape[0])
        with stubbed_dense_ops(whole_model=True):
            yield
    finally:
        functional.linear = saved


def generate_timer(cache_name: str, layers: int, context: int, heads: tuple[int, int, int] = HEADS):
    """A callable n -> seconds of an eager greedy generate() of n new tokens (B=1) over a prompt of `context` tokens
    already in a fresh cache ("fp16 sdpa": a DynamicCache, else a TurboQuantCache preset). Call under stubbed_model_ops
    (and stubbed_launches for a preset)."""
    import tq_hf  # noqa: F401  (registers the attention function)
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    from tq_hf.demo import cache_kwarg

    hq, hk, d = heads
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=hq, num_key_value_heads=hk, head_dim=d,
                      num_hidden_layers=layers, intermediate_size=64, vocab_size=256,
                      max_position_embeddings=2 * context + 4096)
    model = LlamaForCausalLM(cfg).to(torch.float16).eval()
    model.set_attn_implementation("sdpa" if cache_name == DENSE else "turboquant")
    ids = torch.randint(0, cfg.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(0))

    @torch.no_grad()
    def run(n: int) -> float:
        cache = DynamicCache(config=cfg) if cache_name == DENSE else tq_hf.TurboQuantCache(cfg, preset=cache_name)
        model.generate(ids[:, :context], max_new_tokens=1, do_sample=False, **cache_kwarg(model, cache))  # prefill
        for layer in cache.layers:  # the pool's growth is device work on a GPU, CPU memory traffic here
            if hasattr(layer, "_reserve"):
                layer._reserve(context + n + 8)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **cache_kwarg(model, cache))
        return time.perf_counter() - start
    return run


def _model_config(heads: tuple[int, int, int], attention: str):
    from transformers import LlamaConfig

    hq, hk, d = heads
    cfg = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hk, head_dim=d,
                      num_hidden_layers=1, intermediate_size=64, vocab_size=64)
    cfg._attn_implementation = attention
    return cfg


def _attention_module(heads: tuple[int, int, int]) -> torch.nn.Module:
    """What the attention functions read from a model's attention module."""
    module = torch.nn.Module()
    module.is_causal = True
    module.num_key_value_groups = heads[0] // heads[1]
    return module


def _step_over(cache, attention, batch: int, context: int, heads: tuple[int, int, int], queries: int = 1):
    """Prefill `cache` (one layer) with `context` random fp16 tokens; a callable step of `queries` new tokens (1: a
    decode step; a few: a verification forward of speculative decoding): cache.update, then `attention` (a
    transformers attention function; after several tokens, the crop of the last one that assisted decoding makes
    after every verification, so the steps stay verification forwards over the cache's own history)."""
    hq, hk, d = heads
    cache.update(torch.randn(batch, hk, context, d, dtype=torch.float16),
                 torch.randn(batch, hk, context, d, dtype=torch.float16), 0)
    q, k, v = (torch.randn(batch, h, queries, d, dtype=torch.float16) for h in (hq, hk, hk))
    module = _attention_module(heads)

    def step():
        keys, values = cache.update(k, v, 0)
        attention(module, q, keys, values, None, scaling=d**-0.5)
        if queries > 1:
            cache.crop(-1)
    return step


def layer_step(preset: str, batch: int, context: int, heads: tuple[int, int, int] = HEADS, headroom: int = 0,
               queries: int = 1):
    """A one-layer TurboQuantCache of `context` tokens (stored by the reference) and a callable decode step.
    headroom: decode tokens to reserve pool room for now, so the timed steps never grow it."""
    import tq_hf  # noqa: F401  (registers the attention function)
    from tq_hf.attention import turboquant_attention_forward

    cache = tq_hf.TurboQuantCache(_model_config(heads, "turboquant"), preset=preset)
    step = _step_over(cache, turboquant_attention_forward, batch, context, heads, queries)
    if headroom:
        cache.layers[0]._reserve(context + headroom * queries)  # (a harness reaching in: no public way to reserve)
    return step


def dense_layer_step(batch: int, context: int, heads: tuple[int, int, int] = HEADS, queries: int = 1):
    """The same decode step as transformers runs it with an fp16 DynamicCache and attn_implementation="sdpa"
    (time it under stubbed_dense_ops)."""
    from transformers import DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return _step_over(DynamicCache(config=_model_config(heads, "sdpa")), sdpa_attention_forward, batch, context, heads,
                      queries)


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
    ap.add_argument("--queries", type=int, default=1,
                    help="new tokens per layer step (1: a decode step; 5-10: a verification forward)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="print the top functions of one more round")
    ap.add_argument("--generate-layers", type=int, default=0,
                    help="also time the whole eager generate() step of a model of this many layers (0: not)")
    ap.add_argument("--generate-tokens", type=int, default=32, help="T: tokens per timed generate() (2T and T)")
    ap.add_argument("--out", default="eval/results/host_overhead")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    load = os.getloadavg()[0]  # other work on a shared machine slows every row
    torch.set_num_threads(1)  # steadier figures; restored below
    try:
        rows = _measure(args)
        generate_rows = _measure_generate(args) if args.generate_layers else []
    finally:
        torch.set_num_threads(threads)
    report = {"meta": run_metadata("eval.host_overhead", argv), "load_average": load, "rows": rows,
              "generate_rows": generate_rows}
    print(write_outputs(Path(args.out), report))
    return report


def write_outputs(out: Path, report: dict) -> str:
    """OUT/results.json and OUT/table.md (the command at its top); returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", report)
    # the best round too: on a shared machine other work only adds time, so the minimum is the steadier figure
    table = markdown_table(["preset", "B", "context", "new tokens", "device ops", "us per layer step (median)",
                            f"x {DENSE}", "best round", f"best x {DENSE}", "rounds"],
                           [[r["preset"], r["batch"], r["context"], r.get("queries", 1), r.get("device_ops", "-"),
                             f"{r['us_per_layer_step']:.1f}",
                             f"{r['vs_dense']:.2f}", f"{r['best_us']:.1f}", f"{r['best_vs_dense']:.2f}",
                             " / ".join(f"{x:.1f}" for x in r["rounds_us"])] for r in report["rows"]])
    head = md_header("Host time of one layer step (Triton launches stubbed, CPU tensors)",
                     report["meta"]["command"], f"CPU: {report['meta']['machine']['platform']}, 1 torch thread",
                     f"load average {report['load_average']:.1f} at the start (of {os.cpu_count()} CPUs)")
    if report.get("generate_rows"):
        r0 = report["generate_rows"][0]
        table += (f"\n\n### The whole eager generate() step: {r0['layers']} layers, B=1, context {r0['context']}, every "
                  f"heavy op stubbed\n\n") + markdown_table(
            ["cache", "ms per token (median)", f"x {DENSE}", "best round", f"best x {DENSE}", "rounds"],
            [[r["preset"], f"{r['ms_per_token']:.3f}", f"{r['vs_dense']:.2f}", f"{r['best_ms']:.3f}",
              f"{r['best_vs_dense']:.2f}", " / ".join(f"{x:.3f}" for x in r["rounds_ms"])]
             for r in report["generate_rows"]])
    (out / "table.md").write_text(head + "\n" + table + "\n")
    return table


WARMUP_STEPS = 20  # plans made, caches warm


def _measure(args) -> list[dict]:
    """The fp16 sdpa row, then one row per preset: the median over --rounds of the mean us per decode layer step.
    Rounds alternate between the rows, so a change of load on a shared machine hits every row alike."""
    headroom = WARMUP_STEPS + args.steps * (args.rounds + args.profile)
    steps = {DENSE: (dense_layer_step(args.batch, args.context, queries=args.queries), stubbed_dense_ops)}
    for preset in args.presets.split(","):
        steps[preset] = (layer_step(preset, args.batch, args.context, headroom=headroom, queries=args.queries),
                         stubbed_launches)
    per_round: dict[str, list[float]] = {name: [] for name in steps}
    for first in [True] + [False] * (args.rounds - 1):
        for name, (step, stubs) in steps.items():
            with stubs():
                for _ in range(WARMUP_STEPS if first else 0):
                    step()
                per_round[name].append(time_steps(step, args.steps))
    ops = {}
    for name, (step, stubs) in steps.items():
        with stubs():
            ops[name] = device_ops(step)
    if args.profile:
        for name, (step, stubs) in steps.items():
            with stubs():
                prof = cProfile.Profile()
                prof.runcall(time_steps, step, args.steps)
            print(f"== {name}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    dense, dense_best = statistics.median(per_round[DENSE]), min(per_round[DENSE])
    return [{"preset": name, "batch": args.batch, "context": args.context, "queries": args.queries,
             "steps": args.steps,
             "us_per_layer_step": statistics.median(rounds), "vs_dense": statistics.median(rounds) / dense,
             "best_us": min(rounds), "best_vs_dense": min(rounds) / dense_best, "rounds_us": rounds,
             "device_ops": ops[name]} for name, rounds in per_round.items()]


def _measure_generate(args) -> list[dict]:
    """The whole-step rows: fp16 sdpa, then each preset; per round (alternating) the marginal ms per token."""
    names = [DENSE] + args.presets.split(",")
    timers = {name: generate_timer(name, args.generate_layers, args.context) for name in names}
    t = args.generate_tokens
    per_round: dict[str, list[float]] = {name: [] for name in names}
    for first in [True] + [False] * (args.rounds - 1):
        for name in names:
            with stubbed_model_ops(), (stubbed_launches() if name != DENSE else contextlib.nullcontext()):
                if first:
                    timers[name](2)  # plans made, caches warm
                per_round[name].append(1e3 * (timers[name](2 * t) - timers[name](t)) / t)
    dense, dense_best = statistics.median(per_round[DENSE]), min(per_round[DENSE])
    return [{"preset": name, "layers": args.generate_layers, "context": args.context, "tokens": t,
             "ms_per_token": statistics.median(r), "vs_dense": statistics.median(r) / dense, "best_ms": min(r),
             "best_vs_dense": min(r) / dense_best, "rounds_ms": r} for name, r in per_round.items()]


if __name__ == "__main__":
    main()
