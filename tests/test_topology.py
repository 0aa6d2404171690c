from __future__ import annotations

from pathlib import Path

import pytest

import collsim.cluster.topology.files as topology_module
from collsim.cluster.hardware import get_device
from collsim.cluster.topology import FABRIC_DEFAULTS, LinkKind, load_topology, parse_topology
from collsim.core.errors import ConfigError, InfeasibleError
from collsim.core.yamlio import YamlDoc, load_yaml, parse_yaml_text
from collsim.study.limits import check_scenario
from collsim.study.scenario import load_scenario

NAMES = [
    "dgx_a100",
    "dgx_h100",
    "dgx_h200",
    "dgx_b200",
    "pcie_8gpu",
    "localhost",
    "gcp_a3_mega",
    "oci_bm_gpu4_8",
    "aws_p4d",
    "aws_p4de",
    "aws_p5",
    "aws_p5e",
    "aws_p5en",
    "azure_nd_h100_v5",
    "oci_bm_gpu_h100_8",
]


@pytest.mark.parametrize("name", NAMES)
def test_every_shipped_topology_loads(name: str) -> None:
    topo = load_topology(name)
    assert topo.name == name
    assert topo.num_ranks == topo.num_nodes * topo.gpus_per_node
    assert all(link.bandwidth_bps > 0 and link.latency_s >= 0 for link in topo.links)


@pytest.mark.parametrize(
    ("name", "device", "nvlink_gbps", "nic_gbit", "nvls"),
    [
        ("dgx_a100", "A100 SXM 80GB", 300, 200, False),
        ("dgx_h100", "H100 SXM", 450, 400, True),
        ("dgx_h200", "H200 SXM", 450, 400, True),
        ("dgx_b200", "B200 SXM", 900, 400, True),
    ],
    ids=["a100", "h100", "h200", "b200"],
)
def test_dgx_figures(
    name: str, device: str, nvlink_gbps: float, nic_gbit: float, nvls: bool
) -> None:
    topo = load_topology(name, nodes=2)
    assert topo.device.name == device
    assert topo.nvls is nvls
    assert topo.links[topo.gpu_tx[0]].bandwidth_bps == pytest.approx(nvlink_gbps * 1e9)
    assert topo.nics is not None and topo.nics.count == 8
    nic_link = topo.links[topo.nic_tx[1][3]]
    assert nic_link.bandwidth_bps == pytest.approx(nic_gbit * 1e9 / 8)
    assert nic_link.kind is LinkKind.NETWORK


def test_h200_is_h100_with_more_memory() -> None:
    h100, h200 = load_topology("dgx_h100"), load_topology("dgx_h200")
    assert h200.device.memory_bytes == pytest.approx(141e9)
    assert [(l.bandwidth_bps, l.efficiency) for l in h100.links] == [
        (l.bandwidth_bps, l.efficiency) for l in h200.links
    ]


def test_nodes_are_set_by_the_caller() -> None:
    assert load_topology("dgx_h100", nodes=128).num_ranks == 1024
    assert load_topology("localhost", gpus_per_node=6).num_ranks == 6


def test_name_resolves_to_the_package_presets_and_path_works(repo: Path) -> None:
    from collsim.cluster.topology import PRESET_DIR

    by_name = load_topology("dgx_a100")
    by_path = load_topology(repo / "topologies" / "dgx_a100.yaml")
    assert Path(by_name.source).resolve() == (PRESET_DIR / "dgx_a100.yaml").resolve()
    assert Path(by_name.source).read_bytes() == Path(by_path.source).read_bytes()
    assert by_name.describe() == by_path.describe()


def test_paths() -> None:
    topo = load_topology("dgx_h100", nodes=2)
    assert topo.path(3, 3) == ()
    assert topo.path(0, 5) == (topo.gpu_tx[0], topo.gpu_rx[5])
    # rank 3 -> rank 11: NIC 3 of node 0 to NIC 3 of node 1 (same rail leaf, no uplink)
    assert topo.path(3, 11) == (topo.nic_tx[0][3], topo.nic_rx[1][3])
    assert topo.path(3, 11) is topo.path(3, 11)  # cached


def test_rails_cross_leaves_through_the_spine() -> None:
    # 4 nodes, 2 per leaf: nodes 0 and 2 sit on different leaves of rail 1.
    text = _DOC.replace("nodes_per_leaf: 32", "nodes_per_leaf: 2")
    topo = parse_topology(parse_yaml_text(text, "t.yaml"), nodes=4)
    path = topo.path(1, 2 * 8 + 1)
    names = [topo.links[i].name for i in path]
    assert names == ["n0.nic1.tx", "rail1.leaf0.up", "rail1.leaf1.down", "n2.nic1.rx"]
    uplink = topo.links[path[1]]
    # 2 nodes x 1 NIC per rail leaf, 400 Gb/s, 1:1
    assert uplink.bandwidth_bps == pytest.approx(2 * 400e9 / 8)


def test_oversubscribed_tor_uplink_is_shared_by_all_nics() -> None:
    text = (
        _DOC.replace("rails: true", "rails: false")
        .replace("nodes_per_leaf: 32", "nodes_per_leaf: 1")
        .replace("oversubscription: 1.0", "oversubscription: 4.0")
    )
    topo = parse_topology(parse_yaml_text(text, "t.yaml"), nodes=2)
    up = {topo.path(r, 8 + r)[1] for r in range(8)}
    assert len(up) == 1  # one ToR uplink for all 8 NICs
    assert topo.links[up.pop()].bandwidth_bps == pytest.approx(8 * 50e9 / 4)


def test_multi_node_without_nics_is_rejected() -> None:
    with pytest.raises(ConfigError, match="2 nodes asked but the topology has no 'nics'"):
        load_topology("localhost", nodes=2)


def test_rank_out_of_range() -> None:
    with pytest.raises(ConfigError, match="rank 8 out of range"):
        load_topology("dgx_h100").path(0, 8)


def test_no_nic_path_is_infeasible() -> None:
    with pytest.raises(InfeasibleError):
        load_topology("localhost").nic_of(0)


def test_algorithm_override_and_overhead() -> None:
    text = _DOC.replace(
        "library: nccl",
        "library: gloo\n  overhead_us: 30\n"
        "  algorithms: {all_reduce: ring, reduce_scatter: direct}",
    )
    topo = parse_topology(parse_yaml_text(text, "t.yaml"))
    assert topo.collectives.library == "gloo"
    assert topo.collectives.overhead_s == pytest.approx(30e-6)
    assert topo.collectives.algorithms == {"all_reduce": "ring", "reduce_scatter": "direct"}


_DOC = """\
name: t
device: h100
gpus_per_node: 8
intra_node:
  interconnect: nvswitch
  bandwidth_gbps: 450
  latency_us: 0.25
nics:
  count: 8
  rate_gbit: 400
  latency_us: 1.0
fabric:
  kind: fat_tree
  rails: true
  oversubscription: 1.0
  nodes_per_leaf: 32
collectives:
  library: nccl
"""


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        # unknown key, with its line
        (
            "  rate_gbit: 400\n",
            "  rate_gbit: 400\n  speed: 3\n",
            r"t\.yaml:11: nics\.speed: unknown key",
        ),
        # negative bandwidth
        (
            "bandwidth_gbps: 450",
            "bandwidth_gbps: -5",
            r"t\.yaml:6: intra_node\.bandwidth_gbps: must be > 0, got -5",
        ),
        # missing field (reported at its section)
        ("  rate_gbit: 400\n", "", r"t\.yaml:8: nics\.rate_gbit: missing required key"),
        # YAML syntax error
        ("  count: 8\n", "  count: [8\n", r"t\.yaml:\d+: YAML syntax error"),
        # wrong type
        ("rails: true", "rails: 3", r"t\.yaml:14: fabric\.rails: must be true or false"),
        # oversubscription below 1
        (
            "oversubscription: 1.0",
            "oversubscription: 0.5",
            r"fabric\.oversubscription: must be >= 1",
        ),
        # unknown device
        ("device: h100", "device: v100", r"t\.yaml:2: device: unknown device 'v100'"),
        # unknown algorithm in an override
        (
            "library: nccl",
            "library: nccl\n  algorithms: {all_reduce: magic}",
            r"collectives\.algorithms\.all_reduce: must be one of",
        ),
        # unknown op in an override
        (
            "library: nccl",
            "library: nccl\n  algorithms: {allreduce: ring}",
            r"collectives\.algorithms\.allreduce: unknown op",
        ),
        # unknown fabric kind, the choices listed
        (
            "kind: fat_tree",
            "kind: omnipath",
            r"t\.yaml:13: fabric\.kind: must be one of .*infiniband.*roce.*efa.*tcpxo",
        ),
        # a transport latency below 0
        (
            "  rails: true\n",
            "  rails: true\n  net_latency_us: -1\n",
            r"fabric\.net_latency_us: must be >= 0",
        ),
        # an unknown CPU vendor
        ("collectives:\n", "host: {cpu_vendor: arm}\ncollectives:\n", r"host\.cpu_vendor"),
    ],
    ids=[
        "unknown-key",
        "negative-bandwidth",
        "missing-field",
        "yaml-syntax",
        "wrong-type",
        "oversubscription",
        "unknown-device",
        "unknown-algorithm",
        "unknown-op",
        "unknown-fabric-kind",
        "net-latency-negative",
        "cpu-vendor",
    ],
)
def test_malformed_topology_names_file_line_and_key(old: str, new: str, message: str) -> None:
    assert old in _DOC
    with pytest.raises(ConfigError, match=message):
        parse_topology(parse_yaml_text(_DOC.replace(old, new), "t.yaml"))


def test_unknown_name_lists_known_topologies() -> None:
    with pytest.raises(ConfigError, match="known names: .*dgx_h100.*localhost"):
        load_topology("dgx_z100")


def _with_kind(kind: str, extra: str = "") -> str:
    return _DOC.replace("kind: fat_tree\n", f"kind: {kind}\n{extra}")


@pytest.mark.parametrize(
    ("kind", "efficiency", "ll_us", "simple_us", "ll128"),
    [
        # NCCL's NET latencies were measured on IB verbs: the transport adds nothing
        ("infiniband", 0.96, 0.0, 0.0, True),
        ("roce", 0.96, 0.0, 0.0, True),
        # aws-ofi-nccl reports 75 us to NCCL on p4d / p5 (src/platform-aws.cpp); Simple pays
        # it twice (the flush) plus the 3 us completion (TUNER_NET_COMP_OVERHEAD)
        ("efa", 0.96, 75.0, 153.0, True),
        # fitted to the A3 Mega sweep (tests/collectives/test_a3mega.py)
        ("tcpxo", 1.0, 54.0, 420.0, False),
        # the older spelling: no transport defaults at all
        ("fat_tree", 1.0, 0.0, 0.0, True),
    ],
)
def test_fabric_kind_sets_sourced_defaults(
    kind: str, efficiency: float, ll_us: float, simple_us: float, ll128: bool
) -> None:
    topo = parse_topology(parse_yaml_text(_with_kind(kind), "t.yaml"), nodes=2)
    assert topo.fabric.kind.value == kind
    assert topo.nics is not None and topo.nics.efficiency == efficiency
    assert topo.fabric.net_latency_s == pytest.approx(ll_us * 1e-6)
    assert topo.fabric.net_simple_latency_s == pytest.approx(simple_us * 1e-6)
    assert topo.fabric.ll128 is ll128
    assert FABRIC_DEFAULTS[topo.fabric.kind].source  # every kind names its source


def test_topology_keys_override_the_fabric_kind() -> None:
    doc = _with_kind("tcpxo", "  net_latency_us: 7\n  ll128: true\n  sharp: true\n")
    doc = doc.replace("  rate_gbit: 400\n", "  rate_gbit: 400\n  efficiency: 0.5\n")
    topo = parse_topology(parse_yaml_text(doc, "t.yaml"), nodes=2)
    assert topo.nics is not None and topo.nics.efficiency == 0.5
    assert topo.fabric.net_latency_s == pytest.approx(7e-6)
    assert topo.fabric.net_simple_latency_s == pytest.approx(420e-6)  # still the kind's
    assert topo.fabric.ll128 and topo.fabric.collnet


def test_transport_latency_reaches_the_network_hops() -> None:
    # NCCL adds the transport's latency to every network hop (tuning.cc latencyInter): a
    # 2-node ring Simple all_reduce on 16 ranks has 2 network steps, so 2 x 420 us more.
    from collsim.collectives import Group, cost

    ib = parse_topology(parse_yaml_text(_with_kind("infiniband"), "t.yaml"), nodes=2)
    xo = parse_topology(
        parse_yaml_text(_with_kind("infiniband", "  net_simple_latency_us: 420\n"), "t.yaml"),
        nodes=2,
    )
    slow = cost("all_reduce", 1 << 20, Group.all(xo), "ring", "simple").time_s
    fast = cost("all_reduce", 1 << 20, Group.all(ib), "ring", "simple").time_s
    assert slow - fast == pytest.approx(2 * 420e-6, rel=1e-9)


def test_gcp_a3_mega_preset() -> None:
    topo = load_topology("gcp_a3_mega")
    assert topo.num_nodes == 2 and topo.nics is not None and topo.nics.count == 8
    assert topo.links[topo.nic_tx[0][0]].bandwidth_bps == pytest.approx(200e9 / 8)
    assert topo.fabric.kind.value == "tcpxo" and topo.fabric.rails and not topo.nvls


def test_a_built_topology_is_not_changed_only_copied() -> None:
    topo = load_topology("dgx_h100", nodes=2)
    with pytest.raises(AttributeError, match="not changed"):
        topo.device = topo.device
    h200 = get_device("h200")
    copy = topo.replaced(device=h200, name="other")
    assert copy.device is h200 and copy.name == "other" and copy.num_ranks == topo.num_ranks
    assert topo.device.name != h200.name and topo.name == "dgx_h100"
    with pytest.raises(AttributeError, match="no attribute"):
        topo.replaced(devices=h200)


def test_the_scenario_device_is_built_in_and_the_file_is_read_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads: list[str] = []

    def counting(path: str | Path) -> YamlDoc:
        reads.append(str(path))
        return load_yaml(path)

    monkeypatch.setattr(topology_module, "load_yaml", counting)
    topology_module._read_file.cache_clear()
    root = Path(__file__).resolve().parents[1]
    scenario = load_scenario(root / "scenarios" / "ddp_gpt3_1.3b.yaml", ["cluster.device=h200"])
    check_scenario(scenario)  # reads the cluster's shape before anything is built
    topo = scenario.cluster.load()
    assert topo.device.name == get_device("h200").name
    assert len(reads) == 1, reads
