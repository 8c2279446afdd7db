"""Running code in a child Python process, for tests that may crash it."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_python(code: str, *, pass_fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run dedented ``code`` in a new interpreter; its output is captured."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        pass_fds=pass_fds,
        timeout=300,
    )
