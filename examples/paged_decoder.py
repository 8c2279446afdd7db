"""The runner flow of docs/design.md section 6 on a tiny paged-attention decoder.

    python examples/paged_decoder.py                 # best device
    python examples/paged_decoder.py --device cpu --capacity-blocks 1024

Reserve the KV cache at an upper bound and commit one block; warm up through
``ensure_blocks`` (capturing a CUDA graph on a GPU); measure what warm-up
used and commit the final size; generate; sleep (release) and wake
(recommit); generate again. The tokens are checked against the same model
on ordinary ``torch.zeros`` KV memory. The flow itself is
``extensible_kv.demo.flow.run_flow``, written to be read as an engine
integration; the model is ``extensible_kv.demo.model``.
"""

from __future__ import annotations

import argparse

import torch

from extensible_kv.demo import FlowSettings, run_flow

MiB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--capacity-blocks", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=40)
    args = parser.parse_args()
    report = run_flow(
        args.device, FlowSettings(capacity_blocks=args.capacity_blocks, new_tokens=args.new_tokens)
    )
    print(report.sizing.describe())
    for phase in report.timeline:
        print(
            f"{phase.name:<15} committed {phase.committed_bytes / MiB:7.1f} MiB, "
            f"physical {phase.physical_bytes / MiB:7.1f} MiB, {phase.seconds * 1e3:7.1f} ms"
        )
    print("tokens match ordinary KV memory:", report.ok)
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
