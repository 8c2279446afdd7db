"""The options ``LLM(..., additional_config={"extensible_kv": {...}})`` takes,
parsed once for the worker and the scheduler."""

from __future__ import annotations

from typing import Any

#: The options ``additional_config["extensible_kv"]`` takes.
OPTIONS = (
    *("num_blocks_capacity", "growth", "budget_wait_s", "cache_bytes"),
    *("floor_bytes", "cap_bytes"),
)
#: The values of the ``growth`` option.
GROWTH_MODES = ("static", "on_demand", "elastic")
#: What ``scheduler_cls`` names for ``growth: "elastic"``.
SCHEDULER = "extensible_kv.integrations.vllm.ExtensibleKVScheduler"


def _option_error(name: str, value: object, rule: str) -> ValueError:
    return ValueError(f"additional_config['extensible_kv'][{name!r}] is {value!r}; {rule}")


def options_of(vllm_config: Any) -> dict[str, Any]:
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
    _check_floor_and_cap(options)
    if growth in ("on_demand", "elastic") and vllm_config.kv_transfer_config is not None:
        raise _option_error(
            "growth",
            growth,
            "it cannot serve a KV connector: what a connector registers must not grow; "
            "use 'static'",
        )
    if growth == "elastic":
        check_scheduler(vllm_config)
    return options


def _check_floor_and_cap(options: dict[str, Any]) -> None:
    """``floor_bytes`` (an int, 0 or more) and ``cap_bytes`` (an int, 1 or
    more), the floor not above the cap."""
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


def check_scheduler(vllm_config: Any) -> None:
    """Refuse ``growth: "elastic"`` without our scheduler, in one line."""
    chosen = vllm_config.scheduler_config.scheduler_cls
    from extensible_kv.integrations.vllm.scheduler.scheduler import ExtensibleKVScheduler

    if chosen is None or not (
        chosen == SCHEDULER
        or (isinstance(chosen, type) and issubclass(chosen, ExtensibleKVScheduler))
        or (
            isinstance(chosen, str)
            and issubclass(vllm_config.scheduler_config.get_scheduler_cls(), ExtensibleKVScheduler)
        )
    ):
        raise ValueError(
            f"additional_config['extensible_kv']['growth'] 'elastic' needs "
            f"scheduler_cls={SCHEDULER!r} (the scheduler decides what memory the workers "
            f"hold), got scheduler_cls={chosen!r}"
        )
