"""GPU-only tests: they run where a CUDA (or ROCm) backend is usable and are
skipped, saying why, everywhere else. Everything here touches real device
memory; a test that could kill the process's CUDA context runs in a child.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from child import run_python
from extensible_kv import ExtensibleTensor, get_driver, unavailable_reason
from extensible_kv.driver import backend

REASON = unavailable_reason("cuda")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no usable GPU backend: {REASON}")
MiB = 1 << 20


@pytest.fixture
def granule() -> int:
    return get_driver("cuda:0").granularity(0, False)


def test_a_cuda_graph_survives_growth_and_sleep(granule: int) -> None:
    """A graph captured over a view keeps working after the buffer grows,
    and after release and recommit, since the base pointer never moves."""
    et = ExtensibleTensor(64 * granule, "cuda")
    et.resize_per_segment_(granule, zero_new=True)
    view = et.full_view()[:granule]
    one = torch.ones(granule, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        view.add_(one)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        view.add_(one)
    view.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert int(view.sum()) == granule

    et.resize_per_segment_(48 * granule, zero_new=True)
    graph.replay()
    torch.cuda.synchronize()
    assert int(view.min()) == 2

    et.release_physical()
    et.resize_per_segment_(48 * granule, zero_new=True)
    graph.replay()
    torch.cuda.synchronize()
    assert int(view.max()) == 1
    del graph, view
    et.free()


def test_every_granule_of_a_large_commit_is_backed(granule: int) -> None:
    et = ExtensibleTensor(256 * granule + 3, "cuda", num_segments=1)
    view = et.resize_(200 * granule + 1)
    view.fill_(3)
    torch.cuda.synchronize()
    assert int(view.sum(dtype=torch.int64)) == 3 * (200 * granule + 1)
    et.free()


def test_touching_an_uncommitted_granule_faults_the_device(granule: int) -> None:
    child = run_python(
        f"""
        import torch
        from extensible_kv import ExtensibleTensor
        et = ExtensibleTensor({8 * granule}, "cuda")
        et.resize_({granule})
        et.full_view()[{granule}:{2 * granule}].fill_(1)
        torch.cuda.synchronize()
        print("no fault")
        """
    )
    assert child.returncode != 0
    assert "no fault" not in child.stdout
    assert "illegal" in child.stderr.lower()


def test_release_returns_memory_to_the_device() -> None:
    size = 1 << 30
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    et = ExtensibleTensor(size, "cuda")
    et.resize_(size)
    free_committed = torch.cuda.mem_get_info()[0]
    et.release_physical()
    free_released = torch.cuda.mem_get_info()[0]
    et.free()
    assert free_before - free_committed >= size
    assert free_before - free_released < 64 * MiB


def test_shareable_memory_is_seen_by_another_process() -> None:
    driver = backend("cuda:0")
    capabilities = getattr(driver, "capabilities", None)
    if capabilities is None or not capabilities(0)[0]:
        pytest.skip("this device does not export POSIX file descriptors")
    granule = driver.granularity(0, True)
    et = ExtensibleTensor(4 * granule, "cuda", shareable=True, chunk_bytes=granule)
    et.resize_(4 * granule).fill_(7)
    shared, exported = et.shared_layout()
    layout = [(o, n, fd) for (o, n), fd in zip(shared.chunks, exported, strict=True)]
    fds = tuple(exported)
    try:
        child = run_python(
            f"""
            import json, torch
            from extensible_kv import get_driver, uint8_tensor_from_ptr
            layout = json.loads({json.dumps(json.dumps(layout))})
            total = sum(size for _, size, _ in layout)
            d = get_driver("cuda:0")
            with d.context(0):
                ptr = d.reserve(total, {granule})
                handles = []
                for offset, size, fd in layout:
                    handles.append(d.import_handle(fd))
                    d.map(ptr + offset, size, handles[-1])
                d.set_access(ptr, total, 0)
                view = uint8_tensor_from_ptr(ptr, total, 0)
                assert int(view.min()) == 7 and int(view.max()) == 7
                view[:16].fill_(9)
                torch.cuda.synchronize()
                del view
                for offset, size, _ in layout:
                    d.unmap(ptr + offset, size)
                for h in handles:
                    d.release(h)
                d.free_reserved(ptr, total)
            print("seen")
            """,
            pass_fds=fds,
        )
    finally:
        for fd in fds:
            os.close(fd)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "seen"
    assert et.tensor[:16].eq(9).all()
    assert et.tensor[16:].eq(7).all()
    et.free()


def test_cupy_consumes_the_same_views(granule: int) -> None:
    cupy = pytest.importorskip("cupy")
    from extensible_kv.dlpack import ByteView

    et = ExtensibleTensor(4 * granule, "cuda")
    et.resize_(granule).fill_(5)
    array = cupy.from_dlpack(ByteView(et.buffer, 0, granule))
    assert int(array.data.ptr) == et.base_ptr
    assert int(array.sum()) == 5 * granule
    array[:8] = 6
    cupy.cuda.Device().synchronize()
    assert et.tensor[:8].eq(6).all()
    del array
    et.free()


def test_probing_initializes_cuda_through_torch() -> None:
    """An engine checking torch.cuda.is_initialized() before forking must
    learn that probing initialized CUDA."""
    child = run_python(
        """
        import torch
        from extensible_kv import unavailable_reason
        assert not torch.cuda.is_initialized()
        assert unavailable_reason("cuda") is None
        print(torch.cuda.is_initialized())
        """
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "True"
