"""Where a decode kernel's instructions go, per compressed byte: the SASS of its tile loop, without a GPU.

Each preset's decode launch at a shape (B rows of S tokens, Hq/Hk/D) is planned as on an H200 and compiled for
sm_90a (eval.compile_check); nvdisasm (bundled with Triton) lists the machine code, and the loop with the most
tensor-core instructions is the walk over the pool's tiles. Its instructions are counted by class (the program's
instructions before the first loop and after the last beside them: what a short walk repeats per split), and
"thread-instructions per byte" = loop instructions x threads / the compressed bytes one loop iteration reads.
Occupancy: programs per SM as the registers, shared memory and warps allow (sm_90), and the launch's waves =
programs / (that x 132 SMs): 1.3 waves of equal programs run as two, the second a third full (where the plan adds
an exact program per KV head, those are short and the figure overstates). The H200 issues ~33 T thread-instructions/s (132 SMs x 4 schedulers x 32 lanes x 1.98 GHz) against ~4.2 TB/s,
about 8 per byte: a decoder above that is bound by issuing instructions, not by memory.

    python -m eval.sass_profile [--presets 4bit k8v4 k3v4 3bit] [--batch 16] [--length 32768] [--shapes 32/8/128]
    python -m eval.sass_profile --presets 3bit+defaults --batch 1 --launch "{'no vb': {'value_boundary': False}}"

The installed Triton compiles (the H200 image runs Triton 3.6; another version's code may differ). Writes
OUT/sass_profile.json and .md.
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .bench_kernels import exact_buffers, make_config, parse_shape
from .common import write_json

ISSUE_PER_BYTE = 132 * 4 * 32 * 1.98e9 / 4.2e12  # H200 thread-instructions per second over its bytes per second
CLASSES = [  # (class, opcode pattern), first match wins
    ("HMMA", r"HMMA"), ("LDG", r"LDG"), ("LDGSTS", r"LDGSTS|LDGDEPBAR|DEPBAR"), ("LDS", r"LDS"), ("STS", r"STS"),
    ("PRMT", r"PRMT"), ("LOP3/SHF", r"LOP3|SHF|SHL|SHR"), ("IMAD/IADD/LEA", r"IMAD|IADD|LEA"),
    ("FFMA/FMUL/FADD/FMNMX", r"FFMA|FMUL|FADD|FMNMX"), ("HFMA2/HADD2/HMUL2", r"HFMA2|HADD2|HMUL2"),
    ("conversions", r"I2F|F2F|F2I|I2I|F2FP"), ("MUFU", r"MUFU"), ("SHFL", r"SHFL"), ("BAR", r"BAR"),
    ("SETP/SEL", r"ISETP|FSETP|SEL|FSEL|PLOP3"),
]


# sm_90 (H100, H200) per SM: 64K registers allocated per warp in 256-register units, 228 KB of shared memory of which
# each block takes 1 KB for the system, 64 warps, 32 blocks (CUDA's occupancy calculator)
SM90 = {"registers": 65536, "register_unit": 256, "shared": 233472, "block_shared": 1024, "warps": 64, "blocks": 32,
        "sms": 132}


def programs_per_sm(registers: int, warps: int, shared_bytes: int, sm: dict = SM90) -> int:
    """Resident programs (CUDA blocks) per SM: the least of what the register file, shared memory, warp slots and
    block slots allow."""
    per_warp = -(-registers * 32 // sm["register_unit"]) * sm["register_unit"]
    return min(sm["registers"] // (per_warp * warps), sm["shared"] // (shared_bytes + sm["block_shared"]),
               sm["warps"] // warps, sm["blocks"])


@dataclass
class Instruction:
    address: int
    opcode: str
    operands: str


def parse_sass(text: str) -> tuple[list[Instruction], dict[str, int]]:
    """nvdisasm output -> (instructions, label -> address of the instruction it names)."""
    instructions, labels, pending = [], {}, []
    for line in text.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);", line)
        if m:
            address = int(m.group(1), 16)
            labels.update({name: address for name in pending})
            pending = []
            instructions.append(Instruction(address, m.group(2), m.group(3)))
    return instructions, labels


def loops(instructions: list[Instruction], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(start, branch) addresses of every backward branch: the loops of the listing."""
    found = []
    for ins in instructions:
        target = re.search(r"(\.L_x_\d+)", ins.operands) if ins.opcode.startswith("BRA") else None
        start = labels.get(target.group(1)) if target else None
        if start is not None and start < ins.address:
            found.append((start, ins.address))
    return found


def tile_loop(instructions: list[Instruction], labels: dict[str, int]) -> list[Instruction]:
    """The body of the backward branch whose loop holds the most HMMAs (then the most instructions)."""
    best: tuple[int, int, list[Instruction]] | None = None
    for start, end in loops(instructions, labels):
        body = [x for x in instructions if start <= x.address <= end]
        key = (sum(x.opcode.startswith("HMMA") for x in body), len(body))
        if best is None or key > best[:2]:
            best = (*key, body)
    return best[2] if best else []


def outside_loops(instructions: list[Instruction], labels: dict[str, int]) -> tuple[int, int]:
    """(instructions before the first loop, after the last): a program's fixed cost around its walks (the query's
    preparation; the epilogue's normalisation, rotation back and stores), which short walks (B=1 splits) repeat."""
    found = loops(instructions, labels)
    if not found:
        return len(instructions), 0
    first, last = min(start for start, _ in found), max(end for _, end in found)
    return sum(x.address < first for x in instructions), sum(x.address > last for x in instructions)


def classify(body: list[Instruction]) -> collections.Counter:
    counts = collections.Counter()
    for ins in body:
        counts[next((name for name, pattern in CLASSES if re.match(pattern, ins.opcode)), "other")] += 1
    return counts


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def disassemble(cubin: bytes) -> tuple[str, int]:
    """(nvdisasm's listing, registers per thread) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    return text, int(regs.group(1)) if regs else -1


# name -> LaunchConfig overrides
VARIANTS = {"default": {}, "key_lut": {"key_lut": True}, "plane_words": {"value_planes_asm": False},
            "table_constants": {"table_registers": False}}


def decode_launch(preset: str, batch: int, length: int, shape: tuple[int, int, int], variant: str | dict = "default"):
    """(kernel, args, kwargs, layout, plan) of one decode step's attention launch, planned as on an H200 with the
    launch overrides VARIANTS[variant], or a dict of them (LaunchConfig fields, and num_splits)."""
    from tq_hf.kernels import LaunchConfig, attention, plan_attention
    from tq_hf.kernels.device import H200
    from tq_hf.layout import BlockLayout

    hq, hk, d = shape
    cfg = make_config(preset)
    layout = BlockLayout(cfg, hk, d)
    pool = layout.allocate(4, "cpu")
    table = torch.zeros(batch, -(-length // layout.block_size), dtype=torch.int32)
    seq = torch.full((batch,), length, dtype=torch.int32)
    query = torch.randn(batch, hq, 1, d, dtype=torch.float16)
    # the exact prefix and the ring as the cache keeps them (int8 records for the codebook presets)
    extra = exact_buffers(layout, batch, cfg.exact_prefix_tokens, cfg.recent_window, device="cpu")
    if cfg.key_centering:
        extra["key_offset"] = torch.randn(hk, d)
    overrides = dict(VARIANTS[variant] if isinstance(variant, str) else variant)
    num_splits = overrides.pop("num_splits", None)
    planned = {k: v for k, v in extra.items() if k != "recent_from"}  # (a launch argument, not a plan's)
    plan = plan_attention(query, pool, layout, table, seq, d ** -0.5, max_seq_len=length, device_traits=H200,
                          launch=LaunchConfig(**overrides) if overrides else None, num_splits=num_splits, **planned)
    args, _, _ = attention.kernel_arguments(plan, query, pool, table, seq, torch.empty_like(query), **extra)
    return plan.kernel, args, {**plan.constants, "BLOCK_N": plan.block_n, "num_stages": plan.num_stages}, layout, plan


def profile(preset: str, batch: int, length: int, shape: tuple[int, int, int], arch: int = 90,
            variant: str = "default", overrides: dict | None = None) -> dict:
    """The tile loop of `preset`'s decode launch: instruction classes and opcodes, per compressed byte, registers,
    shared memory. overrides: the launch's (named `variant`) instead of VARIANTS[variant]."""
    from .compile_check import compile_only, compile_variant

    with compile_only(arch):
        fn, args, kwargs, layout, plan = decode_launch(preset, batch, length, shape,
                                                       variant if overrides is None else overrides)
        kernel = compile_variant(fn, args, kwargs, arch)
    text, regs = disassemble(kernel.asm["cubin"])
    instructions, labels = parse_sass(text)
    body = tile_loop(instructions, labels)
    before, after = outside_loops(instructions, labels)
    heads = kwargs.get("HEADS_PER_PROGRAM", 1)
    tile_bytes = plan.block_n * heads * layout.plane_bytes // layout.block_size
    threads = kwargs.get("num_warps", 4) * 32
    resident = programs_per_sm(regs, threads // 32, kernel.metadata.shared)
    programs = plan.grid[0] * plan.grid[1] * plan.grid[2]
    return {"preset": preset, "shape": "/".join(map(str, shape)), "variant": variant, "kernel": fn.__name__, "block_n": plan.block_n, "heads_per_program": heads,
            "warps": threads // 32, "registers": regs, "shared_bytes": kernel.metadata.shared,
            "ring": ("int8 records" if kwargs.get("RING_Q8") else "exact") if kwargs.get("HAS_RECENT") else None,
            "loop_instructions": len(body), "before_loops": before, "after_loops": after, "tile_bytes": tile_bytes,
            "thread_instructions_per_byte": len(body) * threads / tile_bytes if tile_bytes else None,
            "programs": programs, "programs_per_sm": resident, "waves": programs / (resident * SM90["sms"]),
            "classes": dict(classify(body).most_common()),
            "opcodes": dict(collections.Counter(i.opcode for i in body).most_common())}


def store_launch(preset: str, batch: int, shape: tuple[int, int, int], launch=None):
    """(kernel, args, kwargs) of one decode step's store (a token per row, `batch` rows, the ring and lengths written
    as the cache writes them), planned as on an H200 (launch: a StoreLaunchConfig); call inside
    compile_check.compile_only."""
    from tq_hf.kernels import store, store_kv
    from tq_hf.layout import BlockLayout

    from .compile_check import captured_launches

    _, hk, d = shape
    cfg = make_config(preset)
    layout = BlockLayout(cfg, hk, d)
    key, value = (torch.randn(batch, hk, d, dtype=torch.float16) for _ in range(2))
    ring = exact_buffers(layout, batch, 0, cfg.recent_window, device="cpu")
    kwargs = {"key_offset": torch.randn(hk, d) if cfg.key_centering else None}
    if "recent_keys" in ring:
        kwargs.update(recent=(ring["recent_keys"], ring["recent_values"]),
                      seq_lens=torch.zeros(batch, dtype=torch.int32), start=100)
    kernel = store._store_kernel
    with captured_launches() as seen:
        store_kv(layout.allocate(batch + 1, "cpu"), layout, key, value, torch.arange(batch), launch=launch, **kwargs)
    return (kernel, *seen["store"])


STORE_VARIANTS = {"default": {}, "built_rotations": {"rotation_units": False}}  # name -> StoreLaunchConfig fields


def store_profile(preset: str, batch: int, shape: tuple[int, int, int], arch: int = 90,
                  variant: str = "default") -> dict:
    """The decode store's machine code: instructions, barriers, tensor-core instructions, registers (one short chain
    per program: its instruction count measures its latency, where a walk's loop measures its throughput)."""
    from tq_hf.kernels import StoreLaunchConfig

    from .compile_check import compile_only, compile_variant

    with compile_only(arch):
        kernel = compile_variant(*store_launch(preset, batch, shape, StoreLaunchConfig(**STORE_VARIANTS[variant])), arch)
    text, regs = disassemble(kernel.asm["cubin"])
    instructions, _ = parse_sass(text)
    count = lambda prefix: sum(x.opcode.startswith(prefix) for x in instructions)  # noqa: E731
    return {"preset": preset, "shape": "/".join(map(str, shape)), "variant": variant, "batch": batch,
            "instructions": len(instructions),
            "barriers": count("BAR"), "hmma": count("HMMA"), "registers": regs, "shared_bytes": kernel.metadata.shared}


def markdown(report: dict) -> str:
    rows = report["rows"]
    classes = [name for name, _ in CLASSES if any(name in r["classes"] for r in rows)] + ["other"]
    lines = [f"# Decode tile loop, sm_{report['arch']} SASS (no GPU)", "", f"Command: `{report['command']}`  ",
             f"Triton {report['triton']}; B={report['batch']}, S={report['length']}; the H200 issues "
             f"~{ISSUE_PER_BYTE:.1f} thread-instructions per byte it streams", "",
             "| Hq/Hk/D | preset | launch | kernel | BLOCK_N x heads | warps | registers | shared B | programs (per SM, "
             "waves) | loop instr. | before / after the loops | bytes per tile | thread-instr. per byte | "
             + " | ".join(classes) + " |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(classes)]
    for r in rows:
        per_byte = r["thread_instructions_per_byte"]
        lines.append(f"| {r['shape']} | {r['preset']} | {r.get('variant', 'default')} | {r['kernel']} | {r['block_n']} x {r['heads_per_program']} | {r['warps']} | "
                     f"{r['registers']} | {r['shared_bytes']} | {_occupancy(r)} | {r['loop_instructions']} | "
                     f"{r.get('before_loops', '-')} / {r.get('after_loops', '-')} | {r['tile_bytes']} | "
                     f"{per_byte:.1f} | " + " | ".join(str(r["classes"].get(c, 0)) for c in classes) + " |")
    if report.get("store"):
        lines += ["", f"Decode store (one token per row, B={report['batch']}): the whole kernel", "",
                  "| Hq/Hk/D | preset | launch | instructions | barriers | HMMA | registers | shared B |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['preset']} | {r['variant']} | {r['instructions']} | {r['barriers']} | {r['hmma']} | "
                  f"{r['registers']} | {r['shared_bytes']} |" for r in report["store"]]
    return "\n".join(lines) + "\n"


def _occupancy(row: dict) -> str:
    if "programs" not in row:
        return "-"
    return f"{row['programs']} ({row['programs_per_sm']}, {row['waves']:.2f})"


def main(argv: list[str] | None = None) -> dict:
    import triton

    ap = argparse.ArgumentParser(prog="python -m eval.sass_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["4bit", "4bit+defaults", "k8v4", "k8v4+defaults", "k3v4",
                                                     "k3v4+defaults", "3bit", "3bit+defaults"],
                    help="preset names as eval.bench_kernels takes them (+defaults: every lever on)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--shapes", type=parse_shape, nargs="+", default=[(32, 8, 128), (32, 8, 64), (8, 4, 256)],
                    help="Hq/Hk/D head shapes")
    ap.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS),
                    help="launch overrides to profile beside the default plan (key_lut: 4-bit and 3-bit-plane keys by "
                         "byte permutes at every head_dim; plane_words: 3-bit value planes through 16-bit plane words "
                         "instead of from their loaded bytes; table_constants: the key lookups' table words as "
                         "constants instead of pinned in registers)")
    ap.add_argument("--launch", type=ast.literal_eval, default={},
                    help="more variants, named: a Python dict literal {name: {LaunchConfig field: value, ...}} (and "
                         "num_splits), e.g. \"{'no vb': {'value_boundary': False}, 'n48': {'maxnreg': 168, "
                         "'num_splits': 48}}\"")
    ap.add_argument("--store", action="store_true", help="also the decode store kernel of each preset and shape, "
                    "as planned (the rotations read as fp16 units) and with the rotations built in registers "
                    "(StoreLaunchConfig(rotation_units=False))")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--out", default="eval/results/sass_profile")
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not (isinstance(args.launch, dict) and all(isinstance(v, dict) for v in args.launch.values())):
        ap.error(f"--launch takes a dict literal {{name: {{field: value}}}}, got {args.launch!r}")
    variants = {**{v: None for v in args.variants}, **args.launch}
    report = {"command": "python -m eval.sass_profile " + " ".join(argv), "triton": triton.__version__,
              "arch": args.arch, "batch": args.batch, "length": args.length,
              "rows": [profile(p, args.batch, args.length, shape, args.arch, v, overrides)
                       for shape in args.shapes for p in args.presets for v, overrides in variants.items()]}
    if args.store:
        report["store"] = [store_profile(p, args.batch, shape, args.arch, v) for shape in args.shapes
                           for p in args.presets for v in STORE_VARIANTS]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", report)
    (out / "table.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
