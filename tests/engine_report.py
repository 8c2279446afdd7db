"""An engine script of tests/ (``vllm_elastic.py``, ``vllm_rl.py``) run in a
process of its own, and its report: the last line it prints,
``RESULT <json>``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

#: Seconds one engine script may run.
TIMEOUT_S = 600


def report_of(
    script: Path, settings: dict[str, Any], env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``script`` with ``settings`` (JSON) and extra ``env``; its report."""
    result = subprocess.run(
        [sys.executable, str(script), json.dumps(settings)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    line = next(x for x in reversed(result.stdout.splitlines()) if x.startswith("RESULT "))
    report: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return report
