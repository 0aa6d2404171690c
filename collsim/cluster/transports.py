"""The transports between nodes (InfiniBand, RoCE, EFA, TCPXO) as data, each figure with its source.

A transport sets what NCCL's cost model takes from the network plugin and what the plugin adds:
the latency it reports to NCCL (``latencyInter``, added to every LL / LL128 network step, twice to
a Simple one for the flush, NVIDIA/nccl 2.30.7 src/graph/tuning.cc), a completion cost per Simple
network step (the transport's completion path and NCCL's proxy thread), the protocols that run
across nodes, the achievable share of a rail's line rate, NCCL's channels per network peer and PXN,
and, where the plugin brings one, its tuner. EFA's figures differ by instance family
(:data:`EFA_PLATFORMS`, aws/aws-ofi-nccl src/platform-aws.cpp). Derivations and the releases
covered are in docs/topologies.md ("Transports").
"""

from __future__ import annotations

from dataclasses import dataclass

from collsim.core.vocab import FabricKind, Protocol

__all__ = [
    "AWS_OFI_NCCL",
    "EFA_PLATFORMS",
    "NCCL_RELEASES",
    "TRANSPORTS",
    "TUNERS",
    "EfaPlatform",
    "Transport",
    "transport_for",
]

AWS_OFI_NCCL = "aws/aws-ofi-nccl 2daf7d30 (v1.4.0-1383, 2026-08-21)"
"""The aws-ofi-nccl commit the EFA figures are read from."""
NCCL_RELEASES = ("2.30.7",)
"""NCCL releases the cost model follows (collsim.collectives.tuner.NCCL_RELEASE); a topology's
``collectives.nccl_version`` must be one of them."""
TUNERS = ("nccl", "aws-ofi-nccl")
"""``fabric.tuner`` values: NCCL's own choice, or the aws-ofi-nccl tuner plugin's where it has
regions for the platform (then NCCL's where it has none)."""

_LL, _LL128, _SIMPLE = Protocol.LL, Protocol.LL128, Protocol.SIMPLE
_ALL = frozenset({_LL, _LL128, _SIMPLE})


@dataclass(frozen=True, slots=True, kw_only=True)
class Transport:
    """What one transport sets unless the topology file says otherwise; every term sourced."""

    kind: FabricKind
    net_latency_us: float
    """The latency the network plugin reports to NCCL (``ncclNetProperties_t.latency``), which
    tuning.cc adds to every network step: NCCL's ``graph->latencyInter``, us."""
    completion_us: float
    """Per Simple network step, us, beyond NCCL's flush (the second ``latencyInter``): the
    transport's completion path and NCCL's proxy thread handling it."""
    protocols: frozenset[Protocol]
    """Protocols NCCL runs across nodes on this transport."""
    nic_efficiency: float
    """Achievable share of a rail's line rate for NCCL traffic (``nics.efficiency``)."""
    channels_per_peer: int
    """NCCL's channels per network peer (NCCL_NCHANNELS_PER_NET_PEER default)."""
    pxn: bool
    """NCCL sends through a peer GPU's NIC on the same node (PXN; NCCL_PXN_DISABLE=0)."""
    tuner: str
    """``nccl`` or the plugin tuner the transport brings (:data:`TUNERS`)."""
    source: str

    @property
    def net_simple_latency_us(self) -> float:
        """Per Simple network step, us: ``latencyInter`` twice (tuning.cc, "the flush extra
        latency") plus the completion cost."""
        return 2.0 * self.net_latency_us + self.completion_us

    @property
    def ll128(self) -> bool:
        """Whether LL128 runs across nodes."""
        return _LL128 in self.protocols


@dataclass(frozen=True, slots=True, kw_only=True)
class EfaPlatform:
    """One EC2 instance family's EFA figures (aws-ofi-nccl src/platform-aws.cpp
    ``platform_data_map``; the rails from the EC2 instance-type pages)."""

    name: str
    net_latency_us: float
    """``latency`` the plugin reports to NCCL for this family."""
    rails_per_node: int
    """EFA interfaces per instance."""
    rail_gbit: float
    """Line rate of one EFA interface, Gb/s."""
    rails_per_gpu: int
    """Interfaces the plugin stripes one NCCL device over (its RDMA protocol's rails;
    src/tuner/nccl_ofi_model.cpp ``num_rails``); 0 where one interface serves two GPUs."""
    protocols: frozenset[Protocol]
    tuner_platform: str | None
    """The plugin tuner's platform (``p5_p5e`` or ``p5en``), None where it has none."""
    buffsize_bytes: int
    """NCCL_BUFFSIZE the plugin sets for the family."""
    source: str


_PLATFORM_SRC = f"{AWS_OFI_NCCL} src/platform-aws.cpp platform_data_map"
EFA_PLATFORMS: dict[str, EfaPlatform] = {
    "p4d": EfaPlatform(
        name="p4d.24xlarge",
        net_latency_us=75.0,
        rails_per_node=4,
        rail_gbit=100.0,
        rails_per_gpu=0,
        protocols=_ALL,
        tuner_platform=None,
        buffsize_bytes=8 << 20,
        source=f"{_PLATFORM_SRC} (p4d.24xlarge: latency 75, SENDRECV protocol, NCCL_BUFFSIZE "
        "8388608); 4 x 100 Gb/s EFA (EC2 P4d instance page: 400 Gbps EFA)",
    ),
    "p4de": EfaPlatform(
        name="p4de.24xlarge",
        net_latency_us=75.0,
        rails_per_node=4,
        rail_gbit=100.0,
        rails_per_gpu=0,
        protocols=_ALL,
        tuner_platform=None,
        buffsize_bytes=8 << 20,
        source=f"{_PLATFORM_SRC} (p4de.24xlarge: latency 75, SENDRECV protocol); 4 x 100 Gb/s "
        "EFA (EC2 P4de instance page: 400 Gbps EFA)",
    ),
    "p5": EfaPlatform(
        name="p5.48xlarge",
        net_latency_us=75.0,
        rails_per_node=32,
        rail_gbit=100.0,
        rails_per_gpu=4,
        protocols=_ALL,
        tuner_platform="p5_p5e",
        buffsize_bytes=8 << 20,
        source=f"{_PLATFORM_SRC} (p5/p5e: latency 75, RDMA protocol, NCCL_BUFFSIZE 8388608); "
        "src/tuner/nccl_ofi_model.cpp (P5 & P5e: num_rails 4, internode_bw 12.5 GB/s per "
        "rail); 32 x 100 Gb/s EFA (EC2 P5 instance page: 3200 Gbps EFAv2)",
    ),
    "p5e": EfaPlatform(
        name="p5e.48xlarge",
        net_latency_us=75.0,
        rails_per_node=32,
        rail_gbit=100.0,
        rails_per_gpu=4,
        protocols=_ALL,
        tuner_platform="p5_p5e",
        buffsize_bytes=8 << 20,
        source=f"{_PLATFORM_SRC} (p5/p5e regex ^p5(e?\\..*): latency 75); nccl_ofi_model.cpp "
        "(P5 & P5e: num_rails 4); 32 x 100 Gb/s EFA (EC2 P5e instance page: 3200 Gbps)",
    ),
    "p5en": EfaPlatform(
        name="p5en.48xlarge",
        net_latency_us=35.0,
        rails_per_node=16,
        rail_gbit=200.0,
        rails_per_gpu=2,
        protocols=_ALL,
        tuner_platform="p5en",
        buffsize_bytes=8 << 20,
        source=f"{_PLATFORM_SRC} (p5en/p6-b200: latency 35, RDMA protocol, the NCCL_PROTO "
        "ordering check skipped on p5en so LL / LL128 stay on); nccl_ofi_model.cpp (P5en: "
        "num_rails 2, internode_bw 25 GB/s per rail); 16 x 200 Gb/s EFAv3 (EC2 P5en page)",
    ),
}
"""EFA figures per instance family (``fabric.platform``)."""

_NCCL_CHANNELS = (
    "NCCL src/graph/paths.cc NCCL_NCHANNELS_PER_NET_PEER (2 where the release fixes it, -1 = "
    "auto in later ones; point-to-point only, no term of the collectives' cost) and "
    "NCCL_PXN_DISABLE default 0"
)

TRANSPORTS: dict[FabricKind, Transport] = {
    FabricKind.INFINIBAND: Transport(
        kind=FabricKind.INFINIBAND,
        net_latency_us=0.0,
        completion_us=0.0,
        protocols=_ALL,
        nic_efficiency=0.96,
        channels_per_peer=2,
        pxn=True,
        tuner="nccl",
        source="NCCL 2.30.7 src/transport/net_ib (props->latency 0: NCCL's own NET row in "
        "tuning.cc was measured on IB verbs); one 400 Gb/s RDMA NIC: nccl busbw 48 of 50 GB/s "
        f"(NVIDIA GTC24 S62129); {_NCCL_CHANNELS}",
    ),
    FabricKind.ROCE: Transport(
        kind=FabricKind.ROCE,
        net_latency_us=0.0,
        completion_us=0.0,
        protocols=_ALL,
        nic_efficiency=0.96,
        channels_per_peer=2,
        pxn=True,
        tuner="nccl",
        source="RoCE v2 runs NCCL's IB verbs plugin (NCCL 2.30.7 src/transport/net_ib, "
        "props->latency 0): InfiniBand's figures; no RoCE-specific figure in a source "
        f"read; {_NCCL_CHANNELS}",
    ),
    FabricKind.EFA: Transport(
        kind=FabricKind.EFA,
        net_latency_us=EFA_PLATFORMS["p5"].net_latency_us,
        completion_us=3.0,
        protocols=_ALL,
        nic_efficiency=0.96,
        channels_per_peer=2,
        pxn=True,
        tuner="nccl",
        source=f"{AWS_OFI_NCCL}: latency reported to NCCL 75 us on p4d / p5 / p5e "
        "(src/platform-aws.cpp; fabric.platform picks the family); completion 3 us per Simple "
        "network step (include/nccl_ofi_param.h TUNER_NET_COMP_OVERHEAD: ~2 us in the device "
        "and ~1 us to write the completion to the host); LL / LL128 run where the device "
        "delivers 128-byte writes in order (src/platform-aws.cpp, else NCCL_PROTO=simple); "
        "rail efficiency: InfiniBand's 0.96, no EFA figure in a source read (fit it with "
        f"collsim validate calibrate); {_NCCL_CHANNELS}",
    ),
    FabricKind.TCPXO: Transport(
        kind=FabricKind.TCPXO,
        net_latency_us=54.0,
        completion_us=420.0 - 2 * 54.0,
        protocols=frozenset({_LL, _SIMPLE}),
        nic_efficiency=1.0,
        channels_per_peer=2,
        pxn=True,
        tuner="nccl",
        source="fitted to the two-node GCP A3 Mega all_reduce sweep "
        "(tests/data/nccl_allreduce_h100_2node_a3mega.csv), sizes <= 4 MiB and >= 1 GiB "
        "only, least squares of log time: the small sizes grow at NCCL's LL cap (LL128 not "
        "used across TCPXO) and give the LL latency 54 us, 1-8 GiB the Simple latency 420 us "
        "(2 x 54 + 312 completion) and the rate (at its bound, 1.0 of 200 Gb/s: the tree "
        "keeps NCCL's 0.92 factor); see topologies/gcp_a3_mega.yaml and "
        f"tests/collectives/test_a3mega.py; {_NCCL_CHANNELS}",
    ),
    FabricKind.FAT_TREE: Transport(
        kind=FabricKind.FAT_TREE,
        net_latency_us=0.0,
        completion_us=0.0,
        protocols=_ALL,
        nic_efficiency=1.0,
        channels_per_peer=2,
        pxn=True,
        tuner="nccl",
        source=f"no transport defaults (the older spelling); {_NCCL_CHANNELS}",
    ),
}
"""Per-kind transport figures, each with its source."""


def transport_for(kind: FabricKind, platform: str | None = None) -> Transport:
    """The transport of ``kind``; for EFA, ``platform`` (a key of :data:`EFA_PLATFORMS`) sets
    the latency the plugin reports and the protocols."""
    base = TRANSPORTS[kind]
    if platform is None:
        return base
    found = EFA_PLATFORMS[platform]
    return Transport(
        kind=base.kind,
        net_latency_us=found.net_latency_us,
        completion_us=base.completion_us,
        protocols=found.protocols,
        nic_efficiency=base.nic_efficiency,
        channels_per_peer=base.channels_per_peer,
        pxn=base.pxn,
        tuner=base.tuner,
        source=f"{base.source}; platform: {found.source}",
    )
