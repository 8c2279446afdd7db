"""The few libc virtual-memory calls the host backend needs, through ctypes.

Every wrapper raises :class:`OSError` carrying ``errno`` on failure; the host
driver turns those into driver errors. Constants missing from Python's
``mmap`` module are the Linux UAPI values, the same on x86-64 and arm64.
"""

from __future__ import annotations

import ctypes
import mmap
import os

PROT_NONE = 0
PROT_READ = mmap.PROT_READ
PROT_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
MAP_PRIVATE = mmap.MAP_PRIVATE
MAP_SHARED = mmap.MAP_SHARED
MAP_ANONYMOUS = mmap.MAP_ANONYMOUS
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
MADV_POPULATE_WRITE = 23
MREMAP_MAYMOVE = 1
MREMAP_FIXED = 2
MREMAP_DONTUNMAP = 4

#: Transparent huge page size on x86-64 and 4 KiB-page arm64: reservations are
#: aligned to it so that committed memory can be backed by huge pages where
#: the system's policy gives them.
HUGE_PAGE_BYTES = 2 << 20
PAGE_BYTES = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_MAP_FAILED = ctypes.c_void_p(-1).value

_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_mprotect = _libc.mprotect
_mprotect.restype = ctypes.c_int
_mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise = _libc.madvise
_madvise.restype = ctypes.c_int
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
# mremap is variadic in C; the fifth argument is read only with MREMAP_FIXED.
_mremap = _libc.mremap
_mremap.restype = ctypes.c_void_p
_mremap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_void_p,
]


def _raise(call: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{call}: {os.strerror(err)}")


def mmap_(addr: int, size: int, prot: int, flags: int, fd: int = -1) -> int:
    """``mmap(2)``; returns the mapped address."""
    ptr = _mmap(addr or None, size, prot, flags, fd, 0)
    if ptr == _MAP_FAILED or ptr is None:
        _raise("mmap")
    return int(ptr)


def munmap(addr: int, size: int) -> None:
    if _munmap(addr, size) != 0:
        _raise("munmap")


def mprotect(addr: int, size: int, prot: int) -> None:
    if _mprotect(addr, size, prot) != 0:
        _raise("mprotect")


def madvise(addr: int, size: int, advice: int) -> None:
    if _madvise(addr, size, advice) != 0:
        _raise("madvise")


def mremap_fixed(old: int, size: int, new: int, keep_old: bool) -> None:
    """Move the pages of ``[old, old + size)`` to ``new`` without copying.

    ``new`` is replaced atomically. With ``keep_old`` the old range stays
    mapped, empty (``MREMAP_DONTUNMAP``), so no other mapping can slip into it.
    """
    flags = MREMAP_MAYMOVE | MREMAP_FIXED | (MREMAP_DONTUNMAP if keep_old else 0)
    ptr = _mremap(old, size, size, flags, new)
    if ptr == _MAP_FAILED or ptr is None:
        _raise("mremap")


def memset_zero(addr: int, size: int) -> None:
    ctypes.memset(addr, 0, size)


def map_aligned(size: int, align: int, prot: int, flags: int) -> int:
    """Map ``size`` bytes of anonymous memory at an ``align``-aligned address.

    The kernel only promises page alignment, so map ``size + align`` bytes and
    unmap the slack on both sides.
    """
    ptr = mmap_(0, size + align, prot, flags | MAP_ANONYMOUS)
    start = (ptr + align - 1) & ~(align - 1)
    if start > ptr:
        munmap(ptr, start - ptr)
    tail = ptr + size + align - (start + size)
    if tail:
        munmap(start + size, tail)
    return start
