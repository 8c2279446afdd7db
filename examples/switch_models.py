"""Two engines in two processes share one device under a budget smaller than
their sum: one serves while the other sleeps, and they switch by sleep and
wake, as an RL framework switches between rollout and training or a service
between models.

    python examples/switch_models.py                  # vLLM where installed, else the demo decoder
    python examples/switch_models.py --engine demo    # our tiny paged-attention decoder
    python examples/switch_models.py --engine vllm --kv-mib 128

The device's limit (``extensible-kv limit``) counts what every process's KV
caches commit. A serves, then sleeps; B starts, serves and sleeps; A wakes
and serves again. Waking B while A holds the budget is refused cleanly (A
and B both stay usable), then waits for A's sleep when asked to. Every
serve's greedy tokens must equal the engine's first ones (and, for the demo
decoder, the same model's on ordinary torch memory). The run uses a state
directory of its own, so it leaves the machine's limits alone; watch it
with the ``extensible-kv top`` command it prints.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20


# -- the engines, each in a process of its own -------------------------------------


class DemoEngine:
    """The demo decoder (random weights, seeded) on a KV cache of ``kv_bytes``."""

    def __init__(self, seed: int, kv_bytes: int) -> None:
        import torch

        from extensible_kv.demo.flow import kv_cache_config
        from extensible_kv.demo.model import ModelConfig, TinyDecoder, eager_step, generate
        from extensible_kv.kv import KVSplitBackend, allocate_kv_cache

        self.torch, self.generate = torch, generate
        self.config = ModelConfig(seed=seed)
        self.model = TinyDecoder(self.config, torch.device("cpu"))
        spec = self.config.attention_spec()
        blocks = kv_bytes // (spec.page_size_bytes * self.config.layers)
        self.kv = allocate_kv_cache(kv_cache_config(self.config, blocks), KVSplitBackend, "cpu")
        self.kv.cache.commit(blocks)
        caches = [view for view in self.kv.views.values() if isinstance(view, torch.Tensor)]
        self.step = eager_step(self.model, caches)
        gen = torch.Generator().manual_seed(seed + 1)
        self.prompts = torch.randint(self.config.vocab, (4, 16), generator=gen).tolist()
        self.max_blocks = 3  # 16 prompt + 24 new tokens, 16 per block
        self.reference = self._serve_on_torch_memory()

    def _tokens(self, step: Any) -> list[list[int]]:
        return list(
            self.generate(
                step,
                self.prompts,
                24,
                block_size=self.config.block_size,
                max_blocks=self.max_blocks,
                device=self.torch.device("cpu"),
            )
        )

    def _serve_on_torch_memory(self) -> list[list[int]]:
        from extensible_kv.demo.model import eager_step

        c = self.config
        shape = (2, len(self.prompts) * self.max_blocks, c.block_size, c.kv_heads, c.head_size)
        caches = [self.torch.zeros(shape) for _ in range(c.layers)]
        return self._tokens(eager_step(self.model, caches))

    def serve(self) -> list[list[int]]:
        return self._tokens(self.step)

    def sleep(self) -> None:
        self.kv.cache.release_physical()

    def wake(self, wait_s: float) -> None:
        from extensible_kv import waiting_for_budget

        with waiting_for_budget(wait_s):
            self.kv.cache.recommit()


class VllmEngine:
    """A vLLM ``LLM`` on extensible-kv's worker (a tiny random model, made here)."""

    def __init__(self, seed: int, kv_bytes: int) -> None:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # share the cores
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # errors come back whole
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        from extensible_kv.demo.tiny_models import save_tiny_model

        arch = ("llama", "qwen3")[seed % 2]  # two different models
        where = Path(tempfile.gettempdir()) / f"extensible-kv-{arch}"
        self.llm = LLM(
            str(save_tiny_model(arch, where)),
            worker_cls="extensible_kv.integrations.vllm.ExtensibleKVWorker",
            skip_tokenizer_init=True,
            enforce_eager=True,
            max_model_len=256,
            kv_cache_memory_bytes=kv_bytes,
            seed=seed,
        )
        self.prompts = [TokensPrompt(prompt_token_ids=list(range(1, 9 + 7 * i))) for i in range(8)]
        self.params = SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True, detokenize=False
        )
        self.reference = self.serve()

    def serve(self) -> list[list[int]]:
        outputs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    def sleep(self) -> None:
        self.llm.sleep(level=1)  # resets vLLM's prefix cache; the KV memory goes back

    def wake(self, wait_s: float) -> None:
        # The worker's own wake takes the wait; vLLM's wake_up then finds the KV
        # cache awake and resumes the scheduler. A refused wake leaves vLLM
        # asleep (its sleeping tags stay), ready for the next try.
        self.llm.collective_rpc("wake_kv_cache", kwargs={"wait_s": wait_s})
        self.llm.wake_up()


def serve_forever(kind: str, seed: int, kv_bytes: int) -> None:
    """An engine process: JSON commands on stdin, one JSON answer per line."""
    from extensible_kv import BudgetExceededError

    started = time.perf_counter()
    engine: DemoEngine | VllmEngine = (DemoEngine if kind == "demo" else VllmEngine)(seed, kv_bytes)
    _answer({"ok": True, "seconds": time.perf_counter() - started, "tokens": engine.reference})
    for line in sys.stdin:
        command = json.loads(line)
        started = time.perf_counter()
        try:
            if command["do"] == "serve":
                tokens = engine.serve()
                _answer({"ok": tokens == engine.reference, "seconds": _since(started)})
                continue
            if command["do"] == "sleep":
                engine.sleep()
            else:
                engine.wake(command.get("wait_s", 0.0))
        except BudgetExceededError as refused:
            _answer({"ok": False, "refused": str(refused), "seconds": _since(started)})
            continue
        _answer({"ok": True, "seconds": _since(started)})


def _since(start: float) -> float:
    return time.perf_counter() - start


def _answer(message: dict[str, Any]) -> None:
    print("ANSWER " + json.dumps(message), flush=True)


# -- the switching, from a third process ---------------------------------------------


class Engine:
    """One engine process, seen from the orchestrator."""

    def __init__(self, name: str, kind: str, seed: int, kv_bytes: int, state_dir: Path):
        self.name = name
        self.log = state_dir / f"engine-{name}.log"
        self.process = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve",
                kind,
                "--seed",
                str(seed),
                "--kv-mib",
                str(kv_bytes // MiB),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log.open("w"),
            text=True,
        )
        self.started = self._reply()

    def _reply(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("ANSWER "):
                answer: dict[str, Any] = json.loads(line.removeprefix("ANSWER "))
                return answer
        tail = "".join(self.log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"engine {self.name} exited with {self.process.wait()}:\n{tail}")

    def do(self, what: str, **args: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"do": what, **args}) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def held(state_dir: Path) -> tuple[dict[int, int], int]:
    """Each process's claim on the host, by pid, and the host's limit (0: none)."""
    from extensible_kv.budget import snapshot

    (device,) = [d for d in snapshot(state_dir)["devices"] if d["type"] == "cpu"]
    return {p["pid"]: p["claimed_bytes"] for p in device["processes"]}, device["limit_bytes"] or 0


def claims(state_dir: Path, engines: list[Engine]) -> str:
    from extensible_kv.budget import format_bytes

    by_pid, limit = held(state_dir)
    return (
        ", ".join(f"{e.name} {format_bytes(by_pid.get(e.process.pid, 0)):>9}" for e in engines)
        + f" of {format_bytes(limit)}"
    )


def switch(kind: str, kv_bytes: int, state_dir: Path) -> bool:
    from extensible_kv.limits import set_device_limit

    os.environ["EXTENSIBLE_KV_STATE_DIR"] = str(state_dir)  # here and in the engines
    print(f"engines: {kind}; watch with: EXTENSIBLE_KV_STATE_DIR={state_dir} extensible-kv top")
    engines: list[Engine] = []
    ok = True

    def step(engine: Engine, what: str, expect_refusal: bool = False, **args: Any) -> None:
        nonlocal ok
        answer = engine.do(what, **args)
        refused = "refused" in answer
        ok &= refused == expect_refusal and (answer["ok"] or refused)
        if refused:
            note = "refused: " + answer["refused"][:90] + "..."
        elif what == "serve":
            note = "tokens right" if answer["ok"] else "TOKENS DIFFER"
        else:
            note = ""
        print(
            f"  {engine.name} {what:<6} {answer['seconds'] * 1e3:8.1f} ms   "
            f"{claims(state_dir, engines)}   {note}"
        )

    try:
        a = Engine("A", kind, 0, kv_bytes, state_dir)
        engines.append(a)
        limit = set_device_limit("cpu", int(1.5 * held(state_dir)[0][a.process.pid]))
        print(f"  A start  {a.started['seconds']:8.2f} s    {claims(state_dir, engines)}")
        step(a, "serve")
        step(a, "sleep")
        b = Engine("B", kind, 1, kv_bytes, state_dir)
        engines.append(b)
        print(f"  B start  {b.started['seconds']:8.2f} s    {claims(state_dir, engines)}")
        step(b, "serve")
        step(b, "sleep")
        step(a, "wake")
        step(a, "serve")
        step(b, "wake", expect_refusal=True)  # A holds the budget: refused, nothing changed
        step(a, "serve")  # A is unharmed
        # B waits for the room that A's sleep, a moment later, gives back.
        later = threading.Timer(0.5, lambda: step(a, "sleep"))
        later.start()
        step(b, "wake", wait_s=120.0)
        later.join()
        step(b, "serve")
        step(b, "sleep")
        step(a, "wake")
        step(a, "serve")
        print(f"limit {limit.bytes // MiB} MiB (revision {limit.revision}) < A + B")
    finally:
        for engine in engines:
            engine.stop()
    print("ok: every serve's tokens were right" if ok else "FAILED: see above")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=("auto", "vllm", "demo"), default="auto")
    parser.add_argument("--kv-mib", type=int, default=64, help="each engine's KV cache")
    parser.add_argument("--serve", choices=("vllm", "demo"), help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve_forever(args.serve, args.seed, args.kv_mib * MiB)
        return 0
    kind = args.engine
    if kind == "auto":
        kind = "vllm" if importlib.util.find_spec("vllm") is not None else "demo"
    with tempfile.TemporaryDirectory(prefix="extensible-kv-switch-") as state_dir:
        return 0 if switch(kind, args.kv_mib * MiB, Path(state_dir)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
