"""The runner flow on a tiny paged-attention model: what ``extensible-kv demo`` runs."""

from extensible_kv.demo.flow import FlowReport, FlowSettings, Phase, run_flow, run_ranks
from extensible_kv.demo.model import ModelConfig, TinyDecoder

__all__ = [
    "FlowReport",
    "FlowSettings",
    "ModelConfig",
    "Phase",
    "TinyDecoder",
    "run_flow",
    "run_ranks",
]
