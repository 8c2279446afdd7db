"""Beyond the in-tree cache: a sleep that keeps contents, trim, a preserving
defragment, background commits and thread safety."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from extensible_kv import ExtensibleTensor, StatisticsDriver
from extensible_kv.driver import LiveUsage
from extensible_kv.driver.adaptors import DriverAdaptor
from extensible_kv.kv import KVCacheBuffers
from extensible_kv.kv.cache.backup import HostBackup, Restorer
from extensible_kv.kv.cache.core import CommitTicket

MiB = 1 << 20


def cache_of(
    device: str, driver: StatisticsDriver, per_block: int, capacity: int = 64
) -> KVCacheBuffers:
    buffers = [
        (
            ExtensibleTensor(capacity * per_block * 2, device, num_segments=2, driver=driver),
            per_block,
        ),
        (ExtensibleTensor(capacity * per_block, device, driver=driver), per_block),
    ]
    return KVCacheBuffers(buffers, capacity)


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def fill(cache: KVCacheBuffers) -> list[torch.Tensor]:
    regions = cache._regions(cache.num_blocks_committed)
    for i, region in enumerate(regions):
        region.copy_(
            torch.arange(region.numel(), dtype=torch.int64).add(i).remainder(251).to(torch.uint8)
        )
    return [region.clone() for region in regions]


def test_a_preserving_sleep_keeps_every_committed_block(
    stats: StatisticsDriver, device: str
) -> None:
    cache = cache_of(device, stats, 256 * 1024)
    cache.commit(40)
    expected = fill(cache)
    cache.release_physical(preserve=True)
    assert cache.physical_bytes == 0
    assert cache.host_backup_bytes == 3 * 40 * 256 * 1024
    cache.recommit()
    for region, before in zip(cache._regions(40), expected, strict=True):
        assert torch.equal(region, before)
    assert cache.host_backup_bytes == 0
    cache.free()


def test_host_memory_goes_back_after_wake_unless_kept(stats: StatisticsDriver) -> None:
    cache = cache_of("cpu", stats, MiB, capacity=64)
    cache.commit(64)
    fill(cache)
    cache.release_physical(preserve=True)
    asleep = rss()
    cache.recommit()
    cache.release_physical()
    woken_and_released = rss()
    assert asleep - woken_and_released >= 150 * MiB, "the 192 MiB host copy is returned"
    cache.recommit()
    cache.release_physical(preserve=True)
    cache.recommit(keep_host_memory=True)
    assert cache.host_backup_bytes == 192 * MiB
    kept = cache._spare
    cache.release_physical(preserve=True)
    assert cache._sleep.backup is kept, "a kept copy is reused by the next sleep"
    cache.recommit()
    cache.free()


class HoldingDriver(DriverAdaptor):
    """Holds its ``hold_at``-th ``create`` until ``go`` is set (at most
    30 s), and says whether it was."""

    def __init__(self, inner: StatisticsDriver) -> None:
        super().__init__(inner)
        self.creates = 0
        self.hold_at = 0
        self.go = threading.Event()
        self.released_in_time: bool | None = None

    def _call(self, name: str, *args: Any) -> Any:
        if name == "create":
            self.creates += 1
            if self.creates == self.hold_at:
                self.released_in_time = self.go.wait(30)
        return super()._call(name, *args)


def test_a_wake_copies_each_buffer_while_the_next_commits(
    stats: StatisticsDriver, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wake's last ``create`` waits for a copy to start: a wake that
    copied only after committing everything would never release it."""
    holding = HoldingDriver(stats)
    buffers = [(ExtensibleTensor(16 * MiB, device, driver=holding), 256 * 1024) for _ in range(3)]
    cache = KVCacheBuffers(buffers, 64)
    cache.commit(64)
    expected = fill(cache)
    cache.release_physical(preserve=True)
    before = holding.creates
    cache.recommit(keep_host_memory=True)
    holding.hold_at = 2 * holding.creates - before  # the last create of the next wake
    copy = Restorer._copy

    def copy_then_release(self: Restorer, *args: Any) -> None:
        holding.go.set()
        copy(self, *args)

    monkeypatch.setattr(Restorer, "_copy", copy_then_release)
    cache.release_physical(preserve=True)
    cache.recommit()
    assert holding.released_in_time is True, "no copy ran while the last buffer committed"
    for region, before_bytes in zip(cache._regions(64), expected, strict=True):
        assert torch.equal(region, before_bytes)
    cache.free()


def test_a_failed_copy_on_wake_leaves_the_cache_asleep_with_its_copy(
    stats: StatisticsDriver, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = cache_of(device, stats, 256 * 1024)
    cache.commit(40)
    expected = fill(cache)
    cache.release_physical(preserve=True)
    live_asleep = stats.live
    copy = Restorer._copy
    calls = []

    def second_copy_fails(self: Restorer, *args: Any) -> None:
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("copy failed")
        copy(self, *args)

    monkeypatch.setattr(Restorer, "_copy", second_copy_fails)
    with pytest.raises(RuntimeError, match="copy failed"):
        cache.recommit()
    assert cache.asleep
    assert cache.physical_bytes == 0
    assert stats.live == live_asleep, "what the failed wake committed went back"
    assert cache.host_backup_bytes == 3 * 40 * 256 * 1024
    monkeypatch.setattr(Restorer, "_copy", copy)
    cache.recommit()
    for region, before in zip(cache._regions(40), expected, strict=True):
        assert torch.equal(region, before)
    cache.free()


class FakeCudart:
    """MOCK of the CUDA runtime's host registration, which no CPU machine
    has: records calls and answers ``error`` to registrations."""

    def __init__(self, error: int = 0) -> None:
        self.error = error
        self.calls: list[tuple[str, int]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", size))
        return self.error

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0


@pytest.fixture
def fake_cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_a_pinned_backup_registers_once_and_unregisters_when_freed(
    fake_cudart: FakeCudart,
) -> None:
    backup = HostBackup([MiB, 3 * MiB])
    backup.pin()
    backup.pin()
    assert backup.pinned
    assert fake_cudart.calls == [("register", 4 * MiB)]
    backup.free()
    assert fake_cudart.calls[1:] == [("unregister", fake_cudart.calls[1][1])]
    assert not backup.pinned


def test_a_refused_pin_warns_and_leaves_the_backup_unpinned(fake_cudart: FakeCudart) -> None:
    fake_cudart.error = 2
    backup = HostBackup([MiB])
    with pytest.warns(RuntimeWarning, match="could not pin .* error 2"):
        backup.pin()
    assert not backup.pinned
    backup.free()
    assert [name for name, _ in fake_cudart.calls] == ["register"]


def test_a_kept_backup_of_a_host_cache_is_not_pinned(
    stats: StatisticsDriver, fake_cudart: FakeCudart
) -> None:
    cache = cache_of("cpu", stats, 256 * 1024)
    cache.commit(8)
    cache.release_physical(preserve=True)
    cache.recommit(keep_host_memory=True)
    assert cache._spare is not None
    assert not cache._spare.pinned
    assert fake_cudart.calls == []
    cache.free()


def test_a_kept_backup_survives_sleep_after_sleep(stats: StatisticsDriver, device: str) -> None:
    """On a GPU the kept copy is pinned and later sleeps copy by direct DMA."""
    cache = cache_of(device, stats, 256 * 1024)
    cache.commit(40)
    expected = fill(cache)
    for _ in range(3):
        cache.release_physical(preserve=True)
        cache.recommit(keep_host_memory=True)
        for region, before in zip(cache._regions(40), expected, strict=True):
            assert torch.equal(region, before)
    assert cache._spare is not None
    assert cache._spare.pinned == (device == "cuda")
    cache.free()


def test_backups_refuse_regions_of_another_shape() -> None:
    backup = HostBackup.capture([torch.zeros(10, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="differ"):
        backup.restore([torch.zeros(11, dtype=torch.uint8)])


def test_trim_keeps_the_prefix_and_gives_back_the_rest(
    stats: StatisticsDriver, device: str, granularity: int
) -> None:
    granule = granularity
    cache = cache_of(device, stats, granule // 4 + 512)
    cache.commit(64)
    expected = fill(cache)
    cache.trim(9)
    assert cache.num_blocks_committed == 9
    for region, before in zip(cache._regions(9), expected, strict=True):
        assert torch.equal(region, before[: region.numel()])
    for buffer, per_block in cache.buffers:
        covering = buffer.num_segments * -(-9 * per_block // granule)
        assert buffer.physical_bytes == covering * granule
    with pytest.raises(ValueError, match="trim keeps 0 to 9 blocks"):
        cache.trim(10)
    cache.release_physical()
    with pytest.raises(ValueError, match="released"):
        cache.trim(1)
    cache.free()


def test_preserving_defragment(stats: StatisticsDriver, device: str, granularity: int) -> None:
    granule = granularity
    buffers = [
        (ExtensibleTensor(64 * granule, device, driver=stats, chunk_bytes=granule), granule // 2)
    ]
    cache = KVCacheBuffers(buffers, 64)
    for n in (3, 17, 40):
        cache.commit(n)
    expected = fill(cache)
    assert len(buffers[0][0].buffer.chunks) > 1
    cache.defragment()
    assert len(buffers[0][0].buffer.chunks) == 1
    assert torch.equal(cache._regions(40)[0], expected[0])
    cache.free()


def test_background_commits_run_in_order(stats: StatisticsDriver, device: str) -> None:
    cache = cache_of(device, stats, 64 * 1024)
    futures = [cache.commit_async(n) for n in (5, 30, 12)]
    cache.commit(8)  # waits for the queued commits first
    assert [f.result().num_blocks for f in futures] == [5, 30, 12]
    assert cache.num_blocks_committed == 30
    futures[-1].result().wait()
    bad = cache.commit_async(cache.num_blocks_capacity + 1)
    assert isinstance(bad.exception(), ValueError)
    cache.ensure_blocks(31)
    assert cache.num_blocks_committed == 31
    cache.free()


def test_many_threads_leave_the_cache_consistent(stats: StatisticsDriver, device: str) -> None:
    cache = cache_of(device, stats, 96 * 1024)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(40):
                op = rng.choice(["commit", "ensure", "async", "release", "recommit", "trim"])
                n = rng.randint(0, cache.num_blocks_capacity)
                try:
                    if op == "commit":
                        cache.commit(n)
                    elif op == "ensure":
                        cache.ensure_blocks(n)
                    elif op == "async":
                        cache.commit_async(n).result()
                    elif op == "release":
                        cache.release_physical(preserve=rng.random() < 0.5)
                    elif op == "recommit":
                        cache.recommit()
                    else:
                        cache.trim(min(n, cache.num_blocks_committed))
                except ValueError as exc:
                    # Races make some calls invalid when they run: a commit
                    # while asleep, a trim past a count another thread cut.
                    if "released" not in str(exc) and "trim keeps" not in str(exc):
                        raise
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    cache.recommit()
    committed = cache.num_blocks_committed
    for buffer, per_block in cache.buffers:
        assert buffer.bytes_per_segment == committed * per_block
    live = stats.live
    assert live.mapped_bytes == cache.physical_bytes
    assert live.handles == live.mappings
    cache.free()
    assert stats.live == LiveUsage()


def test_a_ticket_waits_on_the_stream_of_the_caches_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MOCKED at the GPU boundary (no CUDA in this torch): the stream a
    ticket makes wait is asked of the cache's device, not the current one."""
    asked: list[object] = []
    waited: list[object] = []

    class Stream:
        def wait_event(self, event: object) -> None:
            waited.append(event)

    def current_stream(device: object = None) -> Stream:
        asked.append(device)
        return Stream()

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    event = object()
    CommitTicket(4, event, torch.device("cuda", 1)).wait()  # type: ignore[arg-type]
    assert asked == [torch.device("cuda", 1)]
    assert waited == [event]


class HookedLock:
    """The cache's lock, running ``hook`` once, just before the thread named
    ``who`` first takes it."""

    def __init__(self, inner: Any, who: str, hook: Callable[[], object]) -> None:
        self.inner, self.who = inner, who
        self.hook: Callable[[], object] | None = hook

    def __enter__(self) -> Any:
        if self.hook is not None and threading.current_thread().name == self.who:
            hook, self.hook = self.hook, None
            hook()
        return self.inner.__enter__()

    def __exit__(self, *exc: object) -> Any:
        return self.inner.__exit__(*exc)


def test_free_runs_a_commit_queued_as_it_starts_and_does_not_deadlock(
    stats: StatisticsDriver, device: str
) -> None:
    cache = cache_of(device, stats, 64 * 1024)
    cache.commit_async(2).result()
    queued: list[Future[CommitTicket]] = []
    cache._lock = HookedLock(  # type: ignore[assignment]
        cache._lock, "freeing", lambda: queued.append(cache.commit_async(7))
    )
    freeing = threading.Thread(target=cache.free, name="freeing", daemon=True)
    freeing.start()
    freeing.join(timeout=30)
    assert not freeing.is_alive(), "free() deadlocked on a queued commit"
    assert queued[0].result(timeout=1).num_blocks == 7
    assert cache.physical_bytes == 0
    with pytest.raises(ValueError, match="freed"):
        cache.commit_async(3)
