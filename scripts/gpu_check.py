"""The prepared GPU check: one command for a lent GPU machine.

    python3 scripts/gpu_check.py --wheels .whl     # on the GPU machine ($OUT set)
    python3 scripts/gpu_check.py --cpu-dry-run     # the same steps on a CPU-only machine
    nox -s gpu -- --wheels .whl                    # the same, where nox is installed

Made for the GPU image: its own Python (torch, cuda-bindings, pytest,
hypothesis, ...), no network, maybe an "externally managed" system Python.
The project is not installed: every step runs with
``PYTHONPATH=<root>/src:<out>/deps``, and ``<out>/deps`` receives, from the
wheel folder only, the runtime dependencies of pyproject.toml that are not
installed (ctypes-dlpack, typically). The steps:

1. install: those dependencies, ``pip --no-index --no-deps --target <out>/deps``;
2. import: ``import extensible_kv``; a failure stops the check;
3. probe: ``unavailable_reason`` for "cuda" and "cpu", as JSON;
4. machine: nvidia-smi, torch, CUDA and bindings versions;
5. gpu-tests: tests/test_gpu.py alone, one test at a time (it reads the
   device's free memory);
6. tests: the rest of the suite (``gpu-check`` Hypothesis profile), less the
   simulated backends, in parallel where pytest-xdist is installed;
7. bench: ``extensible_kv.cli bench --device cuda`` into ``<out>/bench``;
8. memcheck: examples/grow_sleep_wake.py under ``compute-sanitizer --tool memcheck``.

``--cpu-dry-run`` runs them on a machine without a GPU (and hides any GPU):
host tests only, less tests/test_demo.py; a quick host bench; no memcheck.

A step fails on a non-zero exit code or a traceback on its stderr. Each has
a time limit, and none starts with less than 30 s left of the global
deadline (8 minutes, to fit a GPU lease). The dry run's tests step runs on
one process (on CI's 2 cores about 190 s when the machine is quiet, 500 s
when it is busy), so it has 15 minutes instead of 210 s, and the dry run's
deadline as much more. Written to ``--out``: summary.json, summary.md (its
first line: the verdict or the first error; it is also what goes to stdout,
progress goes to stderr), a log per step and the tests' JUnit XML. Exit
code 0 iff every step that ran passed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parent.parent
#: No step starts past this many seconds, nor with less than MIN_START_S left.
DEADLINE_S = 480
MIN_START_S = 30
#: Each step's time limit in seconds (cut to what is left before the deadline).
LIMITS = {
    "install": 60,
    "import": 60,
    "probe": 60,
    "machine": 60,
    "gpu-tests": 60,
    "tests": 210,
    "bench": 150,
    "memcheck": 45,
}
#: The dry run's tests step's limit, and its deadline (the extra time added).
DRY_RUN_TESTS_S = 900
DRY_RUN_DEADLINE_S = DEADLINE_S + DRY_RUN_TESTS_S - LIMITS["tests"]
TRACEBACK = "Traceback (most recent call last):"
#: The tests that measure the whole device: they run alone, before the rest.
GPU_TESTS = "tests/test_gpu.py"
#: A test running longer than this (where pytest-timeout is installed) fails.
TEST_LIMIT_S = 90
#: Failed tests named in the summary at most.
MAX_NAMED = 50
#: The tests' selection: their simulated GPU backends are for CPU CI only.
SELECTION = "not cuda-sim and not hip-sim"
#: Steps whose details summary.md lists above its table.
INFO = ("probe", "machine")

PROBE = """
import json
from extensible_kv import unavailable_reason
print(json.dumps({"cuda": unavailable_reason("cuda"), "cpu": unavailable_reason("cpu")}))
"""

MACHINE = """
import importlib.metadata as metadata, json, platform, torch
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
names = ("cuda-bindings", "cuda-core", "ctypes-dlpack", "jax", "numpy", "pytest", "hypothesis")
info = {"python": platform.python_version(), "torch": torch.__version__}
info |= {name: version(name) for name in names}
info["cupy"] = next((d.version for d in metadata.distributions()
                     if (d.metadata["Name"] or "").lower().startswith("cupy")), None)
info |= {"torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info |= {"device": p.name, "capability": f"{p.major}.{p.minor}",
             "memory_gib": round(p.total_memory / 2**30, 1)}
print(json.dumps(info))
"""


@dataclass
class Step:
    """One step's outcome; ``ok`` is None for a step skipped on purpose."""

    name: str
    ok: bool | None
    error: str | None = None
    rc: int | None = None
    seconds: float = 0.0
    log: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    stdout: str = field(default="", repr=False)

    def as_json(self) -> dict[str, Any]:
        """The step for summary.json (without its stdout, which is in its log)."""
        data = asdict(self)
        del data["stdout"]
        return data


@dataclass
class Check:
    """What the steps share: the project, the output folder, their environment, the clock."""

    root: Path
    out: Path
    env: dict[str, str]
    deadline: float
    steps: list[Step] = field(default_factory=list)

    @property
    def deps(self) -> Path:
        """Where the missing dependencies are installed (on every step's PYTHONPATH)."""
        return self.out / "deps"

    def record(self, step: Step) -> Step:
        """Keep ``step`` and say how it went on stderr."""
        self.steps.append(step)
        verdict = {True: "ok", False: "FAILED", None: "skipped"}[step.ok]
        note = step.error or step.details.get("skipped", "")
        progress(f"== {step.name}: {verdict} ({step.seconds} s) {note}")
        if step.ok is False and step.log:
            progress("\n".join((self.out / step.log).read_text().splitlines()[-40:]))
        return step

    def fail(self, step: Step, error: str) -> Step:
        """Turn a step that ran into a failure, for ``error`` (seen after it ran)."""
        step.ok, step.error = False, error
        progress(f"== {step.name}: FAILED {error}")
        return step

    def run(
        self, name: str, cmd: list[str], limit: float, env: dict[str, str] | None = None
    ) -> Step:
        """Run ``cmd`` in the project root as step ``name``, logged to ``<out>/<name>.log``.

        It passes with exit code 0 and no traceback on stderr. It does not
        start (and fails) with less than MIN_START_S seconds left.
        """
        left = self.deadline - time.perf_counter()
        if left < MIN_START_S:
            return self.record(Step(name, False, f"{name}: not started, {left:.0f} s left"))
        limit = min(limit, left)
        progress(f"== {name}: {shown(cmd)}")
        start = time.perf_counter()
        rc, stdout, stderr = execute(cmd, self.root, self.env if env is None else env, limit)
        seconds = round(time.perf_counter() - start, 1)
        log = self.out / f"{name}.log"
        log.write_text(f"$ {shlex.join(cmd)}\n{stdout}\n--- stderr ---\n{stderr}")
        error = step_error(name, rc, stdout, stderr, limit)
        return self.record(Step(name, error is None, error, rc, seconds, log.name, stdout=stdout))


def progress(text: str) -> None:
    """Progress goes to stderr; stdout carries only the summary."""
    print(text, file=sys.stderr, flush=True)


def shown(cmd: list[str]) -> str:
    """``cmd`` for a progress line, with multi-line code (``-c``) left out."""
    return shlex.join("<code>" if "\n" in arg else arg for arg in cmd)


def execute(
    cmd: list[str], cwd: Path, env: dict[str, str], limit: float
) -> tuple[int | None, str, str]:
    """Run ``cmd``: (exit code, stdout, stderr); past ``limit`` seconds its whole
    process group is killed and the code is None."""
    try:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            errors="replace",
            start_new_session=True,
        )
    except OSError as exc:
        return 127, "", f"{type(exc).__name__}: {exc}"
    with proc:
        try:
            stdout, stderr = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            return None, stdout, stderr
    return proc.returncode, stdout, stderr


def step_error(name: str, rc: int | None, stdout: str, stderr: str, limit: float) -> str | None:
    """Why a step failed, in one line: the exception of a traceback on stderr,
    a time-out or the exit code with the last line of output; None if it passed."""
    if rc is None:
        return f"{name}: timed out after {limit:.0f} s"
    exception = last_exception(stderr)
    if exception is not None:
        return exception
    if rc != 0:
        return f"{name}: exit code {rc}: {last_line(stderr) or last_line(stdout)}"
    return None


def last_exception(text: str) -> str | None:
    """The line that ends the last traceback in ``text`` (``ModuleNotFoundError: ...``)."""
    start = text.rfind(TRACEBACK)
    if start < 0:
        return None
    lines = [line for line in text[start:].splitlines()[1:] if line.strip()]
    ends = [line for line in lines if not line[0].isspace()]
    return ends[0] if ends else TRACEBACK


def last_line(text: str) -> str:
    """The last non-empty line of ``text``, stripped ("" if none)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


# -- dependencies ------------------------------------------------------------------------------


def read_dependencies(pyproject: Path) -> list[str]:
    """``[project].dependencies`` of ``pyproject``, as requirement strings."""
    text = pyproject.read_text()
    if tomllib is None:
        return dependencies_without_tomllib(text)
    return list(tomllib.loads(text).get("project", {}).get("dependencies", []))


def dependencies_without_tomllib(text: str) -> list[str]:
    """``[project].dependencies`` by a plain scan of the TOML text (Python 3.10)."""
    section = re.search(r"^\[project\][ \t]*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    array = section and re.search(
        r"^dependencies\s*=\s*\[(.*?)\][ \t]*(#.*)?$", section.group(1), re.M | re.S
    )
    return re.findall(r"[\"']([^\"']+)[\"']", array.group(1)) if array else []


def requirement_name(requirement: str) -> str:
    """The distribution name of a requirement string (``torch>=2.4`` -> ``torch``)."""
    found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if found is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return found.group(1)


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def missing_dependencies(
    requirements: Sequence[str], path: Sequence[str] | None = None
) -> list[str]:
    """The requirements whose distribution is not installed on ``path`` (default sys.path)."""
    search = list(sys.path if path is None else path)
    return [
        requirement
        for requirement in requirements
        if not any(
            importlib.metadata.distributions(name=requirement_name(requirement), path=search)
        )
    ]


def wheels_for(name: str, folder: Path) -> list[Path]:
    """The wheels in ``folder`` of the distribution ``name``."""
    if not folder.is_dir():
        return []
    return sorted(
        wheel
        for wheel in folder.glob("*.whl")
        if normalize(wheel.name.split("-")[0]) == normalize(name)
    )


def install(check: Check, wheels: Path) -> Step:
    """Install the missing runtime dependencies from ``wheels`` only, into ``check.deps``."""
    shutil.rmtree(check.deps, ignore_errors=True)
    missing = missing_dependencies(read_dependencies(check.root / "pyproject.toml"))
    if not missing:
        return check.record(Step("install", True, details={"missing": []}))
    for requirement in missing:
        name = requirement_name(requirement)
        if not wheels_for(name, wheels):
            error = (
                f"{name} is not installed and {wheels} has no wheel of it "
                f"(bring one: pip download --no-deps -d {wheels} '{requirement}')"
            )
            return check.record(Step("install", False, error, details={"missing": missing}))
    check.deps.mkdir(parents=True)
    step = pip_install(check, missing, wheels) if has_pip() else unpack(check, missing, wheels)
    step.details["missing"] = missing
    return step


def has_pip() -> bool:
    """Whether this Python has pip (a system Python may come without it)."""
    return importlib.util.find_spec("pip") is not None


def pip_install(check: Check, requirements: list[str], wheels: Path) -> Step:
    """``pip install --no-index --no-deps --target``: no network, no system site-packages
    (so PEP 668 allows it), and no pip configuration or PIP_* variable adding indexes."""
    env = {key: value for key, value in check.env.items() if not key.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    cmd = [sys.executable, "-m", "pip", "--isolated", "install", "-q", "--no-index"]
    cmd += ["--find-links", str(wheels), "--no-deps", "--only-binary", ":all:"]
    cmd += ["--target", str(check.deps), *requirements]
    return check.run("install", cmd, LIMITS["install"], env)


def unpack(check: Check, requirements: list[str], wheels: Path) -> Step:
    """Without pip: unzip the newest wheel of each requirement into ``check.deps``
    (what pip does for a pure-Python wheel, less the version check)."""
    start = time.perf_counter()
    chosen = [max(wheels_for(requirement_name(r), wheels), key=wheel_version) for r in requirements]
    for wheel in chosen:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(check.deps)
    seconds = round(time.perf_counter() - start, 1)
    details = {"unpacked without pip": [wheel.name for wheel in chosen]}
    return check.record(Step("install", True, seconds=seconds, details=details))


def wheel_version(wheel: Path) -> tuple[int, ...]:
    """The numbers of a wheel's version, to pick the newest (``x-1.10.0-...`` -> (1, 10, 0))."""
    return tuple(int(part) for part in re.findall(r"\d+", wheel.name.split("-")[1]))


# -- the steps after install -------------------------------------------------------------------


def json_line(stdout: str) -> Any:
    """The JSON value on the last line of ``stdout``, or None if there is none."""
    try:
        return json.loads(last_line(stdout))
    except json.JSONDecodeError:
        return None


def parse_probe(stdout: str) -> dict[str, str | None] | None:
    """The probe's ``{"cuda": reason, "cpu": reason}``, or None if malformed."""
    reasons = json_line(stdout)
    valid = (
        isinstance(reasons, dict)
        and set(reasons) == {"cuda", "cpu"}
        and all(value is None or isinstance(value, str) for value in reasons.values())
    )
    return reasons if valid else None


def probe(check: Check, dry_run: bool) -> dict[str, str | None] | None:
    """Why "cuda" and "cpu" are unusable (None: usable); None if the probe itself broke.

    On a GPU run an unusable GPU fails this step; the dry run expects it."""
    step = check.run("probe", [sys.executable, "-c", PROBE], LIMITS["probe"])
    if not step.ok:
        return None
    reasons = parse_probe(step.stdout)
    if reasons is None:
        check.fail(step, f"probe: no reasons as JSON on stdout: {last_line(step.stdout)!r}")
        return None
    step.details = dict(reasons)
    if reasons["cpu"] is not None:
        check.fail(step, f"host backend unusable: {reasons['cpu']}")
    elif reasons["cuda"] is not None and not dry_run:
        check.fail(step, f"no usable GPU: {reasons['cuda']}")
    return reasons


def machine(check: Check) -> Step:
    """The device, driver and versions: torch's view, then nvidia-smi's when present."""
    step = check.run("machine", [sys.executable, "-c", MACHINE], LIMITS["machine"])
    info = json_line(step.stdout) if step.ok else None
    if step.ok and not isinstance(info, dict):
        check.fail(step, f"machine: no JSON on stdout: {last_line(step.stdout)!r}")
    step.details = info if isinstance(info, dict) else {}
    smi = shutil.which("nvidia-smi")
    if smi is None:
        step.details["nvidia-smi"] = "not on PATH"
        return step
    query = ["--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    rc, stdout, stderr = execute([smi, *query], check.root, check.env, 30)
    step.details["nvidia-smi"] = stdout.strip() if rc == 0 else f"rc={rc}: {last_line(stderr)}"
    if rc != 0 and step.ok:
        check.fail(step, f"machine: nvidia-smi failed: {step.details['nvidia-smi']}")
    return step


def junit_counts(path: Path) -> dict[str, int]:
    """tests/failures/errors/skipped from pytest's JUnit XML ({} if absent)."""
    if not path.exists():
        return {}
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    return {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}


def failed_tests(log: str) -> list[str]:
    """The test ids pytest's verbose lines mark FAILED or ERROR, in order, once
    each: what a step killed at its time limit (no JUnit XML yet) still names."""
    failed: dict[str, None] = {}
    for line in log.splitlines():
        if re.search(r"\b(FAILED|ERROR)\b", line):
            failed.update(dict.fromkeys(re.findall(r"tests/\S+::\S+", line)))
    return list(failed)


def pytest_step(
    check: Check, name: str, selection: str, paths: list[str], workers: int, limit: float
) -> Step:
    """pytest as step ``name`` within ``limit`` seconds, verbose (a line per
    test, so a killed run still names its failures), on ``workers`` processes
    where more than one is asked for and pytest-xdist is installed, each
    test stopped after TEST_LIMIT_S where pytest-timeout is. The JUnit XML
    goes to <out>/<name>.xml."""
    junit = check.out / f"{name}.xml"
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider"]
    cmd += [f"--junitxml={junit}", "-k", selection, *paths]
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(workers)]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += [f"--timeout={TEST_LIMIT_S}"]
    step = check.run(name, cmd, limit)
    step.details = {"selection": selection, **junit_counts(junit)}
    failed = failed_tests(step.stdout)
    if failed:
        step.details["failed"] = failed[:MAX_NAMED]
    return step


def tests(check: Check, dry_run: bool) -> None:
    """The suite less the simulated backends (CPU CI's): tests/test_gpu.py
    first, alone and one test at a time, since it reads the device's free
    memory; then the rest on up to 8 processes. On a GPU the host backend's
    cases of device-parametrized tests are left out (CI runs them; the lent
    minutes go to cuda); the dry run runs them instead, less
    tests/test_demo.py (minutes on 2 cores), on one process, within
    DRY_RUN_TESTS_S."""
    selection = f"{SELECTION} and not demo" if dry_run else f"{SELECTION} and not cpu"
    pytest_step(check, "gpu-tests", selection, [GPU_TESTS], 1, LIMITS["gpu-tests"])
    workers = 1 if dry_run else min(8, os.cpu_count() or 1)
    limit = DRY_RUN_TESTS_S if dry_run else LIMITS["tests"]
    pytest_step(check, "tests", selection, ["tests", f"--ignore={GPU_TESTS}"], workers, limit)


def bench(check: Check, device: str | None) -> Step:
    """``extensible_kv.cli bench`` on ``device`` (``--quick`` on the host) into <out>/bench."""
    if device is None:
        return check.record(Step("bench", None, details={"skipped": "no usable GPU"}))
    folder = check.out / "bench"
    cmd = [sys.executable, "-m", "extensible_kv.cli", "bench", "--device", device]
    cmd += ["--out", str(folder), *(["--quick"] if device == "cpu" else [])]
    step = check.run("bench", cmd, LIMITS["bench"])
    results = folder / "results.json"
    step.details["results"] = str(results.relative_to(check.out)) if results.exists() else None
    if step.ok and not results.exists():
        check.fail(step, f"bench: no {results}")
    return step


def memcheck(check: Check, skipped: str | None) -> Step:
    """One pass of the grow/sleep/wake example under compute-sanitizer's memcheck."""
    sanitizer = shutil.which("compute-sanitizer")
    if skipped is None and sanitizer is None:
        skipped = "compute-sanitizer not on PATH"
    if skipped is not None or sanitizer is None:
        return check.record(Step("memcheck", None, details={"skipped": skipped}))
    # API errors are left to our own code, which raises on every failing
    # driver call. cuda-bindings resolves the driver's entry points with
    # cuGetProcAddress when it loads, and memcheck reports each one the driver
    # lacks as an API error (34 with cuda-bindings 13.3.1 on driver 580, none
    # of them ours): with them reported the check could never pass.
    cmd = [sanitizer, "--tool", "memcheck", "--report-api-errors", "no"]
    cmd += ["--error-exitcode", "3", sys.executable]
    cmd += ["examples/grow_sleep_wake.py", "--device", "cuda", "--mib", "64", "--steps", "4"]
    step = check.run("memcheck", cmd, LIMITS["memcheck"])
    found = re.search(r"ERROR SUMMARY: (\d+) error", (check.out / "memcheck.log").read_text())
    step.details["errors"] = int(found.group(1)) if found else None
    if step.rc is not None and step.details["errors"] != 0:
        check.fail(step, f"memcheck: {found.group(0) if found else 'no ERROR SUMMARY'}")
    return step


def run_steps(check: Check, wheels: Path, dry_run: bool) -> None:
    """Every step in order; a failed install or import, or a broken probe, stops the check."""
    if install(check, wheels).ok is False:
        return
    if not check.run("import", [sys.executable, "-c", "import extensible_kv"], LIMITS["import"]).ok:
        return
    reasons = probe(check, dry_run)
    if reasons is None:
        return
    machine(check)
    tests(check, dry_run)
    gpu = not dry_run and reasons["cuda"] is None
    bench(check, "cpu" if dry_run else "cuda" if gpu else None)
    memcheck(check, "CPU dry run" if dry_run else None if gpu else "no usable GPU")


# -- summary and command line ------------------------------------------------------------------


def summarize(check: Check, dry_run: bool, started: float) -> tuple[dict[str, Any], str]:
    """summary.json's data and summary.md's text, whose first line is the verdict or
    the first error."""
    failed = [step for step in check.steps if step.ok is False]
    mode = "CPU dry run" if dry_run else "GPU check"
    seconds = round(time.perf_counter() - started, 1)
    ran = sum(step.ok is not None for step in check.steps)
    first_error = (failed[0].error or f"{failed[0].name} failed") if failed else None
    summary: dict[str, Any] = {
        "ok": not failed,
        "first_error": first_error,
        "mode": mode,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "seconds": seconds,
        "python": sys.executable,
        "pythonpath": check.env["PYTHONPATH"],
        "steps": {step.name: step.as_json() for step in check.steps},
    }
    verdict = first_error or f"ok: {mode}, {ran} steps passed in {seconds} s"
    lines = [verdict, "", f"# {mode}, {summary['date']}", ""]
    lines.append(f"- python `{sys.executable}`, PYTHONPATH `{summary['pythonpath']}`")
    lines += [f"- {s.name}: `{json.dumps(s.details)}`" for s in check.steps if s.name in INFO]
    lines += ["", "| step | result | seconds | notes |", "| --- | --- | --- | --- |"]
    for step in check.steps:
        result = {True: "ok", False: "**FAILED**", None: "skipped"}[step.ok]
        details = json.dumps(step.details) if step.details and step.name not in INFO else ""
        notes = (step.error or details).replace("|", "\\|")
        lines.append(f"| {step.name} | {result} | {step.seconds} | {notes} |")
    for step in check.steps:
        if named := step.details.get("failed"):
            lines += ["", f"{step.name}, failed:", *(f"- `{t}`" for t in named)]
    lines += ["", f"ok: {str(not failed).lower()}, {seconds} s in all"]
    return summary, "\n".join(lines) + "\n"


def step_env(root: Path, deps: Path, dry_run: bool = False) -> dict[str, str]:
    """This environment with the sources and the deps folder first on PYTHONPATH;
    the dry run hides any GPU, so that the tests run on the host only."""
    paths = [str(root / "src"), str(deps), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "HYPOTHESIS_PROFILE": "gpu-check", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(path for path in paths if path)
    if dry_run:
        env |= {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
    return env


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see the module's docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--wheels",
        type=Path,
        default=None,
        help="wheel folder for missing dependencies (default: .whl/ in the project)",
    )
    default_out = (
        Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench-results" / "gpu"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=default_out,
        help="output folder (default: $OUT, else bench-results/gpu)",
    )
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help=f"the same steps on a machine without a GPU (its tests step on one process, "
        f"within {DRY_RUN_TESTS_S} s; deadline {DRY_RUN_DEADLINE_S} s)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, root: Path = ROOT) -> int:
    """Run the check on the project at ``root``; 0 iff every step that ran passed."""
    started = time.perf_counter()
    args = parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    wheels = (args.wheels or root / ".whl").resolve()
    deadline = started + (DRY_RUN_DEADLINE_S if args.cpu_dry_run else DEADLINE_S)
    check = Check(root, out, step_env(root, out / "deps", args.cpu_dry_run), deadline)
    run_steps(check, wheels, args.cpu_dry_run)
    summary, text = summarize(check, args.cpu_dry_run, started)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(text)
    print(text, end="", flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
