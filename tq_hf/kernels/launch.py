"""The first launch of a plan: step down to a variant that fits the GPU's shared memory.

Later launches of the plan go through the LaunchSite this returns (fast_launch.py).
"""

from __future__ import annotations

import triton.runtime.errors

from .fast_launch import LAUNCH_OPTIONS, LaunchSite

# (kernel, constants, block_n, num_stages) -> the (block_n, num_stages, RING_TILE) that fits this GPU's shared memory
_FITTED: dict[tuple, tuple[int, int, int | None]] = {}


def step_downs(block_n: int, num_stages: int, ring_n: int | None) -> list[tuple[int, int, int | None]]:
    """Variants to try, in order: fewer pipeline stages, then shorter KV tiles; with a recent-window
    ring, each of those with shorter ring tiles too (the ring tile does not shrink with the KV
    tile: a 64-row prefill tile with a 64-token ring once needed 256 KiB on the H200)."""
    tiles = [(block_n, num_stages), (block_n, 1), (max(16, block_n // 2), 1), (max(16, block_n // 4), 1)]
    rings = [ring_n] if ring_n is None else sorted({ring_n, max(16, ring_n // 2), max(16, ring_n // 4)}, reverse=True)
    out = []
    for rn in rings:
        out += [(bn, st, rn) for bn, st in tiles if (bn, st, rn) not in out]
    return out


def launch_fitting(kernel, grid: tuple, args: tuple, constants: dict, block_n: int, num_stages: int) -> LaunchSite:
    """Launch, stepping down (step_downs) when a variant needs more shared memory than the GPU has
    (e.g. 3-bit codes with dense exact tiles at head_dim 128). The failure is raised before
    anything is enqueued, so a retry is safe, also under CUDA-graph capture; the variant that fits
    is remembered, so later calls launch once. Returns the launch site of the variant that ran."""
    key = (kernel, tuple(constants.items()), block_n, num_stages)  # one dict literal: a fixed order
    ring_n = constants["RING_TILE"] if constants.get("HAS_RECENT") else None
    tries = [_FITTED[key]] if key in _FITTED else step_downs(block_n, num_stages, ring_n)
    for i, (bn, stages, rn) in enumerate(tries):
        variant = dict(constants if rn is None else {**constants, "RING_TILE": rn}, BLOCK_N=bn, num_stages=stages,
                       **LAUNCH_OPTIONS)
        try:
            compiled = kernel[grid](*args, **variant)
        except triton.runtime.errors.OutOfResources:
            if i == len(tries) - 1:
                raise
            continue
        _FITTED[key] = (bn, stages, rn)
        site = LaunchSite(kernel, grid, variant)
        site.adopt(compiled, len(args))
        return site
