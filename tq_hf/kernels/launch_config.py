"""Overrides of the launchers' heuristics, for benchmarks and tests: typed, validated values.

Every field defaults to None: the launcher's heuristic decides. Setting any field other than warp_split keeps
the unified kernel (the overrides are its variants), unless warp_split=True asks for decode_warps' kernel.
"""

from __future__ import annotations

import dataclasses

NO_REGISTER_CAP = 0  # maxnreg value: no cap (ptxas's own, up to 255 registers per thread)
RING_TILES = (16, 32, 64, 128)  # recent-window tile sizes, tokens
HEADS_PER_PROGRAM = (1, 2)
WARPS = (1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """block_m: query rows per program tile; block_n: KV tokens per tile; num_warps, num_stages (software
    pipeline depth on a GPU); maxnreg: register cap per thread (NO_REGISTER_CAP: none).
    key_lut: codebook keys (4-bit, 3-bit planes or bit stream) decoded by byte permutes (False: centroids gathered).
    value_words: 4-bit value codes as 16-bit words into 4 accumulators (else bytes into 2).
    exact_program: split decode attends the exact prefix and ring in a program of its own; ring_spread: split
    decode shares the ring's tiles out over all its programs (else one walks them all); ring_programs: split decode
    gives each of the ring's tiles an exact program of its own beside the pool's splits, which then walk no ring tile
    (the ring's latency beside the walks instead of after them; needs the exact program).
    meta_pairs: per-token metadata loaded as 32-bit words of two tokens; meta_words: else each token's fields
    from its pair's 32-bit word; vmid_chain: v_mid's load joins the value MMA operand (so it is prefetched);
    bt_next: the walk's block-table entries loaded an iteration ahead; pool32: int32 pool offsets (False:
    int64, as pools of >= 2**31 bytes take); key_words: 4-bit keys as 16-bit code words; head_pairs: KV heads
    per decode program (1 or 2: 2 by default for 4-bit code words at head_dim 128 and for k3v4's 3-bit key planes with
    its levers; 3bit's planes take 2 only when asked); ring_n: recent-window tile (16, 32, 64 or 128 tokens);
    warp_split: decode_warps' one-warp programs (True/False; block_n, num_stages and maxnreg apply to it too).
    rotate_in_reduce: split launches of value-rotated formats leave the partials in the rotated space and the
    reduction rotates each merged row back (else every split program rotates its rows); no effect elsewhere.
    rotation_16bit: the rotation back of 4-bit (or plane) values under rotation="hadamard" by 16-bit dots of Rv's
    +-1 entries, each row split in two fp16 parts (else 3xTF32 dots). query_butterfly: 3-bit key planes at head_dim
    128 take the query rotated once (a butterfly, then H_64 in registers) and cut into the planes' windows (else
    each window's coordinates rotated apart); at head_dim 256 (3-bit planes or 4-bit keys) two butterflies, then
    H_64 for each quarter (else the windows apart, or H_128 for each half). value_planes_asm: 3-bit value planes
    decoded straight from their loaded bytes by one asm, 4 elements per instance (else each token's 16-bit plane
    word built by Triton's integer ops first). planes_in_place: 3-bit value plane codes decoded where they sit, code a at
    4**a times its unit (one mask each; the accumulators scaled back in the epilogue; on a GPU by value_planes_asm's
    asm, in the interpreter by integer ops), else each shifted down to bit 0. table_registers: the codebook key lookups' register-side table words
    kept in every thread's registers through the walk (key_lut._tables; else ptxas copies them from uniform
    registers before each byte permute). rotation_units: rotation_16bit's operand read as fp16 +-1 entries (Rv x
    sqrt(D); else each program scales and converts fp32 Rv). reduce_columns: under rotate_in_reduce the reduction merges
    each row's partials first and then multiplies by Rv's columns, shared out over several programs per row where
    the device has SMs to spare (else one program per row steps over the rotated coordinates, every split's slice
    each step). value_boundary: the decoded value codes enter their dots behind an asm boundary
    (code_decoders.operand_boundary), in 16-bit operand layouts (else the 8-bit layouts Triton infers from the
    bytes, whose registers are regrouped by moves before each MMA). pdl: programmatic dependent launch (sm_90+): the
    attention may start while the kernel before it finishes and waits for it (griddepcontrol) before its first
    load, and a split launch's reduction likewise after it (off by default: untimed). A field left None takes the
    plan's default for the shape and device."""

    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    maxnreg: int | None = None
    key_lut: bool | None = None
    value_words: bool | None = None
    exact_program: bool | None = None
    meta_pairs: bool | None = None
    meta_words: bool | None = None
    vmid_chain: bool | None = None
    bt_next: bool | None = None
    pool32: bool | None = None
    key_words: bool | None = None
    head_pairs: int | None = None
    ring_n: int | None = None
    ring_spread: bool | None = None
    ring_programs: bool | None = None
    warp_split: bool | None = None
    rotate_in_reduce: bool | None = None
    rotation_16bit: bool | None = None
    query_butterfly: bool | None = None
    value_planes_asm: bool | None = None
    planes_in_place: bool | None = None
    table_registers: bool | None = None
    rotation_units: bool | None = None
    reduce_columns: bool | None = None
    value_boundary: bool | None = None
    pdl: bool | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if field.type == "bool | None" and type(value) is not bool:
                raise TypeError(f"LaunchConfig.{field.name} must be True, False or None, got {value!r}")
            if field.type == "int | None" and type(value) is not int:
                raise TypeError(f"LaunchConfig.{field.name} must be an int or None, got {value!r}")
        _check_choice("block_m", self.block_m, "a power of two >= 16", _pow2_from(16))
        _check_choice("block_n", self.block_n, "a power of two >= 16", _pow2_from(16))
        _check_choice("num_warps", self.num_warps, "1, 2, 4, 8 or 16", WARPS.__contains__)
        _check_choice("num_stages", self.num_stages, "an int >= 1", lambda v: v >= 1)
        _check_choice("maxnreg", self.maxnreg, f"{NO_REGISTER_CAP} (no cap) or 24 to 255 registers",
                      lambda v: v == NO_REGISTER_CAP or 24 <= v <= 255)
        _check_choice("head_pairs", self.head_pairs, "1 or 2", HEADS_PER_PROGRAM.__contains__)
        _check_choice("ring_n", self.ring_n, "16, 32, 64 or 128 tokens", RING_TILES.__contains__)

    def overrides(self) -> bool:
        """Whether any heuristic is overridden (then decode_warps' kernel runs only if warp_split asks for it)."""
        return any(getattr(self, f.name) is not None for f in dataclasses.fields(self))


def _pow2_from(low: int):
    return lambda v: v >= low and v & (v - 1) == 0


def _check_choice(name: str, value, supported: str, ok, owner: str = "LaunchConfig") -> None:
    if value is not None and not ok(value):
        raise ValueError(f"{owner}.{name} must be {supported}, got {value!r}")


DEFAULT = LaunchConfig()


@dataclasses.dataclass(frozen=True)
class StoreLaunchConfig:
    """Overrides of store_kv's launch heuristics, for benchmarks: block_t (tokens per program, a power of two
    >= 16), num_warps, ring_part (the ring written by programs of its own), rotation_units (under
    rotation="hadamard" the rotations' +-1 entries read as fp16, else built in registers; on by default); None:
    the heuristic's."""

    block_t: int | None = None
    num_warps: int | None = None
    ring_part: bool | None = None
    rotation_units: bool | None = None

    def __post_init__(self):
        for name in ("block_t", "num_warps"):
            value = getattr(self, name)
            if value is not None and type(value) is not int:
                raise TypeError(f"StoreLaunchConfig.{name} must be an int or None, got {value!r}")
        for name in ("ring_part", "rotation_units"):
            value = getattr(self, name)
            if value is not None and type(value) is not bool:
                raise TypeError(f"StoreLaunchConfig.{name} must be True, False or None, got {value!r}")
        _check_choice("block_t", self.block_t, "a power of two >= 16", _pow2_from(16), "StoreLaunchConfig")
        _check_choice("num_warps", self.num_warps, "1, 2, 4, 8 or 16", WARPS.__contains__, "StoreLaunchConfig")
