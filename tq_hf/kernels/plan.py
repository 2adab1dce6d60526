"""The launch plan of an attention call: what its argument kinds decide, computed and validated once."""

from __future__ import annotations

import dataclasses

import torch

from ..layout import BlockLayout
from .fast_launch import LaunchSite


@dataclasses.dataclass(slots=True)
class AttentionPlan:
    """The kernel to launch, its grid, constexprs and scalars, the split workspace's size and the reduction."""

    layout: BlockLayout  # held, so the id keying this plan stays this layout's
    kernel: object  # the jitted kernel: unified._attn_kernel or decode_warps._warp_kernel
    grid: tuple[int, int, int]
    constants: dict
    block_n: int
    num_stages: int
    split: bool
    ns_all: int  # split programs per row tile (the pool's splits, plus the exact program if any)
    partial_rows: int  # split partial rows, B x Hk x row tiles x ns_all x rows per KV head
    dp: int
    partial_width: int  # fp32 values per split partial row (reduce.partial_width)
    workspace_numel: int
    rot: torch.Tensor
    cent: torch.Tensor
    vrot: torch.Tensor
    s_koff: int
    prefix_len: int
    recent_size: int
    scalars: tuple  # (Lq, num_splits, sm_scale, softcap, window, block_bytes, plane_bytes)
    reduce: LaunchSite | None
    attention: LaunchSite | None = None  # set by the first launch (the variant that fits the GPU)
