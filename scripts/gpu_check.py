"""The prepared GPU check: one command for a lent GPU machine.

    nox -s gpu                       # or, where nox is not installed:
    python3 scripts/gpu_check.py [--out DIR]

Made for a machine where torch, cuda-bindings, pytest and hypothesis are
installed and nothing can be downloaded: it uses the running Python (no
virtual environment), installs this project with ``--no-deps
--no-build-isolation``, then

1. records the machine: device, driver, torch, bindings versions;
2. runs the whole test suite (host and GPU devices, GPU-only tests);
3. runs ``extensible-kv bench`` on the GPU (results.json and bench.png);
4. runs the grow/sleep/wake example once under ``compute-sanitizer --tool
   memcheck`` when that tool exists;

and writes ``summary.json`` and ``summary.md`` (plus logs) to ``--out``
(default ``$OUT`` if set, else ``bench-results/gpu``). Each step has a time
limit, and no step starts after 8 minutes, so the whole check ends inside 10
minutes. Tests run with the ``gpu-check`` Hypothesis profile (fewer
examples). Without a usable GPU it says why and runs the tests only.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


#: The whole check stops starting steps past this many seconds.
DEADLINE_S = 480
_STARTED = time.perf_counter()


def run(name: str, cmd: list[str], out: Path, timeout: int) -> dict[str, object]:
    """Run one step, logging to ``out/<name>.log``; never raises."""
    left = DEADLINE_S - (time.perf_counter() - _STARTED)
    if left < 30:
        print(f"== {name}: skipped, {left:.0f} s left before the deadline", flush=True)
        return {"rc": None, "skipped": "deadline"}
    timeout = int(min(timeout, left))
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    log = out / f"{name}.log"
    env = {**os.environ, "HYPOTHESIS_PROFILE": "gpu-check", "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False, env=env
        )
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        text = f"{exc.stdout or ''}{exc.stderr or ''}\n[timed out after {timeout} s]"
        text = text if isinstance(text, str) else str(text)
    seconds = round(time.perf_counter() - start, 1)
    log.write_text(text)
    print(text[-3000:], flush=True)
    print(f"== {name}: rc={rc} in {seconds} s", flush=True)
    return {"rc": rc, "seconds": seconds, "log": log.name}


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, object]:
    info: dict[str, object] = {
        "python": sys.version.split()[0],
        "cuda-bindings": version("cuda-bindings"),
        "hip-python": version("hip-python"),
        "ctypes-dlpack": version("ctypes-dlpack"),
    }
    if shutil.which("nvidia-smi"):
        query = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        )
        info["nvidia-smi"] = query.stdout.strip()
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["torch_hip"] = torch.version.hip
        if torch.cuda.is_available():
            info["device"] = torch.cuda.get_device_name(0)
    except ImportError:
        info["torch"] = "not installed"
    return info


def junit_counts(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    return {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}


def gpu_steps(py: str, out: Path, bench_json: Path) -> dict[str, dict[str, object]]:
    """The benchmark and the memcheck pass, which need a GPU."""
    steps = {
        "bench": run(
            "bench",
            [
                py,
                "-m",
                "extensible_kv.cli",
                "bench",
                "--device",
                "cuda",
                "--out",
                str(bench_json.parent),
            ],
            out,
            240,
        )
    }
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        steps["memcheck"] = {"rc": None, "skipped": "compute-sanitizer not on PATH"}
        return steps
    steps["memcheck"] = run(
        "memcheck",
        [
            sanitizer,
            "--tool",
            "memcheck",
            "--error-exitcode",
            "3",
            py,
            "examples/grow_sleep_wake.py",
            "--device",
            "cuda",
            "--mib",
            "64",
            "--steps",
            "4",
        ],
        out,
        150,
    )
    log_path = out / "memcheck.log"
    found = re.search(
        r"ERROR SUMMARY: (\d+) error", log_path.read_text() if log_path.exists() else ""
    )
    steps["memcheck"]["errors"] = int(found.group(1)) if found else None
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_out = (
        Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench-results" / "gpu"
    )
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    summary: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
    }
    print(json.dumps(summary, indent=2), flush=True)

    steps: dict[str, dict[str, object]] = {}
    steps["install"] = run(
        "install",
        [py, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q", "."],
        out,
        180,
    )
    gpu_reason = subprocess.run(
        [py, "-c", "import extensible_kv as e; print(e.unavailable_reason('cuda') or '')"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    summary["gpu_unavailable_reason"] = gpu_reason or None
    if gpu_reason:
        print(f"== no usable GPU: {gpu_reason}", flush=True)
    junit = out / "pytest.xml"
    steps["tests"] = run(
        "tests",
        [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}", "tests"],
        out,
        300,
    )
    steps["tests"]["counts"] = junit_counts(junit)
    bench_json = out / "bench" / "results.json"
    if gpu_reason:
        steps["bench"] = {"rc": None, "skipped": "no usable GPU"}
        steps["memcheck"] = {"rc": None, "skipped": "no usable GPU"}
    else:
        steps.update(gpu_steps(py, out, bench_json))
    if bench_json.exists():
        summary["bench"] = json.loads(bench_json.read_text())

    summary["steps"] = steps
    summary["seconds"] = round(time.perf_counter() - _STARTED, 1)
    ok = not gpu_reason and all(step.get("rc") in (0, None) for step in steps.values())
    summary["ok"] = ok
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    lines = [
        f"# GPU check {summary['date']}",
        "",
        f"machine: `{json.dumps(summary['machine'])}`",
        "",
    ]
    if gpu_reason:
        lines += [f"no usable GPU: {gpu_reason}", ""]
    lines += [
        f"- {name}: rc={step.get('rc')} ({step.get('seconds', '-')} s) "
        f"{step.get('counts', step.get('skipped', ''))}"
        for name, step in steps.items()
    ]
    lines += ["", f"ok: {ok}, {summary['seconds']} s in all"]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
