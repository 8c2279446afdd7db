"""The prepared GPU check: one command for a lent GPU machine.

    nox -s gpu                       # or, where nox is not installed:
    python3 scripts/gpu_check.py [--out DIR]

Made for a machine where torch, cuda-bindings, pytest and hypothesis are
installed and nothing can be downloaded: it uses the running Python (no
virtual environment), installs this project with ``--no-deps
--no-build-isolation``, then

1. records the machine: device, driver, torch, bindings versions;
2. runs the whole test suite (host and GPU devices, GPU-only tests);
3. runs the core benchmark on the GPU;
4. runs the grow/sleep/wake example once under ``compute-sanitizer --tool
   memcheck`` when that tool exists;

and writes ``summary.json`` and ``summary.md`` (plus logs) to ``--out``
(default ``$OUT`` if set, else ``bench-results/gpu``). Each step has a time
limit so that the whole check ends well inside 10 minutes.
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


def run(name: str, cmd: list[str], out: Path, timeout: int) -> dict[str, object]:
    """Run one step, logging to ``out/<name>.log``; never raises."""
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    log = out / f"{name}.log"
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
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
    started = time.perf_counter()
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
    junit = out / "pytest.xml"
    steps["tests"] = run(
        "tests",
        [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}", "tests"],
        out,
        300,
    )
    steps["tests"]["counts"] = junit_counts(junit)
    bench_json = out / "bench-core-cuda.json"
    steps["bench"] = run(
        "bench",
        [py, "benchmarks/bench_core.py", "--device", "cuda", "--json", str(bench_json)],
        out,
        240,
    )
    if bench_json.exists():
        summary["bench_core"] = json.loads(bench_json.read_text())
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer:
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
            180,
        )
        log = (out / "memcheck.log").read_text()
        found = re.search(r"ERROR SUMMARY: (\d+) error", log)
        steps["memcheck"]["errors"] = int(found.group(1)) if found else None
    else:
        steps["memcheck"] = {"rc": None, "skipped": "compute-sanitizer not on PATH"}

    summary["steps"] = steps
    summary["seconds"] = round(time.perf_counter() - started, 1)
    ok = all(step.get("rc") in (0, None) for step in steps.values())
    summary["ok"] = ok
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    lines = [
        f"# GPU check {summary['date']}",
        "",
        f"machine: `{json.dumps(summary['machine'])}`",
        "",
    ]
    lines += [
        f"- {name}: rc={s.get('rc')} ({s.get('seconds', '-')} s) {s.get('counts', '')}"
        for name, s in steps.items()
    ]
    lines += ["", f"ok: {ok}, {summary['seconds']} s in all"]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
