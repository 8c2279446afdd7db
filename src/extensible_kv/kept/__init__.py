"""KV pages that outlive their engine: a keeper process of ours holds the
pages of a stopping engine's cached blocks, with what names them (the
engine's fingerprint and its block hashes), until a new engine with the
same fingerprint adopts them (mapping the same pages: no copy), someone
drops them, or the time the user set runs out.

``record.py``: what a keeper publishes in the state directory; ``wire.py``:
the messages; ``keeper.py``: the keeper process; ``hand.py``: leaving pages
to a keeper and adopting them.
"""

from extensible_kv.kept.hand import Adopted, SpareKeeper, adopt, leave, name, start_keeper
from extensible_kv.kept.record import KeptCache, drop, kept_caches

__all__ = [
    "Adopted",
    "KeptCache",
    "SpareKeeper",
    "adopt",
    "drop",
    "kept_caches",
    "leave",
    "name",
    "start_keeper",
]
