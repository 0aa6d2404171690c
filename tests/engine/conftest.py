"""Small models and clusters for the engine tests."""

from __future__ import annotations

import functools

import pytest

from collsim.cluster.topology import load_topology
from collsim.workload.model import TransformerSpec


@functools.cache
def topology(name: str = "dgx_a100", nodes: int = 1):
    """A cached cluster (topologies/<name>.yaml with ``nodes`` nodes)."""
    return load_topology(name, nodes=nodes)


@pytest.fixture
def small_spec() -> TransformerSpec:
    """A 16-layer GPT small enough for fast steps (ffn 4h, MHA, dropout: Korthikanti's layer)."""
    return TransformerSpec(
        name="small",
        num_layers=16,
        hidden=512,
        num_heads=8,
        ffn_hidden=2048,
        seq_len=256,
        vocab=4096,
    )
