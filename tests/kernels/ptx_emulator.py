"""A tiny PTX emulator for the integer inline asm of tq_hf.kernels (not a test module).

Runs asm text of `mov/not/and/or/xor/shl/shr .b32`, `mov.u32`, `mul.lo.u32`, `mul.hi.u32` and `prmt.b32`
(default mode) on Python ints, so the CPU tests check the very text the GPU compiles. Operands: `$N`
placeholders, `.reg` names, decimal or hex immediates, `%laneid` (the `lane` run() is given).
"""

from __future__ import annotations

import re

MASK = 0xFFFFFFFF


def prmt(a: int, b: int, c: int) -> int:
    """PTX prmt.b32 default mode: 4 selector nibbles pick bytes of {b, a}; bit 3 = sign replicate."""
    pool = (b << 32) | a
    out = 0
    for k in range(4):
        sel = (c >> (4 * k)) & 0xF
        byte = (pool >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * k)
    return out


OPS = {
    "mov.b32": lambda a: a,
    "mov.u32": lambda a: a,
    "not.b32": lambda a: ~a & MASK,
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "xor.b32": lambda a, b: a ^ b,
    "shl.b32": lambda a, b: (a << min(b, 32)) & MASK,
    "shr.b32": lambda a, b: a >> min(b, 32),
    "mul.lo.u32": lambda a, b: (a * b) & MASK,
    "mul.hi.u32": lambda a, b: (a * b) >> 32,
    "prmt.b32": prmt,
}


def run(asm: str, inputs: dict[int, int], lane: int = 0) -> dict[int, int]:
    """Execute `asm` with $N = inputs[N] in lane `lane` of a warp; return every $N the asm writes."""
    if not 0 <= lane < 32:
        raise ValueError(f"lane must be 0..31, got {lane}")
    regs: dict[str, int] = {f"${n}": v & MASK for n, v in inputs.items()} | {"%laneid": lane}
    body = asm.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1]
    written = {}
    for stmt in filter(None, (s.strip() for s in body.split(";"))):
        if stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if op not in OPS:
            raise NotImplementedError(f"ptx_emulator: no {op!r}")
        dst, *srcs = [x.strip() for x in rest.split(",")]
        vals = [int(s, 0) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", s) else regs[s] for s in srcs]
        regs[dst] = OPS[op](*vals) & MASK
        if dst.startswith("$"):
            written[int(dst[1:])] = regs[dst]
    return written
