"""vLLM's OpenAI server in a process of its own, for the tests: started on
a free local port, driven over HTTP, stopped with its engine processes.

The server runs as users run it on vLLM's CPU build (``vllm serve`` fails
there on the distribution's name): ``python -m
vllm.entrypoints.openai.api_server``, in a session of its own so that one
signal to its process group stops the engine core and workers too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import psutil

from extensible_kv.bench.child import prompt

WORKER = "extensible_kv.integrations.vllm.ExtensibleKVWorker"
SCHEDULER = "extensible_kv.integrations.vllm.ExtensibleKVScheduler"
MiB = 1 << 20
#: Seconds a server may take to answer /health after its start.
START_S = 300
#: Seconds any one HTTP request may take.
REQUEST_S = 120


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def token_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """``count`` token prompts of different lengths (no tokenizer needed)."""
    return [prompt(10 * seed + i, 60 + 37 * i) for i in range(count)]


class Server:
    """One OpenAI server; ``flags`` follow the common ones (a tiny fp32
    model, 128 MiB of KV cache, blocks of 32, prefix caching)."""

    def __init__(self, model: str, flags: list[str], env: dict[str, str] | None = None) -> None:
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                *("--model", model, "--host", "127.0.0.1", "--port", str(self.port)),
                *("--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32"),
                *("--max-model-len", "512", "--block-size", "32", "--enable-prefix-caching"),
                *("--kv-cache-memory-bytes", str(128 * MiB), *flags),
            ],
            env={
                **os.environ,
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "VLLM_CPU_CI_ENV": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "VLLM_SERVER_DEV_MODE": "1",
                **(env or {}),
            },
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            start_new_session=True,
        )

    # -- life ------------------------------------------------------------------------

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def wait_healthy(self) -> Server:
        deadline = time.monotonic() + START_S
        while True:
            assert self.process.poll() is None, self.stderr()[-4000:]
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=1).close()
                return self
            except OSError:
                assert time.monotonic() < deadline, f"no /health in {START_S} s"
                time.sleep(0.5)

    def wait_exit(self, timeout_s: float) -> int:
        """The server's exit status, waited for at most ``timeout_s``."""
        return self.process.wait(timeout=timeout_s)

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 60 s."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=60)
        self._stderr.close()

    def __enter__(self) -> Server:
        return self.wait_healthy()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- HTTP ------------------------------------------------------------------------

    def request(
        self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None
    ) -> bytes:
        url = f"{self.url}{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            url, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_S) as response:
                payload: bytes = response.read()
                return payload
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{method} {path}: {exc.code} {exc.read()[:2000]!r}") from None

    def get(self, path: str) -> Any:
        return json.loads(self.request("GET", path))

    def post(self, path: str, body: Any = None, **query: Any) -> Any:
        pairs = [
            (key, str(each))
            for key, value in query.items()
            for each in (value if isinstance(value, list) else [value])
        ]
        payload = self.request("POST", path, body, pairs)
        return json.loads(payload) if payload else None

    def completion(self, prompts: list[list[int]], max_tokens: int = 8) -> dict[str, Any]:
        """vLLM's answer to greedy completions of token prompts."""
        body = {
            "model": self.model,
            "prompt": prompts,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        answer: dict[str, Any] = self.post("/v1/completions", body)
        return answer

    def complete(self, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
        """Greedy completions of token prompts; their tokens, in order."""
        choices = self.completion(prompts, max_tokens)["choices"]
        return [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])]

    def complete_later(self, prompts: list[list[int]], max_tokens: int = 8) -> Pending:
        """:meth:`complete` on a thread of its own."""
        return Pending(lambda: self.complete(prompts, max_tokens))

    def stream_later(self, prompt: list[int], max_tokens: int) -> Streaming:
        """One greedy completion streamed on a thread of its own."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
        }
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        return Streaming(request)

    def rpc(self, method: str, **kwargs: Any) -> list[Any]:
        """A worker method on every worker (``POST /collective_rpc``)."""
        answer = self.post("/collective_rpc", {"method": method, "kwargs": kwargs})
        results: list[Any] = [] if answer is None else answer["results"]
        return results

    def state(self) -> list[dict[str, Any]]:
        """Every worker's ``extensible_kv_state``."""
        return self.rpc("extensible_kv_state")

    def rss(self) -> int:
        """Resident bytes of the server and every process under it."""
        root = psutil.Process(self.process.pid)
        total = 0
        for process in [root, *root.children(recursive=True)]:
            try:
                total += process.memory_info().rss
            except psutil.Error:
                continue
        return total

    def children(self) -> list[int]:
        return [p.pid for p in psutil.Process(self.process.pid).children(recursive=True)]


class Pending:
    """A call running on a thread; :meth:`result` waits for it (bounded)."""

    def __init__(self, call: Any) -> None:
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call: Any) -> None:
        try:
            self._result = call()
        except BaseException as exc:  # raised again in result()
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout_s: float = REQUEST_S) -> Any:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"no answer in {timeout_s} s"
        if self._error is not None:
            raise self._error
        return self._result


class Streaming(Pending):
    """A streamed completion; :attr:`started` is set once its first tokens
    have come, and :meth:`result` is every token."""

    def __init__(self, request: urllib.request.Request) -> None:
        self.started = threading.Event()
        super().__init__(lambda: self._read(request))

    def _read(self, request: urllib.request.Request) -> list[int]:
        tokens: list[int] = []
        with urllib.request.urlopen(request, timeout=REQUEST_S) as response:
            for line in response:
                data = line.decode().strip().removeprefix("data: ")
                if not data or data == "[DONE]":
                    continue
                (choice,) = json.loads(data)["choices"]
                tokens.extend(choice.get("token_ids") or ())
                if tokens:
                    self.started.set()
        return tokens
