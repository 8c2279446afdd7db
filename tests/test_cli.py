"""The command line: every mistake a newcomer makes ends in one clear line
on stderr and a non-zero exit, never in a traceback or an "ok"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from extensible_kv import unavailable_reason
from extensible_kv.cli import main

GPU = unavailable_reason("cuda") is None and torch.cuda.is_available()
no_gpu = pytest.mark.skipif(GPU, reason="this machine has a usable GPU")

CASES = [
    pytest.param("demo --device cuda", "cuda cannot be used here", marks=no_gpu),
    pytest.param("demo --device cuda:1", "cuda:1 cannot be used here", marks=no_gpu),
    pytest.param("bench --device cuda --quick", "cuda cannot be used here", marks=no_gpu),
    ("demo --device gpu", "device type 'gpu' is not supported"),
    ("demo --device rocm", "device type 'rocm' is not supported"),
    ("demo --device cpu:1", "the host has one device"),
    ("demo --capacity-blocks 0", "--capacity-blocks: must be at least 1, got 0"),
    ("demo --capacity-blocks -5", "--capacity-blocks: must be at least 1, got -5"),
    ("demo --layers 0", "--layers: must be at least 1"),
    ("demo --memory-utilization 1.5", "--memory-utilization: must be a share"),
    ("demo --kv-budget-mib 0", "--kv-budget-mib: must be at least 1"),
    ("demo --batch 0", "--batch: must be at least 1"),
    ("demo --new-tokens 0", "--new-tokens: must be at least 1"),
    ("demo --new-tokens -3", "--new-tokens: must be at least 1"),
    ("demo --world-size 0", "--world-size: must be at least 1"),
    ("bench --repeats 0", "--repeats: must be at least 1"),
    ("bench --repeats -1", "--repeats: must be at least 1"),
    ("demo --layers two", "'two' is not a whole number"),
    ("demo --capacity-blocks 2 --layers 1", "blocks are needed but the capacity is 2"),
]


@pytest.mark.parametrize(("command", "message"), CASES)
def test_a_mistake_is_one_clear_line(command: str, message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "extensible_kv.cli", *command.split()],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"extensible-kv {command.split()[0]}: error:"), last
    assert message in last
    assert "ok" not in result.stdout.split()


def test_ranks_write_their_results(tmp_path: Path) -> None:
    args = ["--layers", "1", "--batch", "1", "--new-tokens", "4", "--capacity-blocks", "64"]
    code = main(["demo", "--world-size", "2", "--device", "cpu", *args, "--out", str(tmp_path)])
    assert code == 0
    ranks = json.loads((tmp_path / "ranks.json").read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    assert len({r["committed_blocks"] for r in ranks}) == 1


def test_help_is_plain_text_with_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "``" not in top
    assert "probe" in top
    assert "bench" in top
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = capsys.readouterr().out
    for option in ("--layers", "--batch", "--new-tokens", "--world-size", "--out"):
        assert option in text
    assert "(default: 65536)" in text
    assert text.count("(default:") >= 8, "every option says its default"


def test_probe_says_what_to_install_and_why_rocm_is_absent(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = "cuda-bindings is not installed: pip install 'extensible-kv[cuda]'"
    monkeypatch.setattr(
        "extensible_kv.cli.unavailable_reason", lambda d: None if d == "cpu" else missing
    )
    assert main(["probe"]) == 0
    out = capsys.readouterr().out
    assert "pip install 'extensible-kv[cuda]'" in out, "rich markup must not eat [cuda]"
    if not torch.version.hip:
        assert "rocm" in out
        assert "not a ROCm build" in out
