"""Agreeing on one block count across tensor-parallel ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def agree_num_blocks(num_blocks: int, group: Any = None) -> int:
    """The smallest ``num_blocks`` proposed by any rank of ``group``.

    Every tensor-parallel rank must commit the same count, and each can
    only afford what its own device has free: so all take the minimum. Over
    gloo the value travels in a CPU tensor, over NCCL in one on the current
    GPU. Without an initialized process group this returns ``num_blocks``.
    """
    if not dist.is_available() or not dist.is_initialized():
        return num_blocks
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    proposal = torch.tensor([num_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(proposal, op=dist.ReduceOp.MIN, group=group)
    return int(proposal.item())
