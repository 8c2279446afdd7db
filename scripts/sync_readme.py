"""Copy the measured tables from docs/performance.md into README.md.

docs/performance.md is the one source of the numbers; README.md shows the
same tables between the same markers (``<!-- name -->`` ... ``<!-- /name
-->``). Run after updating the numbers; ``--check`` fails if they differ.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "docs" / "performance.md"
TARGET = ROOT / "README.md"
BLOCK = re.compile(r"<!-- (?P<name>[a-z-]+) -->\n(?P<body>.*?)<!-- /(?P=name) -->", re.S)


def blocks(text: str) -> dict[str, str]:
    """The marked blocks of a text, by name."""
    return {m["name"]: m["body"] for m in BLOCK.finditer(text)}


def synced(source: str, target: str) -> str:
    """``target`` with every marked block replaced by the source's of that name."""
    found = blocks(source)

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in found:
            raise SystemExit(f"{SOURCE.name} has no block <!-- {name} -->")
        return f"<!-- {name} -->\n{found[name]}<!-- /{name} -->"

    return BLOCK.sub(replace, target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if README.md is out of date")
    args = parser.parse_args()
    target = TARGET.read_text()
    updated = synced(SOURCE.read_text(), target)
    if args.check:
        if updated != target:
            print("README.md's tables differ from docs/performance.md: run scripts/sync_readme.py")
            return 1
        return 0
    TARGET.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
