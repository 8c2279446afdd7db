"""The examples run as a user would run them, at small sizes."""

from __future__ import annotations

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
