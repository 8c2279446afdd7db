"""The examples run as a user would run them, at small sizes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_grow_sleep_wake_runs_and_checks_itself(real_device: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "grow_sleep_wake.py"),
            "--device",
            real_device,
            "--mib",
            "16",
            "--steps",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "grow 4" in result.stdout
    assert "sleep" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("ok: base pointer")


@pytest.mark.parametrize("flags", [[], ["--static-shapes"]])
def test_transformers_generate_runs_and_checks_itself(flags: list[str]) -> None:
    pytest.importorskip("transformers")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "transformers_generate.py"), "--new-tokens", "30", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "before the first token: 0 bytes" in result.stdout
    assert "asleep: 0 bytes" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("ok: DynamicCache's tokens")


def test_switch_models_shares_a_budget_between_two_processes(tmp_path: Path) -> None:
    """Two demo-decoder engines under a limit that holds one: refused, waited, right tokens."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "switch_models.py"), "--engine", "demo", "--kv-mib", "32"],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"EXTENSIBLE_KV_STATE_DIR": str(tmp_path / "untouched")},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "ok: every serve's tokens were right"
    (refusal,) = [line for line in lines if "refused: " in line]
    assert refusal.split()[:2] == ["B", "wake"]
    assert sum("tokens right" in line for line in lines) == 6
    assert not (tmp_path / "untouched").exists()  # the example's limits live in its own directory
