"""The runner flow, the CLI and the example run, at small sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from extensible_kv.cli import main
from extensible_kv.demo import FlowSettings, ModelConfig, run_flow
from extensible_kv.demo.model import TinyDecoder, eager_step, generate

#: The CLI's demo at test sizes.
SMALL_ARGS = ["--layers", "2", "--batch", "2", "--new-tokens", "8", "--capacity-blocks", "256"]
SMALL = FlowSettings(model=ModelConfig(layers=2), batch=2, new_tokens=12, capacity_blocks=256)
ROOT = Path(__file__).resolve().parent.parent


def test_the_flow_checks_its_tokens(real_device: str) -> None:
    device = real_device
    report = run_flow(device, SMALL)
    assert report.ok
    names = [phase.name for phase in report.timeline]
    assert names == [
        "reserve",
        "warm-up",
        "final commit",
        "generate",
        "sleep",
        "wake",
        "generate again",
        "free",
    ]
    by_name = {phase.name: phase for phase in report.timeline}
    assert by_name["sleep"].physical_bytes == 0
    assert by_name["wake"].committed_bytes == by_name["final commit"].committed_bytes
    assert by_name["free"].reserved_bytes == 0
    assert report.cuda_graph == (device == "cuda")
    assert len(set(report.tokens[0])) > 3, "the model says varied things"


def test_the_token_check_can_fail() -> None:
    """Tokens depend on the cache's contents: wiping it midway changes them."""
    config = ModelConfig(layers=2)
    model = TinyDecoder(config, torch.device("cpu"))
    prompts = [[5, 9, 2, 7, 1, 3, 8, 4] * 2, [1, 2, 3, 4, 5, 6, 7, 8] * 2]

    def caches() -> list[torch.Tensor]:
        return [
            torch.zeros(2, 16, config.block_size, config.kv_heads, config.head_size)
            for _ in range(2)
        ]

    intact = generate(
        eager_step(model, caches()),
        prompts,
        12,
        block_size=16,
        max_blocks=4,
        device=torch.device("cpu"),
    )
    wiped_caches = caches()
    steps = [0]

    def wipe(_: int) -> None:
        steps[0] += 1
        if steps[0] == 20:
            for cache in wiped_caches:
                cache.zero_()

    wiped = generate(
        eager_step(model, wiped_caches),
        prompts,
        12,
        block_size=16,
        max_blocks=4,
        device=torch.device("cpu"),
        ensure_blocks=wipe,
    )
    assert wiped != intact


def test_the_flow_refuses_a_capacity_too_small() -> None:
    with pytest.raises(ValueError, match="blocks are needed"):
        run_flow("cpu", FlowSettings(capacity_blocks=2))


def test_cli_probe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    host = next(row for row in rows if row["device"] == "cpu")
    assert host["usable"] == "yes"
    assert host["granularity"] == "2 MiB"
    assert any(row["device"].startswith("cuda") for row in rows)
    assert main(["probe"]) == 0
    assert "extensible-kv backends" in capsys.readouterr().out


def test_cli_demo_writes_its_timeline(tmp_path: Path, real_device: str) -> None:
    code = main(["demo", "--device", real_device, *SMALL_ARGS, "--out", str(tmp_path)])
    assert code == 0
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert timeline["ok"] is True
    assert [p["name"] for p in timeline["timeline"]][-1] == "free"
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


def test_example_script_runs() -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "paged_decoder.py"),
            "--device",
            "cpu",
            "--capacity-blocks",
            "256",
            "--new-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "tokens match ordinary KV memory: True" in result.stdout


def test_cli_demo_on_two_ranks_commits_the_smallest_proposal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["demo", "--world-size", "2", "--device", "cpu", *SMALL_ARGS])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "every rank committed the smallest proposal" in out
