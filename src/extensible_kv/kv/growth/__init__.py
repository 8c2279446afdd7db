"""Growth policies over a cache: memory that follows the blocks in use up
(``on_demand.py``: :class:`OnDemandGrowth`, the committed prefix grows as
block ids are touched), or up and down anywhere in the cache
(``elastic.py``: :class:`ElasticBlocks`, units of blocks committed and
given back on an engine scheduler's orders)."""

from extensible_kv.kv.growth.elastic import (
    ElasticBlocks,
    ElasticOrders,
    ElasticReport,
    UnitRanges,
    ranges_of,
    units_of,
)
from extensible_kv.kv.growth.on_demand import OnDemandGrowth

__all__ = [
    "ElasticBlocks",
    "ElasticOrders",
    "ElasticReport",
    "OnDemandGrowth",
    "UnitRanges",
    "ranges_of",
    "units_of",
]
