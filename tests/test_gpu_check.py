"""scripts/gpu_check.py, the prepared GPU check, on small made-up projects.

Each test runs the check (or one of its parts) against a project written
into a temporary folder: a pyproject.toml with its dependencies, an
``extensible_kv`` package that imports fine or not, and a wheel folder
with or without the wheel a dependency needs. No network, a few seconds.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_check = _load_script()

DEP = "gpu-check-demo-dep"
WORKING = """
import gpu_check_demo_dep  # from the wheel folder

def unavailable_reason(device):
    return "no GPU in this test" if str(device).startswith("cuda") else None
"""
CLI = """
import argparse, json, pathlib
parser = argparse.ArgumentParser()
parser.add_argument("command")
parser.add_argument("--device")
parser.add_argument("--out", type=pathlib.Path)
parser.add_argument("--quick", action="store_true")
args = parser.parse_args()
args.out.mkdir(parents=True, exist_ok=True)
(args.out / "results.json").write_text(json.dumps(vars(args), default=str))
"""


def make_project(root: Path, init: str, dependencies: list[str]) -> Path:
    """A project at ``root`` whose ``extensible_kv/__init__.py`` is ``init``."""
    package = root / "src" / "extensible_kv"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(init)
    (package / "cli.py").write_text(CLI)
    (root / "tests").mkdir()
    (root / "tests" / "test_host.py").write_text("def test_host():\n    assert True\n")
    (root / "tests" / "test_gpu.py").write_text("def test_device():\n    assert True\n")
    (root / "pyproject.toml").write_text(
        f'[project]\nname = "made-up"\ndependencies = {json.dumps(dependencies)}\n'
    )
    return root


def make_wheel(folder: Path, version: str = "1.0") -> Path:
    """A pure-Python wheel of DEP (module ``gpu_check_demo_dep``) in ``folder``."""
    folder.mkdir(exist_ok=True)
    info = f"gpu_check_demo_dep-{version}.dist-info"
    files = {
        "gpu_check_demo_dep.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {DEP}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    wheel = folder / f"gpu_check_demo_dep-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def run_check(
    project: Path, out: Path, wheels: Path, *extra: str
) -> tuple[int, dict[str, Any], str]:
    """The check's exit code, summary.json and summary.md."""
    argv = ["--wheels", str(wheels), "--out", str(out), *extra]
    rc = gpu_check.main(argv, root=project)
    summary = json.loads((out / "summary.json").read_text())
    return rc, summary, (out / "summary.md").read_text()


def test_reads_the_projects_dependencies_with_or_without_tomllib() -> None:
    pyproject = ROOT / "pyproject.toml"
    requirements = gpu_check.read_dependencies(pyproject)
    assert "ctypes-dlpack" in [gpu_check.requirement_name(r) for r in requirements]
    assert gpu_check.dependencies_without_tomllib(pyproject.read_text()) == requirements
    text = '[tool.x]\ndependencies = ["no"]\n[project]\ndependencies = ["a[b]>=1", "c"]  # x\n'
    assert gpu_check.dependencies_without_tomllib(text) == ["a[b]>=1", "c"]


def test_missing_dependencies_are_those_not_installed(tmp_path: Path) -> None:
    wanted = ["pytest>=8", f"{DEP}>=1"]
    assert gpu_check.missing_dependencies(wanted) == [f"{DEP}>=1"]
    with zipfile.ZipFile(make_wheel(tmp_path / "wheels")) as archive:
        archive.extractall(tmp_path / "site")
    assert gpu_check.missing_dependencies(wanted, [str(tmp_path / "site")]) == ["pytest>=8"]


def test_dry_run_installs_the_missing_dependency_from_the_wheel_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = make_project(tmp_path / "project", WORKING, ["pytest", f"{DEP}>=1"])
    out = tmp_path / "out"
    wheels = make_wheel(tmp_path / "wheels").parent
    rc, summary, text = run_check(project, out, wheels, "--cpu-dry-run")
    steps = summary["steps"]
    assert rc == 0, text
    assert summary["ok"] is True
    names = ["install", "import", "probe", "machine", "gpu-tests", "tests", "bench", "memcheck"]
    assert list(steps) == names
    assert steps["gpu-tests"]["details"]["tests"] == 1
    assert (out / "deps" / "gpu_check_demo_dep.py").exists()
    assert steps["install"]["details"]["missing"] == [f"{DEP}>=1"]
    assert steps["probe"]["details"] == {"cuda": "no GPU in this test", "cpu": None}
    assert steps["tests"]["details"]["tests"] == 1
    assert json.loads((out / "bench" / "results.json").read_text())["quick"] is True
    assert steps["memcheck"]["ok"] is None
    assert text.startswith("ok: CPU dry run")
    assert capsys.readouterr().out == text


def test_failed_tests_are_named_even_from_a_run_cut_short() -> None:
    log = "\n".join(
        [
            "tests/test_a.py::test_one[cuda] PASSED  [ 10%]",
            "tests/test_a.py::test_two[cuda] FAILED  [ 20%]",
            "[gw3] [ 30%] ERROR tests/test_b.py::test_three ",
            "[gw1] [ 40%] FAILED tests/test_a.py::test_two[cuda] ",
            "[gw2] [ 50%] PASSED tests/test_c.py::test_errors_are_named ",
        ]
    )
    named = ["tests/test_a.py::test_two[cuda]", "tests/test_b.py::test_three"]
    assert gpu_check.failed_tests(log) == named


def test_a_failing_test_fails_the_check_and_is_named_in_the_summary(tmp_path: Path) -> None:
    project = make_project(tmp_path / "project", WORKING, [f"{DEP}>=1"])
    failing = "def test_broken():\n    assert False\n"
    (project / "tests" / "test_broken.py").write_text(failing)
    wheels = make_wheel(tmp_path / "wheels").parent
    rc, summary, text = run_check(project, tmp_path / "out", wheels, "--cpu-dry-run")
    assert rc == 1
    assert summary["steps"]["gpu-tests"]["ok"] is True
    assert summary["steps"]["tests"]["details"]["failed"] == ["tests/test_broken.py::test_broken"]
    assert "tests, failed:\n- `tests/test_broken.py::test_broken`" in text


def test_a_missing_wheel_stops_the_check_naming_package_and_folder(tmp_path: Path) -> None:
    project = make_project(tmp_path / "project", WORKING, [f"{DEP}>=1"])
    wheels = tmp_path / "no-wheels"
    rc, summary, text = run_check(project, tmp_path / "out", wheels, "--cpu-dry-run")
    assert rc == 1
    assert summary["ok"] is False
    assert list(summary["steps"]) == ["install"]
    first = text.splitlines()[0]
    assert first == summary["first_error"]
    assert DEP in first
    assert str(wheels) in first


def test_an_import_error_stops_the_check_and_is_the_first_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = make_project(tmp_path / "project", "import gpu_check_hidden_module\n", ["pytest"])
    rc, summary, text = run_check(project, tmp_path / "out", tmp_path, "--cpu-dry-run")
    error = "ModuleNotFoundError: No module named 'gpu_check_hidden_module'"
    assert rc == 1
    assert summary["ok"] is False
    assert list(summary["steps"]) == ["install", "import"]
    assert text.splitlines()[0] == error == summary["first_error"]
    assert capsys.readouterr().out.splitlines()[0] == error


@pytest.mark.parametrize(
    ("init", "error"),
    [
        ("def unavailable_reason(device):\n    raise OSError('probe broke')\n", "OSError"),
        ("def unavailable_reason(device):\n    return 7\n", "probe: no reasons as JSON"),
        ("import sys\ndef unavailable_reason(device):\n    sys.exit(2)\n", "exit code 2"),
    ],
    ids=["raises", "not-json", "exits"],
)
def test_a_broken_probe_is_not_a_usable_gpu(tmp_path: Path, init: str, error: str) -> None:
    project = make_project(tmp_path / "project", init, [])
    rc, summary, text = run_check(project, tmp_path / "out", tmp_path)
    assert rc == 1
    assert summary["ok"] is False
    assert list(summary["steps"]) == ["install", "import", "probe"]
    assert error in text.splitlines()[0]


def test_a_gpu_check_without_a_usable_gpu_fails(tmp_path: Path) -> None:
    project = make_project(tmp_path / "project", WORKING, [f"{DEP}>=1"])
    wheels = make_wheel(tmp_path / "wheels").parent
    rc, summary, text = run_check(project, tmp_path / "out", wheels)
    steps = summary["steps"]
    assert rc == 1
    assert text.splitlines()[0] == "no usable GPU: no GPU in this test"
    assert steps["tests"]["ok"] is True  # the host tests still run
    assert steps["bench"]["ok"] is None
    assert steps["memcheck"]["details"] == {"skipped": "no usable GPU"}


def test_parse_probe_takes_only_well_formed_reasons() -> None:
    good = '{"cuda": null, "cpu": "no memfd"}'
    assert gpu_check.parse_probe(f"noise\n{good}\n") == {"cuda": None, "cpu": "no memfd"}
    for bad in ("", "ok", "[]", '{"cuda": null}', '{"cuda": 1, "cpu": null}'):
        assert gpu_check.parse_probe(bad) is None, bad


def make_check(tmp_path: Path, deadline_s: float = 60) -> Any:
    """A Check on ``tmp_path`` whose deadline is ``deadline_s`` from now."""
    env = gpu_check.step_env(tmp_path, tmp_path / "deps")
    return gpu_check.Check(tmp_path, tmp_path, env, time.perf_counter() + deadline_s)


@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("import gpu_check_hidden_module", "ModuleNotFoundError: No module named"),
        ("import sys; sys.exit(4)", "step: exit code 4: "),
        (
            "import threading; t = threading.Thread(target=lambda: 1 / 0); t.start(); t.join()",
            "ZeroDivisionError: division by zero",
        ),
    ],
    ids=["import-error", "exit-code", "thread-traceback"],
)
def test_a_step_fails_on_its_exit_code_or_a_traceback_on_stderr(
    tmp_path: Path, code: str, error: str
) -> None:
    step = make_check(tmp_path).run("step", [sys.executable, "-c", code], 1)
    assert step.ok is False
    assert step.error.startswith(error)
    assert (tmp_path / "step.log").exists()


def test_a_timed_out_step_is_killed_with_its_children(tmp_path: Path) -> None:
    sleep = "import time; time.sleep(30)"
    sleeper = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {sleep!r}])"
    start = time.perf_counter()
    step = make_check(tmp_path).run("step", [sys.executable, "-c", sleeper], 1)
    assert time.perf_counter() - start < 10  # the grandchild holds the pipes until killed
    assert step.ok is False
    assert step.error == "step: timed out after 1 s"


def test_only_the_wheel_folder_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    newer = make_wheel(tmp_path / "elsewhere", "2.0").parent
    (tmp_path / "pip.conf").write_text(f"[global]\nfind-links = {newer}\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(tmp_path / "pip.conf"))
    monkeypatch.setenv("PIP_FIND_LINKS", str(newer))
    make_wheel(tmp_path / "wheels", "1.0")
    project = make_project(tmp_path / "project", WORKING, [f"{DEP}>=1"])
    check = make_check(project)
    assert gpu_check.install(check, tmp_path / "wheels").ok is True
    assert "'1.0'" in (check.deps / "gpu_check_demo_dep.py").read_text()


def test_no_step_starts_near_the_deadline(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    cmd = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    step = make_check(tmp_path, gpu_check.MIN_START_S - 1).run("late", cmd, 10)
    assert step.ok is False
    assert "not started" in step.error
    assert not marker.exists()


def test_without_pip_the_wheel_is_unpacked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "has_pip", lambda: False)
    make_wheel(tmp_path / "wheels", "1.2")
    make_wheel(tmp_path / "wheels", "1.10")
    project = make_project(tmp_path / "project", WORKING, [f"{DEP}>=1"])
    check = make_check(project)
    step = gpu_check.install(check, tmp_path / "wheels")
    assert step.ok is True
    assert "1.10" in (check.deps / "gpu_check_demo_dep.py").read_text()
    found = subprocess.run(
        [sys.executable, "-c", "import extensible_kv, gpu_check_demo_dep"],
        env=check.env,
        check=False,
    )
    assert found.returncode == 0


def _tests_step_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> float:
    """The seconds the check gives its tests step (after the deadline's cut),
    on a made-up project."""
    limits = []
    execute = gpu_check.execute

    def recorded(cmd: list[str], cwd: Path, env: dict[str, str], limit: float) -> Any:
        if f"--junitxml={tmp_path / 'out' / 'tests.xml'}" in cmd:
            limits.append(limit)
        return execute(cmd, cwd, env, limit)

    monkeypatch.setattr(gpu_check, "execute", recorded)
    project = make_project(tmp_path / "project", WORKING, [f"{DEP}>=1"])
    run_check(project, tmp_path / "out", make_wheel(tmp_path / "wheels").parent, *extra)
    (limit,) = limits
    return limit


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "gpu"])
def test_the_dry_runs_tests_step_has_its_own_limit_and_a_lease_keeps_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dry_run: bool
) -> None:
    extra = ["--cpu-dry-run"] if dry_run else []
    expected = gpu_check.DRY_RUN_TESTS_S if dry_run else gpu_check.LIMITS["tests"]
    assert _tests_step_limit(tmp_path, monkeypatch, *extra) == expected
