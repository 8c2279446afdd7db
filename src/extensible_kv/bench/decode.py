"""Decode, side by side: stock vLLM and ours alive at once, passes alternated.

One engine of each kind runs in a process of its own (none inherits
another's memory) and waits for orders on its standard input. The parent
asks each in turn, in a rotating order, for one short decode pass (8
sequences of :data:`PROMPT_TOKENS` prompt tokens, prefix-cached after the
warm-up, and :data:`DECODE_TOKENS` new tokens: about a tenth of a second).

Why short passes, many of them: a shared 2-core VM's speed wanders by up to
1.5x from one second to the next (a plain Python loop shows it), so two
engines' one-second passes disagree by as much whatever their code. Passes
a tenth of a second long, alternated, run in the same spell of the machine;
the ratio of neighbouring passes is then the engines' difference, and the
median of hundreds of them, with its interval, can settle a goal
(:mod:`extensible_kv.bench.ratios`).
"""

from __future__ import annotations

import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import IO, Any

from extensible_kv.bench.child import KINDS, make_engine, quiet_vllm_cpu
from extensible_kv.bench.ratios import ratio_figures

#: Prompt tokens and new tokens per sequence in a pass: each decode step
#: reads 8 x 256-288 tokens of KV cache.
PROMPT_TOKENS = 256
DECODE_TOKENS = 32
#: Seconds an engine may take to start, and a pass to run.
START_TIMEOUT_S = 300.0
PASS_TIMEOUT_S = 120.0


def passes_for(rounds: int) -> int:
    """Decode passes per kind for a suite of ``rounds`` rounds."""
    return 60 * max(rounds, 1)


class _Engine:
    """One engine's process: orders on its stdin, answers on its stdout
    (a reader thread queues the lines, so every wait is bounded), its
    stderr in a file for the error message."""

    def __init__(self, kind: str, argv: list[str], stack: ExitStack) -> None:
        self.kind = kind
        # Closed by ``stack``, with the process.
        self._stderr = stack.enter_context(tempfile.TemporaryFile("w+"))  # noqa: SIM115
        self._process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        stack.callback(self.stop)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def answer(self, prefix: str, timeout_s: float) -> str:
        """The rest of the next stdout line starting with ``prefix``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise TimeoutError(
                    f"the {self.kind} engine gave no {prefix!r} line in {timeout_s} s"
                ) from None
            if line is None:
                raise RuntimeError(f"the {self.kind} engine stopped:\n{self._tail()}")
            if line.startswith(prefix):
                return line.removeprefix(prefix).strip()

    def ask(self, order: str) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write(order + "\n")
        self._process.stdin.flush()

    def _tail(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-4000:]

    def stop(self) -> None:
        """Close its stdin (it exits), or kill it after 30 s."""
        if self._process.stdin is not None and not self._process.stdin.closed:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=30)


@contextmanager
def _engines(model: str, kinds: Sequence[str], kv_bytes: int) -> Iterator[list[_Engine]]:
    """An engine of each kind, started one after the other (so that starts
    do not share the cores), each ready to decode; all stopped on exit."""
    with ExitStack() as stack:
        engines = []
        for kind in kinds:
            argv = [sys.executable, "-m", __name__, model, kind, str(kv_bytes)]
            engine = _Engine(kind, argv, stack)
            engine.answer("READY", START_TIMEOUT_S)
            engines.append(engine)
        yield engines


def decode_case(
    model: str,
    kinds: Sequence[str],
    kv_bytes: int,
    passes: int,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """``passes`` decode passes of each kind, alternated (the first kind is
    stock): tok/s per kind, pass by pass, and each other kind's
    :func:`~extensible_kv.bench.ratios.ratio_figures` against the first."""
    tok_s: dict[str, list[float]] = {kind: [] for kind in kinds}
    with _engines(model, kinds, kv_bytes) as engines:
        for i in range(passes):
            progress(f"decode pass {i + 1}/{passes}")
            turn = engines[i % len(engines) :] + engines[: i % len(engines)]
            for engine in turn:
                engine.ask("pass")
                tok_s[engine.kind].append(float(engine.answer("PASS", PASS_TIMEOUT_S)))
    stock, *ours = kinds
    return {
        "passes": passes,
        "tok_s": tok_s,
        "ratios": {kind: ratio_figures(tok_s[kind], tok_s[stock]) for kind in ours},
    }


def serve(model: str, kind: str, kv_bytes: int, orders: IO[str]) -> None:
    """The engine side: start ``kind``, warm it, say ``READY``; then one
    decode pass per ``pass`` line of ``orders``, answered ``PASS <tok/s>``,
    until ``orders`` ends."""
    quiet_vllm_cpu(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    worker, options = KINDS[kind]
    llm = make_engine(model, worker, options, kv_bytes)
    prompts = [
        TokensPrompt(prompt_token_ids=[(5 * i + j) % 500 + 1 for j in range(PROMPT_TOKENS)])
        for i in range(8)
    ]
    params = SamplingParams(
        temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True, detokenize=False
    )
    llm.generate(prompts, params, use_tqdm=False)
    print("READY", flush=True)
    for order in orders:
        if order.strip() != "pass":
            raise SystemExit(f"unknown order {order.strip()!r}: the only order is 'pass'")
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        print(f"PASS {sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed}", flush=True)


def main() -> None:
    model, kind, kv_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    serve(model, kind, kv_bytes, sys.stdin)


if __name__ == "__main__":
    main()
