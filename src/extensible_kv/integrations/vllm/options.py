"""The options ``LLM(..., additional_config={"extensible_kv": {...}})`` takes,
parsed once (by the scheduler when it is made, by the worker at their
first use) into an :class:`Options` that each keeps and passes on."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

#: The options ``additional_config["extensible_kv"]`` takes.
OPTIONS = (
    *("num_blocks_capacity", "growth", "budget_wait_s", "cache_bytes"),
    *("floor_bytes", "cap_bytes", "keep_prefix_cache_s"),
)
#: The values of the ``growth`` option.
GROWTH_MODES = ("static", "on_demand", "elastic")
#: What ``scheduler_cls`` names for ``growth: "elastic"``.
SCHEDULER = "extensible_kv.integrations.vllm.ExtensibleKVScheduler"
#: The class attribute, true, that marks a scheduler as ours (or a subclass
#: of ours): it sends the workers the orders elastic growth follows. The
#: check reads the mark, so this module needs no import of the scheduler.
SCHEDULER_MARK = "sends_elastic_orders"

__all__ = ["GROWTH_MODES", "OPTIONS", "SCHEDULER", "SCHEDULER_MARK", "Options", "options_of"]


@dataclasses.dataclass(frozen=True)
class Options:
    """The ``extensible_kv`` options of one engine, checked (see the module).

    Attributes:
        num_blocks_capacity: blocks to reserve address space for, as given
            (None: as many as the device's memory holds); checked against
            vLLM's block count when the worker reserves.
        growth: one of :data:`GROWTH_MODES`.
        budget_wait_s: seconds a wake may wait for room under the device's budget.
        cache_bytes: with ``growth`` ``"elastic"``, the most bytes kept for
            the prefix cache (None: the scheduler's default).
        floor_bytes: the bytes this rank's budget keeps for it.
        cap_bytes: the most bytes this rank may claim (None: no cap).
        keep_prefix_cache_s: with ``growth`` ``"elastic"``, the seconds the
            pages of the prefix cache outlive the engine's stop, held by a
            keeper process, for an engine started again with the same
            fingerprint to adopt (None: off).
    """

    num_blocks_capacity: object = None
    growth: str = "static"
    budget_wait_s: float = 0.0
    cache_bytes: int | None = None
    floor_bytes: int = 0
    cap_bytes: int | None = None
    keep_prefix_cache_s: float | None = None


def _option_error(name: str, value: object, rule: str) -> ValueError:
    return ValueError(f"additional_config['extensible_kv'][{name!r}] is {value!r}; {rule}")


def options_of(vllm_config: Any) -> Options:
    """The ``extensible_kv`` options of ``vllm_config``, checked; a
    ValueError names the rule an option breaks."""
    extra = vllm_config.additional_config or {}
    options = extra.get("extensible_kv", {}) if isinstance(extra, dict) else {}
    unknown = sorted(set(options) - set(OPTIONS)) if isinstance(options, dict) else []
    if not isinstance(options, dict) or unknown:
        raise ValueError(
            f"additional_config['extensible_kv'] takes a dict with "
            f"{', '.join(OPTIONS)} only, got {', '.join(unknown) or repr(options)}"
        )
    growth = options.get("growth", "static")
    if growth not in GROWTH_MODES:
        raise _option_error("growth", growth, f"give one of {', '.join(map(repr, GROWTH_MODES))}")
    wait = options.get("budget_wait_s", 0)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0:
        raise _option_error(
            "budget_wait_s",
            wait,
            "give the seconds a wake may wait for room under the device's budget (0 or more)",
        )
    cache = options.get("cache_bytes")
    if cache is not None and (isinstance(cache, bool) or not isinstance(cache, int) or cache < 0):
        raise _option_error(
            "cache_bytes", cache, "give the bytes kept for the prefix cache (an int, 0 or more)"
        )
    if cache is not None and growth != "elastic":
        raise _option_error(
            "cache_bytes", cache, "it bounds the prefix cache of growth 'elastic' only"
        )
    floor, cap = _floor_and_cap(options)
    keep = _keep_s(options, growth, vllm_config)
    if growth in ("on_demand", "elastic") and vllm_config.kv_transfer_config is not None:
        raise _option_error(
            "growth",
            growth,
            "it cannot serve a KV connector: what a connector registers must not grow; "
            "use 'static'",
        )
    if growth == "elastic":
        check_scheduler(vllm_config)
    return Options(
        num_blocks_capacity=options.get("num_blocks_capacity"),
        growth=growth,
        budget_wait_s=float(wait),
        cache_bytes=cache,
        floor_bytes=floor,
        cap_bytes=cap,
        keep_prefix_cache_s=keep,
    )


def _floor_and_cap(options: dict[str, Any]) -> tuple[int, int | None]:
    """``floor_bytes`` (an int, 0 or more) and ``cap_bytes`` (an int, 1 or
    more, or None), the floor not above the cap."""
    floor, cap = options.get("floor_bytes", 0), options.get("cap_bytes")
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 0:
        raise _option_error(
            "floor_bytes",
            floor,
            "give the bytes this rank's budget keeps for it (an int, 0 or more)",
        )
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise _option_error(
            "cap_bytes", cap, "give the most bytes this rank may claim (an int, 1 or more)"
        )
    if cap is not None and floor > cap:
        raise _option_error("floor_bytes", floor, f"it is above cap_bytes ({cap})")
    return floor, cap


def _keep_s(options: dict[str, Any], growth: str, vllm_config: Any) -> float | None:
    """``keep_prefix_cache_s``: None, or seconds (a positive, finite
    number), with growth ``"elastic"`` and block hashes that another
    process computes alike."""
    keep = options.get("keep_prefix_cache_s")
    if keep is None:
        return None
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < keep < float("inf"):
        raise _option_error(
            "keep_prefix_cache_s",
            keep,
            "give the seconds the prefix cache outlives the engine (a positive number)",
        )
    if growth != "elastic":
        raise _option_error(
            "keep_prefix_cache_s", keep, "it keeps the prefix cache of growth 'elastic' only"
        )
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    if algo.startswith("xxhash") and "PYTHONHASHSEED" not in os.environ:
        # vLLM seeds xxhash block hashes at random in each process unless
        # PYTHONHASHSEED is set: a new engine could not find the old blocks.
        raise _option_error(
            "keep_prefix_cache_s",
            keep,
            f"prefix_caching_hash_algo {algo!r} hashes blocks differently in every process "
            f"unless PYTHONHASHSEED is set: set it, or use 'sha256'",
        )
    return float(keep)


def _is_ours(scheduler: object) -> bool:
    """Whether ``scheduler`` is a class carrying :data:`SCHEDULER_MARK`."""
    return isinstance(scheduler, type) and getattr(scheduler, SCHEDULER_MARK, False) is True


def check_scheduler(vllm_config: Any) -> None:
    """Refuse ``growth: "elastic"`` without our scheduler, in one line."""
    chosen = vllm_config.scheduler_config.scheduler_cls
    if chosen is None or not (
        chosen == SCHEDULER
        or _is_ours(chosen)
        or (isinstance(chosen, str) and _is_ours(vllm_config.scheduler_config.get_scheduler_cls()))
    ):
        raise ValueError(
            f"additional_config['extensible_kv']['growth'] 'elastic' needs "
            f"scheduler_cls={SCHEDULER!r} (the scheduler decides what memory the workers "
            f"hold), got scheduler_cls={chosen!r}"
        )
