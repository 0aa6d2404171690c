"""Every transport term's default equals the figure in the source it cites, and reaches the
topology that names the transport."""

from __future__ import annotations

import pytest

from collsim.cluster.topology import load_topology, parse_topology
from collsim.cluster.transports import (
    EFA_PLATFORMS,
    NCCL_RELEASES,
    TRANSPORTS,
    transport_for,
)
from collsim.core.vocab import FabricKind, Protocol
from collsim.core.yamlio import parse_yaml_text

_ALL = {Protocol.LL, Protocol.LL128, Protocol.SIMPLE}

# (kind, term, value, a file the source names). The values are read off the sources:
# aws-ofi-nccl 2daf7d30 src/platform-aws.cpp platform_data_map (.latency = 75.0 for p4d, p4de,
# p5/p5e; 35.0 for p5en/p6-b200), include/nccl_ofi_param.h (TUNER_NET_COMP_OVERHEAD 3);
# NCCL 2.30.7 src/transport/net_ib (props->latency = 0) and src/graph/tuning.cc (NET row);
# NVIDIA GTC24 S62129 (48 of 50 GB/s on one 400 Gb/s NIC = 0.96).
TERMS = [
    ("infiniband", "net_latency_us", 0.0, "net_ib"),
    ("infiniband", "completion_us", 0.0, "tuning.cc"),
    ("infiniband", "nic_efficiency", 0.96, "S62129"),
    ("infiniband", "protocols", _ALL, "net_ib"),
    ("infiniband", "channels_per_peer", 2, "NCHANNELS_PER_NET_PEER"),
    ("infiniband", "pxn", True, "PXN_DISABLE"),
    ("infiniband", "tuner", "nccl", "net_ib"),
    ("roce", "net_latency_us", 0.0, "net_ib"),
    ("roce", "completion_us", 0.0, "net_ib"),
    ("roce", "nic_efficiency", 0.96, "InfiniBand's figures"),
    ("roce", "protocols", _ALL, "net_ib"),
    ("roce", "channels_per_peer", 2, "NCHANNELS_PER_NET_PEER"),
    ("roce", "pxn", True, "PXN_DISABLE"),
    ("efa", "net_latency_us", 75.0, "platform-aws.cpp"),
    ("efa", "completion_us", 3.0, "TUNER_NET_COMP_OVERHEAD"),
    ("efa", "nic_efficiency", 0.96, "no EFA figure"),
    ("efa", "protocols", _ALL, "platform-aws.cpp"),
    ("efa", "channels_per_peer", 2, "NCHANNELS_PER_NET_PEER"),
    ("efa", "pxn", True, "PXN_DISABLE"),
    ("efa", "tuner", "nccl", "platform-aws.cpp"),
    # TCPXO: fitted to the A3 Mega sweep (no source gives them); the fit is re-run by
    # tests/collectives/test_a3mega.py
    ("tcpxo", "net_latency_us", 54.0, "test_a3mega.py"),
    ("tcpxo", "net_simple_latency_us", 420.0, "test_a3mega.py"),
    ("tcpxo", "nic_efficiency", 1.0, "test_a3mega.py"),
    ("tcpxo", "protocols", {Protocol.LL, Protocol.SIMPLE}, "LL128 not used across TCPXO"),
]


@pytest.mark.parametrize(("kind", "term", "value", "cited"), TERMS)
def test_each_term_is_its_sources_figure(kind: str, term: str, value: object, cited: str) -> None:
    transport = TRANSPORTS[FabricKind(kind)]
    assert getattr(transport, term) == value
    assert cited in transport.source


@pytest.mark.parametrize(
    ("platform", "latency_us", "rails", "rail_gbit", "per_gpu", "tuner"),
    [
        # platform-aws.cpp .latency; EC2 instance pages for the interfaces; nccl_ofi_model.cpp
        # num_rails (per GPU) for the plugin's RDMA striping
        ("p4d", 75.0, 4, 100.0, 0, None),
        ("p4de", 75.0, 4, 100.0, 0, None),
        ("p5", 75.0, 32, 100.0, 4, "p5_p5e"),
        ("p5e", 75.0, 32, 100.0, 4, "p5_p5e"),
        ("p5en", 35.0, 16, 200.0, 2, "p5en"),
    ],
)
def test_efa_platforms(
    platform: str, latency_us: float, rails: int, rail_gbit: float, per_gpu: int, tuner: str | None
) -> None:
    found = EFA_PLATFORMS[platform]
    assert (found.net_latency_us, found.rails_per_node, found.rail_gbit) == (
        latency_us,
        rails,
        rail_gbit,
    )
    assert (found.rails_per_gpu, found.tuner_platform) == (per_gpu, tuner)
    assert found.buffsize_bytes == 8388608  # NCCL_BUFFSIZE the plugin sets
    assert "platform-aws.cpp" in found.source
    efa = transport_for(FabricKind.EFA, platform)
    assert efa.net_latency_us == latency_us
    # NCCL adds latencyInter twice to a Simple step (tuning.cc, the flush) and the plugin's
    # completion overhead once
    assert efa.net_simple_latency_us == 2 * latency_us + 3.0


@pytest.mark.parametrize(
    ("name", "platform", "per_gpu_gbit", "tuner"),
    [
        ("aws_p4d", "p4d", 50.0, "nccl"),
        ("aws_p4de", "p4de", 50.0, "nccl"),
        ("aws_p5", "p5", 400.0, "aws-ofi-nccl"),
        ("aws_p5e", "p5e", 400.0, "aws-ofi-nccl"),
        ("aws_p5en", "p5en", 400.0, "aws-ofi-nccl"),
    ],
)
def test_aws_topologies_carry_their_platform(
    name: str, platform: str, per_gpu_gbit: float, tuner: str
) -> None:
    topo = load_topology(name, nodes=2)
    found = EFA_PLATFORMS[platform]
    assert topo.fabric.platform == platform and topo.fabric.tuner == tuner
    assert topo.fabric.net_latency_s == pytest.approx(found.net_latency_us * 1e-6)
    assert topo.fabric.net_simple_latency_s == pytest.approx(
        (2 * found.net_latency_us + 3.0) * 1e-6
    )
    assert topo.nics is not None
    # the node's EFA line rate, whether NCCL sees one device per interface or striped ones
    assert topo.nics.count * topo.nics.bandwidth_bps * 8 == pytest.approx(
        found.rails_per_node * found.rail_gbit * 1e9
    )
    assert topo.nics.count * topo.nics.bandwidth_bps * 8 / 8 / 1e9 == pytest.approx(per_gpu_gbit)
    assert topo.collectives.nccl_version == NCCL_RELEASES[-1]


@pytest.mark.parametrize(
    ("name", "kind", "nic_gbit", "nics"),
    [("azure_nd_h100_v5", "infiniband", 400, 8), ("oci_bm_gpu_h100_8", "roce", 400, 8)],
)
def test_other_rented_clusters(name: str, kind: str, nic_gbit: float, nics: int) -> None:
    topo = load_topology(name, nodes=2)
    assert topo.fabric.kind.value == kind and topo.fabric.tuner == "nccl" and topo.nvls
    assert topo.nics is not None and topo.nics.count == nics
    assert topo.nics.bandwidth_bps * 8 == pytest.approx(nic_gbit * 1e9)
    assert topo.fabric.net_latency_s == 0.0


_DOC = """\
name: t
device: h100
gpus_per_node: 8
intra_node: {interconnect: nvswitch, bandwidth_gbps: 450}
nics: {count: 8, rate_gbit: 400}
fabric:
  kind: efa
"""


def test_completion_key_sets_the_simple_step() -> None:
    doc = _DOC + "  net_latency_us: 10\n  completion_us: 4\n"
    topo = parse_topology(parse_yaml_text(doc, "t.yaml"), nodes=2)
    assert topo.fabric.net_simple_latency_s == pytest.approx(24e-6)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("  completion_us: 4\n  net_simple_latency_us: 9\n", "not both"),
        ("  platform: p9\n", "platform"),
        ("  tuner: mine\n", "tuner"),
    ],
)
def test_bad_transport_keys_are_refused(extra: str, message: str) -> None:
    from collsim.core.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_topology(parse_yaml_text(_DOC + extra, "t.yaml"), nodes=2)


def test_platform_needs_efa() -> None:
    from collsim.core.errors import ConfigError

    doc = _DOC.replace("kind: efa", "kind: roce") + "  platform: p5\n"
    with pytest.raises(ConfigError, match="needs kind: efa"):
        parse_topology(parse_yaml_text(doc, "t.yaml"), nodes=2)


def test_nccl_version_is_a_checked_key() -> None:
    from collsim.core.errors import ConfigError

    doc = _DOC + "collectives: {nccl_version: '2.18.1'}\n"
    with pytest.raises(ConfigError, match="nccl_version"):
        parse_topology(parse_yaml_text(doc, "t.yaml"), nodes=2)


def test_a_transport_without_ll_has_no_ll_across_nodes() -> None:
    from collsim.collectives import CollectiveOp, Group, tuner
    from collsim.core.vocab import Protocol

    with_ll = parse_topology(parse_yaml_text(_DOC, "t.yaml"), nodes=2)
    without = parse_topology(parse_yaml_text(_DOC + "  ll: false\n", "t.yaml"), nodes=2)
    sizes = [1 << k for k in range(3, 20)]
    picks = [tuner.pick(CollectiveOp.ALL_REDUCE, s, Group.all(with_ll)) for s in sizes]
    assert any(p is not None and p[1] is Protocol.LL for p in picks)  # small sizes run LL
    for s in sizes:
        pick = tuner.pick(CollectiveOp.ALL_REDUCE, s, Group.all(without))
        assert pick is not None and pick[1] is not Protocol.LL
    one_node = parse_topology(parse_yaml_text(_DOC + "  ll: false\n", "t.yaml"), nodes=1)
    inside = tuner.pick(CollectiveOp.ALL_REDUCE, 1 << 10, Group.all(one_node))
    assert inside is not None and inside[1] is Protocol.LL  # inside a node LL stays
