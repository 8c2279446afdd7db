"""Rank agreement over torch.distributed (gloo, two processes on the CPU)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from extensible_kv.kv import agree_num_blocks


def test_without_a_process_group_the_proposal_stands() -> None:
    assert agree_num_blocks(1234) == 1234


def test_two_ranks_commit_the_smaller_count(tmp_path: Path) -> None:
    init = tmp_path / "rendezvous"
    code = textwrap.dedent(f"""
        import sys
        import torch.distributed as dist
        from extensible_kv.kv import agree_num_blocks
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="file://{init}", rank=rank, world_size=2)
        agreed = agree_num_blocks(1000 + 500 * rank)
        print(agreed)
        dist.destroy_process_group()
    """)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
        assert out.strip() == "1000"
