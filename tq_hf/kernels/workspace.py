"""Scratch memory of split-KV decode: the per-split partial outputs and log-sum-exps the reduction merges."""

from __future__ import annotations

import torch

from .codec_tensors import next_pow2

_WORKSPACES: dict[str, torch.Tensor] = {}
_PARTIALS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # views of the current workspaces
_GENERATION = [0]  # counts workspace replacements: held launches (attention.HeldAttention) keep views of one


def generation() -> int:
    """How many times a workspace was replaced: a held launch made before the last replacement plans anew."""
    return _GENERATION[0]


def split_workspace(device: torch.device, numel: int) -> torch.Tensor:
    """A persistent fp32 scratch buffer of at least `numel` elements for split partials.

    Shared by every layer and step on the device; it grows (never shrinks) to a power of two,
    so after the first call of a given shape no allocation happens. Eager calls only: a compiled call without
    its caller's scratch makes scratch of its own (ops: under cudagraph trees this one would outlive the graph).
    """
    key = str(device)
    buf = _WORKSPACES.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(next_pow2(numel), dtype=torch.float32, device=device)
        _WORKSPACES[key] = buf
        _GENERATION[0] += 1
        for k in [k for k in _PARTIALS if k[0] == key]:  # views of the replaced buffer
            del _PARTIALS[k]
    return buf


def split_partials(device: torch.device, pout_numel: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial outputs, log-sum-exps): elements [0, pout_numel) and [pout_numel, numel) of the
    persistent workspace, as views kept while it stands (a decode step slices nothing)."""
    key = (str(device), pout_numel, numel)
    views = _PARTIALS.get(key)
    if views is None:
        buf = split_workspace(device, numel)
        views = _PARTIALS[key] = (buf[:pout_numel], buf[pout_numel:numel])
    return views


def check_workspace(workspace: torch.Tensor | None, numel: int, device: torch.device) -> None:
    """A caller's split scratch buffer must be fp32 on the pool's device with room for `numel` elements."""
    if workspace is not None and (workspace.dtype != torch.float32 or workspace.device != device
                                  or workspace.numel() < numel):
        raise ValueError(f"workspace must be float32 on {device} with >= {numel} elements")

