"""The host backend follows the driver rules with real Linux memory."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from child import run_python
from extensible_kv.driver import DriverError, HostDriver, OutOfMemoryError, _libc, _populate

MiB = 1 << 20
G = 2 * MiB


@pytest.fixture
def driver() -> HostDriver:
    return HostDriver()


@pytest.fixture
def reservation(driver: HostDriver) -> Iterator[int]:
    ptr = driver.reserve(8 * G, G)
    yield ptr
    for start in list(driver._mappings):
        driver.unmap(start, driver._mappings[start].size)
    for handle in list(driver._handles):
        driver.release(handle)
    driver.free_reserved(ptr, 8 * G)


def rss_bytes() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Rss line")


def test_reservations_are_aligned_and_granular(driver: HostDriver) -> None:
    assert driver.granularity(0, False) == G
    assert driver.granularity(0, True) == G
    ptr = driver.reserve(3 * G, G)
    assert ptr % G == 0
    driver.free_reserved(ptr, 3 * G)
    coarse = [driver.reserve(G, 16 * G) for _ in range(4)]
    assert all(p % (16 * G) == 0 for p in coarse)
    for p in coarse:
        driver.free_reserved(p, G)
    with pytest.raises(DriverError, match="multiple of the granularity") as info:
        driver.reserve(G + 1, G)
    assert info.value.code == errno.EINVAL
    assert info.value.name == "EINVAL"
    with pytest.raises(DriverError, match="power of two"):
        driver.reserve(G, 3 * G)
    for wrapping in (1 << 64, (1 << 64) + G):
        with pytest.raises(DriverError, match="multiple of the granularity"):
            driver.reserve(wrapping, G)


def test_custom_granularity_must_be_a_power_of_two_page_multiple() -> None:
    assert HostDriver(granularity=64 * 1024).granularity(0, False) == 64 * 1024
    for bad in (0, 4096 * 3, 1000):
        with pytest.raises(ValueError, match="power of two"):
            HostDriver(granularity=bad)


def test_only_device_zero_exists(driver: HostDriver) -> None:
    with pytest.raises(DriverError, match="one device"):
        driver.create(G, 1, False)


def test_private_memory_keeps_its_bytes_across_unmap_and_remap(
    driver: HostDriver, reservation: int
) -> None:
    handle = driver.create(2 * G, 0, False)
    driver.map(reservation, 2 * G, handle)
    driver.set_access(reservation, 2 * G, 0)
    assert ctypes.string_at(reservation, 2 * G) == bytes(2 * G)
    ctypes.memset(reservation + G - 2, 0xAB, 4)
    driver.unmap(reservation, 2 * G)
    driver.map(reservation + 4 * G, 2 * G, handle)
    driver.set_access(reservation + 4 * G, 2 * G, 0)
    assert ctypes.string_at(reservation + 4 * G + G - 2, 4) == b"\xab" * 4


def test_shareable_memory_maps_twice_and_exports_to_another_process(
    driver: HostDriver, reservation: int
) -> None:
    handle = driver.create(G, 0, True)
    driver.map(reservation, G, handle)
    driver.map(reservation + 2 * G, G, handle)
    driver.set_access(reservation, G, 0)
    driver.set_access(reservation + 2 * G, G, 0)
    ctypes.memset(reservation + 5, 7, 1)
    assert ctypes.string_at(reservation + 2 * G + 5, 1) == b"\x07"
    fd = driver.export_handle(handle)
    try:
        child = run_python(
            f"""
            import ctypes
            from extensible_kv.driver import HostDriver
            d = HostDriver()
            ptr = d.reserve({G}, {G})
            h = d.import_handle({fd})
            d.map(ptr, {G}, h)
            d.set_access(ptr, {G}, 0)
            assert ctypes.string_at(ptr + 5, 1) == b"\\x07"
            ctypes.memset(ptr + 6, 9, 1)
            """,
            pass_fds=(fd,),
        )
    finally:
        os.close(fd)
    assert child.returncode == 0, child.stderr
    assert ctypes.string_at(reservation + 6, 1) == b"\x09"


def test_private_memory_cannot_be_exported(driver: HostDriver) -> None:
    handle = driver.create(G, 0, False)
    with pytest.raises(DriverError, match="not shareable"):
        driver.export_handle(handle)
    driver.release(handle)


def test_released_while_mapped_lives_until_unmapped(driver: HostDriver, reservation: int) -> None:
    for shareable in (False, True):
        handle = driver.create(G, 0, shareable)
        driver.map(reservation, G, handle)
        driver.set_access(reservation, G, 0)
        ctypes.memset(reservation, 3, 16)
        driver.release(handle)
        assert ctypes.string_at(reservation, 16) == b"\x03" * 16
        driver.unmap(reservation, G)
        with pytest.raises(DriverError, match="no live handle"):
            driver.release(handle)


def test_commit_is_physically_present_and_release_returns_it(driver: HostDriver) -> None:
    size = 64 * MiB
    before = rss_bytes()
    handle = driver.create(size, 0, False)
    present = rss_bytes() - before
    driver.release(handle)
    returned = present - (rss_bytes() - before)
    assert present >= 0.9 * size
    assert returned >= 0.9 * size


def vma_field(address: int, name: str) -> list[str]:
    """Field ``name`` of ``/proc/self/smaps`` for this process's mapping
    that starts at ``address``, split on blanks."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{address:x}-"))
    field = next(line for line in lines[start + 1 :] if line.startswith(f"{name}:"))
    return field.split()[1:]


def vma_flags(address: int) -> list[str]:
    """The ``VmFlags`` of this process's mapping that starts at ``address``."""
    return vma_field(address, "VmFlags")


def present_bytes(address: int) -> int:
    """Bytes of the mapping at ``address`` its page tables map (its ``Rss``)."""
    value, unit = vma_field(address, "Rss")
    assert unit == "kB"
    return int(value) * 1024


def test_private_memory_follows_the_system_huge_page_policy(
    driver: HostDriver, reservation: int
) -> None:
    # No MADV_HUGEPAGE ("hg"): populating forced huge pages cost vLLM's
    # start 1.35x stock's and bought no decode speed (docs/performance.md).
    handle = driver.create(4 * MiB, 0, False)
    driver.map(reservation, 4 * MiB, handle)
    driver.set_access(reservation, 4 * MiB, 0)
    flags = vma_flags(reservation)
    assert "rd" in flags
    assert "wr" in flags
    assert "hg" not in flags


def _failing_populate(monkeypatch: pytest.MonkeyPatch, fail: Callable[[int], int | None]) -> None:
    """Labelled mock at the kernel boundary: ``MADV_POPULATE_WRITE`` fails
    with ``fail(start)``'s errno (None: it runs), as a kernel before 5.14
    (EINVAL) or one out of memory midway (ENOMEM) would; this machine's does
    neither."""
    real = _libc.madvise

    def madvise(start: int, size: int, advice: int) -> None:
        code = fail(start) if advice == _libc.MADV_POPULATE_WRITE else None
        if code is not None:
            raise OSError(code, os.strerror(code))
        real(start, size, advice)

    monkeypatch.setattr(_libc, "madvise", madvise)


def test_create_populates_every_piece_on_several_threads(
    driver: HostDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = 2 * _populate.PIECE_BYTES + G
    wanted = min(3, len(os.sched_getaffinity(0)))
    threads: set[str] = set()
    all_working = threading.Event()

    def working(start: int) -> None:
        threads.add(threading.current_thread().name)
        if len(threads) == wanted:
            all_working.set()
        all_working.wait(10)  # bounded: each thread waits until all of them work

    _failing_populate(monkeypatch, working)
    before = rss_bytes()
    handle = driver.create(size, 0, False)
    assert rss_bytes() - before >= size - MiB
    ptr = driver.reserve(size, G)
    driver.map(ptr, size, handle)
    driver.set_access(ptr, size, 0)
    assert ctypes.string_at(ptr, size) == bytes(size)
    assert len(threads) == wanted
    driver.unmap(ptr, size)
    driver.release(handle)
    driver.free_reserved(ptr, size)


def test_populate_fallback_writes_pages_present(
    driver: HostDriver, reservation: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _failing_populate(monkeypatch, lambda start: errno.EINVAL)
    before = rss_bytes()
    handle = driver.create(16 * MiB, 0, False)
    assert rss_bytes() - before >= 15 * MiB
    driver.map(reservation, 16 * MiB, handle)
    driver.set_access(reservation, 16 * MiB, 0)
    assert ctypes.string_at(reservation, 16 * MiB) == bytes(16 * MiB)


def _shared_with(driver: HostDriver, data: bytes) -> int:
    """A shareable handle of ``len(data)`` bytes holding ``data``, written
    through a mapping of its own, unmapped again."""
    handle = driver.create(len(data), 0, True)
    fd = driver.export_handle(handle)
    try:
        with mmap.mmap(fd, len(data)) as view:
            view[:] = data
    finally:
        os.close(fd)
    return handle


def test_shared_memory_arrives_present_with_its_contents(
    driver: HostDriver, reservation: int
) -> None:
    # A first touch of each 4 KiB page of a fresh MAP_SHARED mapping
    # faulted alone, in the step that first read it.
    data = os.urandom(4 * MiB)
    handle = _shared_with(driver, data)
    driver.map(reservation, 4 * MiB, handle)
    assert present_bytes(reservation) == 0
    driver.set_access(reservation, 4 * MiB, 0)
    assert present_bytes(reservation) == 4 * MiB
    assert ctypes.string_at(reservation, 4 * MiB) == data


def test_shared_memory_without_populate_keeps_its_contents(
    driver: HostDriver, reservation: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kernel before 5.14 writes zeros to make fresh memory present;
    # shared memory's pages then fault at first touch instead.
    _failing_populate(monkeypatch, lambda start: errno.EINVAL)
    data = os.urandom(4 * MiB)
    driver.map(reservation, 4 * MiB, _shared_with(driver, data))
    driver.set_access(reservation, 4 * MiB, 0)
    assert ctypes.string_at(reservation, 4 * MiB) == data


def test_shared_memory_failing_to_populate_stays_inaccessible(
    driver: HostDriver, reservation: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle = driver.create(4 * MiB, 0, True)
    driver.map(reservation, 4 * MiB, handle)
    _failing_populate(monkeypatch, lambda start: errno.ENOMEM)
    with pytest.raises(OutOfMemoryError, match="ENOMEM") as info:
        driver.set_access(reservation, 4 * MiB, 0)
    assert info.value.call == "set_access"
    assert "rd" not in vma_flags(reservation)
    assert not driver._mappings[reservation].accessible
    monkeypatch.undo()
    driver.set_access(reservation, 4 * MiB, 0)
    assert present_bytes(reservation) == 4 * MiB


def test_memory_running_out_in_one_piece_leaves_nothing(
    driver: HostDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    first: list[int] = []

    def fail(start: int) -> int | None:
        first.append(start)
        return errno.ENOMEM if start != min(first) else None

    _failing_populate(monkeypatch, fail)
    before = rss_bytes()
    with pytest.raises(OutOfMemoryError, match="ENOMEM") as info:
        driver.create(4 * _populate.PIECE_BYTES, 0, False)
    assert info.value.call == "create"
    assert driver._handles == {}
    assert rss_bytes() - before < _populate.PIECE_BYTES


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("map_outside", "not inside one reservation"),
        ("map_twice_same_place", "already mapped"),
        ("map_private_twice", "one address at a time"),
        ("map_wrong_size", "differs from the allocation"),
        ("unmap_part", "ends inside a mapping"),
        ("unmap_hole", "not covered by whole mappings"),
        ("access_unmapped", "not covered by whole mappings"),
        ("free_mapped", "still holds mappings"),
        ("free_unknown", "is not a reservation"),
        ("import_bad_fd", "EBADF"),
    ],
)
def test_rule_violations_are_refused(
    driver: HostDriver, reservation: int, case: str, message: str
) -> None:
    handle = driver.create(2 * G, 0, False)
    driver.map(reservation, 2 * G, handle)
    other = driver.create(2 * G, 0, False)
    calls = {
        "map_outside": lambda: driver.map(reservation + 7 * G, 2 * G, other),
        "map_twice_same_place": lambda: driver.map(reservation + G, 2 * G, other),
        "map_private_twice": lambda: driver.map(reservation + 4 * G, 2 * G, handle),
        "map_wrong_size": lambda: driver.map(reservation + 4 * G, G, other),
        "unmap_part": lambda: driver.unmap(reservation, G),
        "unmap_hole": lambda: driver.unmap(reservation, 4 * G),
        "access_unmapped": lambda: driver.set_access(reservation + 2 * G, G, 0),
        "free_mapped": lambda: driver.free_reserved(reservation, 8 * G),
        "free_unknown": lambda: driver.free_reserved(reservation + G, G),
        "import_bad_fd": lambda: driver.import_handle(10_000),
    }
    state = (dict(driver._mappings), dict(driver._handles), dict(driver._reservations))
    with pytest.raises(DriverError, match=message):
        calls[case]()
    assert state == (dict(driver._mappings), dict(driver._handles), dict(driver._reservations))


@pytest.mark.parametrize("step", ["before_set_access", "after_unmap", "reserved_only"])
def test_touching_memory_without_access_faults(step: str) -> None:
    """As on a GPU, only mapped memory with access granted may be touched."""
    setup = {
        "before_set_access": "d.map(p, G, d.create(G, 0, False))",
        "after_unmap": (
            "h = d.create(G, 0, False); d.map(p, G, h); d.set_access(p, G, 0);"
            " ctypes.memset(p, 1, 1); d.unmap(p, G)"
        ),
        "reserved_only": "pass",
    }[step]
    child = run_python(
        f"""
        import ctypes
        from extensible_kv.driver import HostDriver
        G = {G}
        d = HostDriver()
        p = d.reserve(G, G)
        {setup}
        print("touching", flush=True)
        ctypes.memset(p, 1, 1)
        """
    )
    assert "touching" in child.stdout, child.stderr
    assert child.returncode == -signal.SIGSEGV


def test_out_of_memory_is_a_torch_out_of_memory_error_and_changes_nothing() -> None:
    """A real ENOMEM: the address-space limit leaves no room for the pages."""
    child = run_python(
        f"""
        import resource
        import torch
        from extensible_kv.driver import HostDriver, OutOfMemoryError
        d = HostDriver()
        vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status")
                  if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + {16 * MiB}, resource.RLIM_INFINITY))
        try:
            d.create({64 * MiB}, 0, False)
        except OutOfMemoryError as exc:
            assert isinstance(exc, torch.OutOfMemoryError)
            assert exc.name == "ENOMEM" and exc.call == "create", exc
            assert d._handles == {{}}
            print("oom", exc)
        """
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith("oom create failed with ENOMEM")


def test_out_of_memory_error_is_torch_out_of_memory() -> None:
    assert issubclass(OutOfMemoryError, torch.OutOfMemoryError)
    assert issubclass(OutOfMemoryError, DriverError)


def test_a_finalizer_calling_back_inside_a_driver_call_does_not_wait_on_itself() -> None:
    # The garbage collector may run a finalizer at any allocation inside a
    # driver call, on that call's thread: here the DLPack deleter of a freed
    # tensor's last view, which returns the tensor's address range. The test
    # holds the driver's lock as a call does while it allocates.
    from extensible_kv import ExtensibleTensor

    driver = HostDriver()
    tensor = ExtensibleTensor(4 * G, "cpu", driver=driver)
    tensor.resize_(G)
    views = [tensor.full_view()]
    tensor.free()  # the range outlives the view
    assert driver._reservations

    def last_view_goes_inside_a_call() -> None:
        with driver._lock:
            views.clear()

    worker = threading.Thread(target=last_view_goes_inside_a_call, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "the finalizer waited on the lock its own thread holds"
    assert not driver._reservations
