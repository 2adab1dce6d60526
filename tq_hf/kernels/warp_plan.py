"""The launch plan of decode_warps' one-warp split decode, and when a decode call takes that kernel."""

from __future__ import annotations

import torch
import triton

from ..layout import BlockLayout
from .decode_warps import _warp_kernel, rotation_halves
from .device import DeviceTraits
from .key_lut import config_lut_bytes, lut_words_asm
from .launch_config import NO_REGISTER_CAP, LaunchConfig
from .plan import AttentionPlan
from .reduce import reduce_site
from .workspace import check_workspace

COLUMNS = 8  # query columns per program: 2 KV heads x 4 rows (G * Lq <= 4), the MMA's N
HEADS = 2  # KV heads per program

# KV-head tokens of a decode walk from which this kernel beats the unified one on few sequences (wanted)
WALK_TOKENS = 2**19

# one-warp programs an SM holds at once: 255 registers (no cap; a cap of 168 measured slower) and 18 KB of
# shared memory (3 stages of 32-token tiles)
PROGRAMS_PER_SM = 8


def unsupported(layout: BlockLayout, rows: int, plain: bool) -> str | None:
    """What this kernel would need that the launch lacks (None: it can run it)."""
    cfg, d = layout.config, layout.head_dim
    if not (cfg.uses_codebook and cfg.key_bits == 4 and cfg.value_bits == 4):
        return f"4-bit codebook keys and 4-bit values (got {cfg.key_bits}-bit keys, {cfg.value_bits}-bit values)"
    if config_lut_bytes(cfg, d) is None:
        return "4-bit centroids on the byte grid (reference.on_byte_grid)"
    if d not in (64, 128, 256):
        return f"head_dim 64, 128 or 256 (got {d})"
    if layout.num_kv_heads % HEADS:
        return f"an even KV head count (got {layout.num_kv_heads})"
    if rows > COLUMNS // HEADS:
        return f"decode of <= {COLUMNS // HEADS} query rows per KV head (query heads per KV head x query length, got {rows})"
    if not plain:
        return ("the plain format: no exact prefix or recent ring, key centering, value rotation, kv_start, "
                "sliding window, sinks or softcap")
    return None


def wanted(launch: LaunchConfig, layout: BlockLayout, rows: int, batch: int, plain: bool, traits: DeviceTraits,
           kv_len: int) -> bool:
    """Whether a decode launch takes this kernel: launch.warp_split if set (True raises where unsupported); other
    overrides are the unified kernel's variants, so they keep it; else on a GPU running PTX at head_dim 128 when
    4 x batch x KV heads fill the SMs or the walk holds >= WALK_TOKENS (batch x KV heads x kv_len, the host's
    bound on the length): below both the unified kernel was as fast; other head_dims are unmeasured."""
    forced = launch.warp_split
    why = unsupported(layout, rows, plain)
    if forced:
        if why is not None:
            raise ValueError(f"LaunchConfig warp_split=True needs {why}")
        if launch.pdl:
            raise ValueError("LaunchConfig pdl=True needs the unified kernel (warp_split=False or None)")
        return True
    if forced is not None or launch.overrides():
        return False
    heads = batch * layout.num_kv_heads
    fills = 4 * heads >= traits.num_sms or heads * kv_len >= WALK_TOKENS
    return why is None and traits.tuned_for_gpu and traits.runs_ptx and layout.head_dim == 128 and fills


def plan_warps(layout: BlockLayout, pool: torch.Tensor, b: int, g: int, lq: int, cent, vrot, workspace, kv_len: int,
               num_splits, scale: float, launch: LaunchConfig, traits: DeviceTraits) -> AttentionPlan:
    """The plan of this kernel and the split reduction; kv_len: the host's bound on the walk's length."""
    d, hk, t = layout.head_dim, layout.num_kv_heads, layout.block_size
    ptx = traits.runs_ptx
    block_n = launch.block_n if launch.block_n is not None else (32 if ptx else 16)
    if block_n not in (16, 32, 64):
        raise ValueError(f"LaunchConfig block_n must be 16, 32 or 64 tokens for warp_split, got {block_n!r}")
    num_stages = launch.num_stages if launch.num_stages is not None else (3 if ptx else 1)
    maxnreg = None if launch.maxnreg == NO_REGISTER_CAP else launch.maxnreg  # None: ptxas's 255
    kv_tiles = max(1, triton.cdiv(kv_len, block_n))
    if num_splits is None:
        # one wave of programs (a partial second wave was slower, fewer left SMs idle), a power of two that
        # splits power-of-two lengths evenly
        want = max(1, min(PROGRAMS_PER_SM * traits.num_sms // (b * hk // HEADS), kv_tiles, 256))
        num_splits = 1 << (want.bit_length() - 1)
    if type(num_splits) is not int or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    rho = COLUMNS // HEADS  # partial rows per KV head
    dp = triton.next_power_of_2(d)
    partial_rows = b * hk * num_splits * rho
    workspace_numel = partial_rows * (dp + 1)
    check_workspace(workspace, workspace_numel, pool.device)
    table, unit = config_lut_bytes(layout.config, d)
    constants = dict(
        D=d, DP=dp, T=t, KB=layout.key_bytes, VB=layout.value_bytes, META=layout.metadata_offset, G=g, QUERY_COLS=COLUMNS,
        HEADS_PER_PROGRAM=HEADS, ROWS_PER_HEAD=rho, KEY_UNIT=unit, LUT=lut_words_asm(table) if ptx else "", PTX=ptx,
        POOL64=pool.numel() >= 2**31, HALF=((1 << layout.config.value_bits) - 1) / 2,
        HADAMARD=layout.config.rotation == "hadamard", num_warps=1, **({"maxnreg": maxnreg} if maxnreg else {}))
    return AttentionPlan(
        layout=layout, kernel=_warp_kernel, grid=(num_splits, hk // HEADS, b), constants=constants, block_n=block_n,
        num_stages=num_stages, split=True, ns_all=num_splits, partial_rows=partial_rows, dp=dp, partial_width=dp,
        workspace_numel=workspace_numel, rot=rotation_halves(layout, str(pool.device)), cent=cent, vrot=vrot,
        s_koff=0, prefix_len=0, recent_size=0,
        scalars=(lq, num_splits, float(scale), 1.0, 0, layout.block_bytes, layout.plane_bytes),
        reduce=reduce_site(b, hk, g, lq, num_splits, rho, d, dp))
