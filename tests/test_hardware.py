from __future__ import annotations

import pytest

from collsim.cluster.hardware import Device, get_device, list_devices
from collsim.core.errors import ConfigError


def test_catalogue_has_the_issue_devices() -> None:
    assert list_devices() == [
        "a100",
        "b200",
        "cpu",
        "gb200",
        "h100",
        "h100_96gb",
        "h200",
        "h800",
        "mi300x",
    ]


@pytest.mark.parametrize(
    ("name", "full", "bf16_tflops", "memory_gb", "hbm_tbps"),
    [
        ("a100", "A100 SXM 80GB", 312, 80, 2.0),  # reference/hardware.yaml
        ("h100", "H100 SXM", 989, 80, 3.35),
        ("h200", "H200 SXM", 989, 141, 4.8),
        ("b200", "B200 SXM", 2250, 180, 8.0),
    ],
    ids=["a100", "h100", "h200", "b200"],
)
def test_gpu_figures_match_the_reference(
    name: str, full: str, bf16_tflops: float, memory_gb: float, hbm_tbps: float
) -> None:
    device = get_device(name)
    assert device.name == full
    assert device.peak_flops_for("bf16") == pytest.approx(bf16_tflops * 1e12)
    assert device.memory_bytes == pytest.approx(memory_gb * 1e9)
    assert device.memory_bandwidth_bps == pytest.approx(hbm_tbps * 1e12)


def test_matmul_efficiency_is_mamf_over_peak() -> None:
    # MAMF bf16 (ml-engineering): H100 SXM 794.5 of 989 TFLOP/s.
    assert get_device("h100").matmul_efficiency == pytest.approx(794.5 / 989)
    assert get_device("a100").matmul_efficiency == pytest.approx(271.2 / 312)


@pytest.mark.parametrize("alias", ["H100 SXM", "h100_sxm", "H100-SXM", " h100 "])
def test_lookup_by_full_name_or_alias(alias: str) -> None:
    assert get_device(alias) is get_device("h100")


def test_dtype_aliases() -> None:
    h100 = get_device("h100")
    assert h100.peak_flops_for("bfloat16") == h100.peak_flops_for("bf16")
    assert h100.peak_flops_for("fp8") == pytest.approx(1979e12)


def test_unknown_device_lists_choices() -> None:
    with pytest.raises(
        ConfigError,
        match="unknown device 'v100'.*a100, b200, cpu, gb200, h100, h100_96gb, h200, h800, mi300x",
    ):
        get_device("v100")


def test_unknown_dtype_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no peak FLOP/s for dtype 'fp4'"):
        get_device("a100").peak_flops_for("fp4")


def test_efficiency_out_of_range_is_rejected() -> None:
    with pytest.raises(ConfigError, match="matmul_efficiency"):
        Device(
            name="x",
            peak_flops={"bf16": 1.0},
            matmul_efficiency=1.5,
            memory_bytes=1.0,
            memory_bandwidth_bps=1.0,
        )


def test_missing_dtype_names_the_training_key() -> None:
    from collsim.cluster.hardware import get_device
    from collsim.core.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"^training\.dtype: A100 .* no peak FLOP/s for dtype 'fp8'"
    ):
        get_device("a100").peak_flops_for("fp8")


def test_new_devices_and_memory_reserve() -> None:
    h800 = get_device("h800")
    assert h800.peak_flops_for("bf16") == pytest.approx(989e12)
    h96 = get_device("h100_96gb")
    assert h96.memory_bandwidth_bps == pytest.approx(2.4e12)  # torchtitan benchmark file
    # 500 W of the 700 W its MAMF ran at: f ~ P^(1/3) below the Hopper sustained clock
    assert h96.sustained_clock_fraction == pytest.approx(
        get_device("h100").sustained_clock_fraction * (500 / 700) ** (1 / 3)
    )
    h100 = get_device("h100")
    # nvidia-smi 81559 MiB = 79.65 GiB, not 80e9 bytes = 74.5 GiB
    assert h100.reported_capacity_bytes / 2**30 == pytest.approx(79.65)
    assert h100.usable_memory_bytes == pytest.approx(
        h100.reported_capacity_bytes - h100.memory_reserve_bytes
    )
    assert 1.0 * 2**30 < h100.memory_reserve_bytes < 0.1 * h100.reported_capacity_bytes
    assert get_device("a100").sustained_clock_fraction == pytest.approx(1305 / 1410)


def test_device_file_and_inline_topology_device(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from collsim.cluster.topology import load_topology

    text = (
        "name: my gpu\ngeneration: hopper\npeak_tflops: {bf16: 500}\nmamf_tflops: {bf16: 400}\n"
        "sm_count: 100\nmemory_gb: 64\nmemory_bandwidth_tbps: 2.0\n"
    )
    (tmp_path / "gpu.yaml").write_text(text)
    dev = get_device(str(tmp_path / "gpu.yaml"))
    assert dev.name == "my gpu" and dev.matmul_efficiency == pytest.approx(0.8)
    inline = "  " + text.replace("\n", "\n  ")
    topo = (
        "name: t\ndevice:\n" + inline + "\ngpus_per_node: 2\n"
        "intra_node: {interconnect: nvswitch, bandwidth_gbps: 100}\n"
    )
    (tmp_path / "t.yaml").write_text(topo)
    assert load_topology(str(tmp_path / "t.yaml")).device.sm_count == 100
    (tmp_path / "bad.yaml").write_text(text.replace("sm_count: 100", "sm_count: -1"))
    with pytest.raises(ConfigError, match=r"bad.yaml:5: sm_count: must be > 0"):
        get_device(str(tmp_path / "bad.yaml"))


def test_no_name_is_claimed_by_two_catalogue_files() -> None:
    from collsim.cluster import hardware

    owner: dict[str, str] = {}
    for path in hardware._catalogue_paths():
        _, names = hardware._catalogue_file(path)
        for name in {hardware._norm(n) for n in names}:
            assert name not in owner, f"{name!r} in {owner.get(name)} and {path.name}"
            owner[name] = path.name


def test_a_key_reads_one_file_and_gives_the_catalogue_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from collsim.cluster import hardware

    read: list[str] = []

    def counting(path: object) -> object:
        read.append(str(path))
        return original(path)

    original = hardware.load_yaml
    monkeypatch.setattr(hardware, "load_yaml", counting)
    hardware._catalogue.cache_clear()
    hardware._catalogue_file.cache_clear()
    try:
        device = get_device("H100")
        assert [p.rsplit("/", 1)[-1] for p in read] == ["h100.yaml"]
        assert get_device("H100 SXM") is device  # by name: the whole catalogue, same object
        assert len(read) == len(hardware._catalogue_paths())
        assert all(
            get_device(k) is hardware._catalogue()[hardware._norm(k)] for k in list_devices()
        )
    finally:
        hardware._catalogue.cache_clear()
        hardware._catalogue_file.cache_clear()
