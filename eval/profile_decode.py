"""Profile one decode attention launch over the compressed pool (what limits the kernel).

Builds a pool of B rows x S random tokens (the bench's shapes, with the exact prefix and ring as the cache hands
them for "+defaults" presets), launches the attention a few times, and prints what the compiled kernel uses
(registers, spills, shared memory) and the SASS instruction mix of its variants. --kernel-times N: each kernel's
device time per decode call (the attention and the split reduction), averaged over N calls under torch.profiler,
beside fp16 SDPA's over dense K/V of the same shapes. Run it under Nsight Compute to read the hardware counters:

    ncu --clock-control none --set full -k 'regex:_attn_kernel|_warp_kernel' --launch-skip 2 --launch-count 1 -o r \
        python -m eval.profile_decode --preset 4bit --batch 16 --length 32768 [--launch "{'bt_next': False}"]
    ncu --import r.ncu-rep --page source --csv --print-source sass > r.csv
    python -m eval.profile_decode --stalls r.csv     # where the warps wait: by reason, opcode, instruction
"""

from __future__ import annotations

import argparse
import ast
import collections
import csv
import math
import re
import subprocess
import tempfile
from pathlib import Path

import torch


def sass_mix(cubin: bytes, top: int = 25) -> list[tuple[str, int]]:
    """Static count of SASS opcodes (without modifiers) in a cubin, most frequent first."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run(["cuobjdump", "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops.most_common(top)


def describe_compiled(kernel) -> None:
    """Registers, spills, shared memory and SASS mix of every compiled variant of `kernel`."""
    for cache in getattr(kernel, "device_caches", {}).values():
        for compiled in cache[0].values():
            meta = compiled.metadata
            print(f"variant: regs {compiled.n_regs}, spills {compiled.n_spills}, shared {meta.shared} B, "
                  f"warps {meta.num_warps}, stages {meta.num_stages}")
            try:
                print("  SASS mix:", ", ".join(f"{op} {n}" for op, n in sass_mix(compiled.asm["cubin"])))
            except (OSError, subprocess.CalledProcessError, KeyError) as exc:
                print(f"  SASS mix unavailable: {exc}")


def kernel_times(call, calls: int) -> dict:
    """eval.decode_loop.kernel_profile of `calls` runs of `call` (per call: device kernels, their launches and time;
    the host's ops) under torch.profiler, after 3 warm-up calls."""
    from torch.profiler import ProfilerActivity, profile

    from eval.decode_loop import kernel_profile

    cuda = torch.cuda.is_available()
    for _ in range(3):
        call()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(calls):
            call()
        if cuda:
            torch.cuda.synchronize()
    return kernel_profile(prof.events(), calls)


def stall_summary(csv_path: str, top: int = 12) -> None:
    """Print Nsight Compute's warp-stall samples of a `--page source --print-source sass --csv` export:
    per stall reason, per opcode (with the executed share) and the instructions that collect the most."""
    rows = list(csv.reader(open(csv_path)))
    header = next(r for r in rows if r and r[0] == "Address")
    data = [r for r in rows[rows.index(header) + 1:] if len(r) == len(header)]
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples, executed = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"]

    def num(r, i):
        return int(r[i] or 0)

    total = sum(num(r, samples) for r in data) or 1
    total_exec = sum(num(r, executed) for r in data) or 1
    print(f"{total} stall samples")
    by_reason = collections.Counter({h: sum(num(r, col[h]) for r in data) for h in reasons})
    for h, v in by_reason.most_common():
        if v:
            print(f"  {h:24s} {100 * v / total:5.1f}%")
    by_op, exec_op = collections.Counter(), collections.Counter()
    for r in data:
        m = re.match(r"\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", r[col["Source"]])
        op = m.group(1) if m else "?"
        by_op[op] += num(r, samples)
        exec_op[op] += num(r, executed)
    print("opcode: share of stall samples / of executed instructions")
    for op, v in by_op.most_common(top):
        print(f"  {op:8s} {100 * v / total:5.1f}% / {100 * exec_op[op] / total_exec:5.1f}%")
    print("instructions with the most samples (top reasons)")
    for r in sorted(data, key=lambda r: -num(r, samples))[:top]:
        why = sorted(((num(r, col[h]), h[6:]) for h in reasons), reverse=True)[:2]
        print(f"  {r[0][-6:]} {100 * num(r, samples) / total:5.1f}% {r[col['Source']].strip()[:56]:56s} {why}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m eval.profile_decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="4bit")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--heads", default="32,8,128", help="Hq,Hk,D")
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--launch", default="{}", help="unified_attention's LaunchConfig fields, a Python dict literal")
    ap.add_argument("--stalls", metavar="CSV", help="summarise an ncu source-page SASS export instead")
    ap.add_argument("--kernel-times", type=int, default=0, metavar="N",
                    help="each kernel's device time per call over N profiled calls, beside fp16 SDPA's (0: off)")
    args = ap.parse_args(argv)
    if args.stalls:
        stall_summary(args.stalls)
        return
    from eval.bench_kernels import _fill_pool, _key_offset, forward_buffers, make_config
    from tq_hf.kernels import LaunchConfig, unified_attention
    from tq_hf.kernels.decode_warps import _warp_kernel
    from tq_hf.kernels.unified import _attn_kernel
    from tq_hf.layout import BlockLayout

    hq, hk, d = (int(x) for x in args.heads.split(","))
    b, s = args.batch, args.length
    layout = BlockLayout(make_config(args.preset), hk, d)
    mu = _key_offset(layout)
    pool, table = _fill_pool(layout, b, s, key_offset=mu)
    seq = torch.full((b,), s, device="cuda", dtype=torch.int32)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    extra = forward_buffers(layout, b, 1)  # +defaults: the exact prefix and ring

    def call():
        unified_attention(q, pool, layout, table, seq, 1 / math.sqrt(d), max_seq_len=s, out=out, key_offset=mu,
                          launch=LaunchConfig(**ast.literal_eval(args.launch)), **extra)

    for _ in range(args.launches):
        call()
    torch.cuda.synchronize()
    print(f"{args.preset} B={b} S={s} {hq}/{hk}/{d}: compressed bytes {b * hk * s * layout.config.token_head_bytes(d) / 1e9:.3f} GB")
    if args.kernel_times:
        k, v = (torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16) for _ in range(2))
        sdpa = kernel_times(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                            args.kernel_times)
        del k, v
        times = kernel_times(call, args.kernel_times)
        total, fp16 = 1e3 * times["busy_ms_per_step"], 1e3 * sdpa["busy_ms_per_step"]
        print(f"device us per call ({args.kernel_times} calls): {total:.1f}, fp16 SDPA {fp16:.1f} "
              f"({total / fp16:.2f}x)")
        for kernel in times["top"]:
            print(f"  {kernel['us_per_call'] * kernel['per_step']:8.2f} us  {kernel['per_step']:g}x  {kernel['kernel']}")
    for kernel in (_attn_kernel, _warp_kernel):  # whichever the launcher picked (plain 4bit at large batch: one-warp)
        describe_compiled(kernel)


if __name__ == "__main__":
    main()
