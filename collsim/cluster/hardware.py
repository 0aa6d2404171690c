"""Devices as data: one device schema for the catalogue, measured profiles and user files.

Derivations, measurements and sources: docs/derivations.md, ``collsim.cluster.hardware``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from collsim.cluster.kernel_tables import MEASURED, MeasuredTables
from collsim.core.errors import ConfigError
from collsim.core.schema import (
    Either,
    ListOf,
    Section,
    check,
    choice_value,
    non_negative_value,
    positive_value,
    raise_errors,
    read_described,
    read_value,
    scaled,
    text_value,
    values_of,
)
from collsim.core.units import GB, TB, GiB, tflops_to_flops
from collsim.core.yamlio import ConfigReader, YamlDoc, load_yaml

__all__ = [
    "DEVICE",
    "Device",
    "get_device",
    "list_devices",
    "load_device_file",
    "device_from_reader",
    "CATALOGUE_DIR",
    "CATALOGUE_PATH",
    "CUDA_CONTEXT_BYTES",
    "NCCL_BUFFER_BYTES",
    "FRAGMENTATION_SHARE",
    "GENERATIONS",
    "HOPPER_SUSTAINED_CLOCK_FRACTION",
    "SUSTAINED_CLOCK_FRACTION",
]

CATALOGUE_DIR = Path(__file__).resolve().parents[1] / "data" / "devices"
CATALOGUE_PATH = CATALOGUE_DIR
"""Kept for callers of the single-file catalogue: now the directory of device files."""

GENERATIONS = ("ampere", "hopper", "blackwell", "cdna3", "cpu", "generic")

_DTYPE_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "float8": "fp8",
}

CUDA_CONTEXT_BYTES = 0.75 * GiB
"""CUDA context with the cuBLAS / cuDNN handles and workspaces a training process creates.
ASSUMPTION, not a published figure: the context alone takes 300-600 MiB on recent drivers and
cuBLAS keeps a workspace per stream (PyTorch's CUBLAS_WORKSPACE_CONFIG default ":4096:8" = 32 MiB
per handle); 0.75 GiB covers both. Replace with a measured ``reserve_gib``."""
NCCL_BUFFER_BYTES = 0.5 * GiB
"""NCCL communication buffers: NCCL_BUFFSIZE defaults to 4 MiB per channel and peer for the
Simple protocol (NCCL environment-variable documentation), a ring has 2 peers and up to 32
channels on NVLink, so ~0.25 GiB per communicator; a data-parallel and a tensor- or
pipeline-parallel communicator make 0.5 GiB. Derived from the documented default."""
FRAGMENTATION_SHARE = 0.03
"""Share of the reported capacity the caching allocator cannot hand out (reserved but not
allocated blocks). ASSUMPTION: PyTorch's caching allocator rounds blocks to 512 B and splits
2 MiB / 20 MiB segments; 3 % is a middle reading of reserved-minus-allocated in long runs."""

HOPPER_SUSTAINED_CLOCK_FRACTION = 0.735
"""FITTED (the one constant fitted to reference/training_calibration.csv, to its two H100
rows): the H100 SXM's sustained SM clock in GEMM-heavy training under its 700 W limit, over
the boost clock its MAMF burst runs at (1980 MHz), i.e. 1455 MHz. compute.md 1b: "matmuls on
the H100 are primarily ... power limited"; no sustained-clock figure is published there. Fitted
with the framework costs, interference and slowest-GPU factor added
(``validate/probes/compute_calibration.py --loo``: 0.7347 on both rows; 0.7359 / 0.7333 on
either alone, held-out errors +0.3 % / -0.3 %, when the engine did not yet price those parts;
the engine now does, and ``collsim run`` gives -0.3 % on both rows). It also absorbs whatever
else makes those runs slower than modelled: the A100 rows, which it does not touch, stay
9-12 % optimistic."""

SUSTAINED_CLOCK_FRACTION: dict[str, float] = {
    "ampere": 1305.0 / 1410.0,
    "hopper": HOPPER_SUSTAINED_CLOCK_FRACTION,
    "blackwell": HOPPER_SUSTAINED_CLOCK_FRACTION,
    "cdna3": 1.0,
    "cpu": 1.0,
    "generic": 1.0,
}
"""Generation defaults for ``Device.sustained_clock_fraction`` where a device file gives no
sustained clock. ampere: the A100 HPL Rpeak clock 1305 of 1410 MHz (compute.md 1b). hopper:
fitted (above). blackwell: ASSUMPTION, Hopper's (B200 is also power limited: 700 W default of
1000 W, compute.md 1b). cdna3, cpu: no figure, 1."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    """One accelerator (or CPU socket): the figures the compute and memory models read."""

    name: str
    """Full name, e.g. ``"H100 SXM"``."""
    peak_flops: dict[str, float] = field(hash=False)
    """Dense peak FLOP/s by dtype key (``bf16``, ``fp16``, ``fp32``, ``tf32``, ``fp8``...)."""
    matmul_efficiency: float
    """Measured best-shape matmul rate (MAMF) over the bf16 peak, in (0, 1]."""
    memory_bytes: float
    """Memory (HBM) capacity in bytes (datasheet)."""
    memory_bandwidth_bps: float
    """Memory bandwidth in bytes/s (datasheet)."""
    key: str = ""
    """Catalogue key (``"h100"``)."""
    generation: str = "generic"
    """``ampere``, ``hopper``, ``blackwell``, ``cdna3``, ``cpu`` or ``generic``."""
    mamf_flops: dict[str, float] = field(default_factory=dict, hash=False)
    """Measured best-shape matmul FLOP/s by dtype (bf16 always; fp8 where published)."""
    sm_count: int | None = None
    """SMs (compute units, CPU cores); None: the compute model's default."""
    boost_clock_mhz: float | None = None
    """The clock the MAMF burst runs at (the device's max boost clock)."""
    sustained_clock_mhz: float | None = None
    """The SM clock sustained under the power limit in long GEMM-heavy runs; None: see
    :attr:`sustained_clock_fraction`."""
    power_w: float | None = None
    """Power limit the device runs at."""
    reference_power_w: float | None = None
    """Power limit its MAMF was measured at (None: ``power_w``)."""
    reported_memory_bytes: float | None = None
    """Capacity as PyTorch / nvidia-smi report it (ECC and driver take the rest)."""
    reserve_bytes: float | None = None
    """Memory the framework cannot use for tensors; None: the documented default."""
    nccl_sms: int = 16
    """SMs a running NCCL collective holds (NVIDIA/nccl#689: 16 on an 8-NIC DGX); a device
    file of generation ``cpu`` defaults to 0 (gloo runs on the cores, not on SMs: with
    ``sm_count`` its thread count, the GPU formula would read 16 SMs held of 1 as a compute
    ten times slower beside every collective)."""
    measured: Any = field(default=None, hash=False, compare=False)
    """A measured profile's kernel tables
    (:class:`~collsim.cluster.kernel_tables.MeasuredTables`)."""
    source: str = ""
    """The file the device was read from."""

    def __post_init__(self) -> None:
        if not 0 < self.matmul_efficiency <= 1:
            raise ConfigError(
                f"matmul_efficiency must be in (0, 1], got {self.matmul_efficiency}",
                key_path=f"devices.{self.key}",
            )

    def peak_flops_for(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (``"bf16"``, ``"float32"``...).

        Raises:
            ConfigError: the device has no figure for that dtype.
        """
        key = str(dtype).lower()
        key = _DTYPE_ALIASES.get(key, key)
        try:
            return self.peak_flops[key]
        except KeyError:
            known = ", ".join(sorted(self.peak_flops))
            raise ConfigError(
                f"{self.name} has no peak FLOP/s for dtype {dtype!r} (known: {known})",
                key_path="training.dtype",
            ) from None

    def mamf_for(self, dtype: str) -> float:
        """Best-shape matmul FLOP/s for ``dtype``: the measured figure where there is one,
        else the dtype's peak x the bf16 MAMF share (``matmul_efficiency``)."""
        key = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
        if key in self.mamf_flops:
            return self.mamf_flops[key]
        return self.peak_flops_for(key) * self.matmul_efficiency

    @property
    def sustained_clock_fraction(self) -> float:
        """Sustained training clock over the MAMF burst clock, in (0, 1].

        ``sustained_clock_mhz / boost_clock_mhz`` where both are given (A100: the HPL Rpeak
        clock 1305 of 1410 MHz, compute.md 1b). Otherwise the generation's default from
        :data:`SUSTAINED_CLOCK_FRACTION`. A device run below the
        power its MAMF was measured at (``power_w < reference_power_w``) runs a further
        ``(power_w / reference_power_w) ** (1/3)`` slower: dynamic power ~ f V^2 with V ~ f in
        the DVFS range, so f ~ P^(1/3) (a modelling assumption; H100 96GB at 500 W of 700 W:
        0.894).
        """

        if self.sustained_clock_mhz and self.boost_clock_mhz:
            base = min(1.0, self.sustained_clock_mhz / self.boost_clock_mhz)
        else:
            base = SUSTAINED_CLOCK_FRACTION.get(self.generation, 1.0)
        if self.power_w and self.reference_power_w and self.power_w < self.reference_power_w:
            base *= (self.power_w / self.reference_power_w) ** (1.0 / 3.0)
        return base

    @property
    def memory_reserve_bytes(self) -> float:
        """Bytes the framework cannot use: the file's ``reserve_gib``, else
        :data:`CUDA_CONTEXT_BYTES` + :data:`NCCL_BUFFER_BYTES` + :data:`FRAGMENTATION_SHARE`
        of the reported capacity."""
        if self.reserve_bytes is not None:
            return self.reserve_bytes
        capacity = self.reported_capacity_bytes
        return CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES + FRAGMENTATION_SHARE * capacity

    @property
    def reported_capacity_bytes(self) -> float:
        """The capacity PyTorch reports (the datasheet's where the file gives none)."""
        if self.reported_memory_bytes is not None:
            return self.reported_memory_bytes
        return self.memory_bytes

    @property
    def usable_memory_bytes(self) -> float:
        """Reported capacity minus :attr:`memory_reserve_bytes`: what tensors can fill."""
        return max(0.0, self.reported_capacity_bytes - self.memory_reserve_bytes)


def device_from_reader(entry: ConfigReader, default_key: str = "", source: str = "") -> Device:
    """Build a Device from a reader over one device mapping, read as :data:`DEVICE` describes
    it; the rules between keys (a bf16 peak and MAMF, the CPU's default SMs) are here."""
    values = read_described(entry, DEVICE)
    values.pop("aliases", None)
    values.pop("description", None)
    key = str(values.pop("key", default_key) or default_key)
    generation = values.pop("generation")
    peak = entry.section("peak_tflops")
    peak_flops = {
        _DTYPE_ALIASES.get(k, k): v
        for k, v in read_described(peak, _section("peak_tflops")).items()
    }
    peak.finish()
    bf16 = peak_flops.get("bf16")
    if bf16 is None:
        raise entry.error("peak_tflops.bf16 is required (MAMF is a bf16 rate)", "peak_tflops")
    mamf_flops: dict[str, float] = {}
    if isinstance(entry.data.get("mamf_tflops"), (int, float)):
        mamf = _section("mamf_tflops", option=0)
        mamf_flops["bf16"] = read_value(entry, "mamf_tflops", mamf)
    else:
        mamf_sec = entry.section("mamf_tflops")
        for k, v in read_described(mamf_sec, _TFLOPS).items():
            mamf_flops[_DTYPE_ALIASES.get(k, k)] = v
        mamf_sec.finish()
    if "bf16" not in mamf_flops:
        raise entry.error("mamf_tflops.bf16 is required", "mamf_tflops")
    clocks = entry.section("clocks", default_empty=True)
    values.update(read_described(clocks, _section("clocks")))
    clocks.finish()
    interference = entry.section("interference", default_empty=True)
    # a CPU holds no SMs for a collective: the sharing of its cores by gloo and the compute
    # is measured where the steps run (collsim.validate.measure.insitu), not this GPU formula
    nccl_sms = read_described(interference, _section("interference")).get(
        "nccl_sms", 0 if generation == "cpu" else 16
    )
    interference.finish()
    measured = None
    if entry.has("measured"):
        measured = MeasuredTables.from_reader(entry.section("measured"))
    device = Device(
        key=key,
        generation=generation,
        peak_flops=peak_flops,
        mamf_flops=mamf_flops,
        matmul_efficiency=min(1.0, mamf_flops["bf16"] / bf16),
        nccl_sms=nccl_sms,
        measured=measured,
        source=source,
        **values,
    )
    entry.finish()
    return device


def _section(key: str, option: int | None = None) -> Any:
    """The description of :data:`DEVICE`'s key ``key`` (of its either-or's ``option``)."""
    spec = DEVICE.fields[key]
    if option is not None:
        assert isinstance(spec, Either)
        return spec.options[option]
    return spec


def _aliases(doc: YamlDoc) -> list[str]:
    data = doc.data if isinstance(doc.data, dict) else {}
    return [str(a) for a in data.get("aliases", []) or []]


@cache
def _catalogue_file(path: Path) -> tuple[Device, list[str]]:
    """One catalogue file's device and the names it answers to (key, name, aliases)."""
    doc = load_yaml(path)
    device = device_from_reader(ConfigReader(doc.data, doc=doc), path.stem, str(path))
    return device, [device.key, device.name, *_aliases(doc)]


@lru_cache(maxsize=1)
def _catalogue_paths() -> tuple[Path, ...]:
    return tuple(sorted(CATALOGUE_DIR.glob("*.yaml")))


@lru_cache(maxsize=1)
def _catalogue() -> dict[str, Device]:
    out: dict[str, Device] = {}
    for path in _catalogue_paths():
        device, names = _catalogue_file(path)
        for alias in names:
            out[_norm(str(alias))] = device
    return out


def _by_file_stem(key: str) -> Device | None:
    """The device of the one catalogue file named after ``key`` (normalised), when that file's
    ``key`` is its name; None otherwise (the whole catalogue answers then).

    Reading one file instead of all of them gives the same device as the catalogue as long as
    no other file claims that key as a name or alias (``tests/test_hardware.py`` checks that no
    name is claimed twice in the catalogue).
    """
    if _catalogue.cache_info().currsize:  # read already: one lookup
        return None
    paths = [path for path in _catalogue_paths() if _norm(path.stem) == key]
    if len(paths) != 1:
        return None
    device, _ = _catalogue_file(paths[0])
    return device if _norm(device.key) == key else None


def _norm(name: str) -> str:
    return " ".join(name.lower().replace("_", " ").replace("-", " ").split())


@lru_cache(maxsize=32)
def _load_file(path: str) -> Device:
    doc = load_yaml(path)
    raise_errors(check(doc, DEVICE))  # every schema error of the file at once
    return device_from_reader(ConfigReader(doc.data, doc=doc), Path(path).stem, path)


def load_device_file(path: str | Path) -> Device:
    """Read a device file (a user's device or a measured profile) in the device schema.

    Raises:
        ConfigError: a missing file or a bad key, located as ``file:line: key: message``.
    """
    return _load_file(str(Path(path)))


def get_device(name: str) -> Device:
    """Look up a device by key (``"a100"``, ``"h100"``, ``"h800"``, ``"cpu"``...), by name, or
    by the path of a device file (``*.yaml``).

    Raises:
        ConfigError: no such device; the message lists the keys.
    """
    if str(name).endswith((".yaml", ".yml")):
        return load_device_file(name)
    device = _by_file_stem(_norm(name))
    if device is not None:
        return device
    try:
        return _catalogue()[_norm(name)]
    except KeyError:
        raise ConfigError(
            f"unknown device {name!r}; choose from {', '.join(list_devices())} "
            f"or give a device file (*.yaml)"
        ) from None


def list_devices() -> list[str]:
    """Catalogue keys, sorted."""
    return sorted({d.key for d in _catalogue().values()})


# -- device (collsim.cluster.hardware.device_from_reader; collsim/data/devices/*.yaml) -------------

_TFLOPS = Section(
    description="TFLOP/s by dtype key (bf16, fp16, fp32, tf32, fp8, fp4; bfloat16 ... aliases).",
    values=positive_value("number", "TFLOP/s (dense).", nullable=False, convert=tflops_to_flops),
)

DEVICE = Section(
    description="A device (accelerator or CPU socket) in collsim's device schema "
    "(collsim.cluster.hardware; collsim/data/devices/*.yaml).",
    fields={
        "key": text_value("Catalogue key (default: the file stem)."),
        "name": text_value("Full name, e.g. H100 SXM.", required=True),
        "aliases": ListOf(items=text_value("Another name."), description="Other names."),
        "description": text_value("Free text."),
        "generation": choice_value(
            "Picks the attention-kernel tables.", values_of(GENERATIONS), default="generic"
        ),
        "peak_tflops": Section(
            required=True,
            description="Dense peak TFLOP/s by dtype (bf16 required).",
            values=_TFLOPS.values,
        ),
        "mamf_tflops": Either(
            required=True,
            description="Measured best-shape matmul TFLOP/s: a bf16 figure, or by dtype.",
            options=(positive_value("number", "bf16 TFLOP/s.", convert=tflops_to_flops), _TFLOPS),
            rule="must be a number or a mapping of dtype to TFLOP/s, got {value!r}",
        ),
        "sm_count": positive_value("integer", "SMs / compute units / CPU cores."),
        "clocks": Section(
            description="Clocks in MHz.",
            fields={
                "boost_mhz": positive_value(
                    "number", "The clock MAMF ran at.", field="boost_clock_mhz"
                ),
                "sustained_mhz": positive_value(
                    "number", "The clock sustained in training.", field="sustained_clock_mhz"
                ),
            },
        ),
        "power_w": positive_value("number", "Power limit the device runs at, W."),
        "reference_power_w": positive_value("number", "Power its MAMF was measured at, W."),
        "memory_gb": positive_value(
            "number",
            "Datasheet memory, GB (1e9 bytes).",
            required=True,
            field="memory_bytes",
            convert=scaled(GB),
        ),
        "memory_bandwidth_tbps": positive_value(
            "number",
            "Memory bandwidth, TB/s.",
            required=True,
            field="memory_bandwidth_bps",
            convert=scaled(TB),
        ),
        "reported_memory_gib": positive_value(
            "number",
            "Capacity PyTorch / nvidia-smi report, GiB.",
            field="reported_memory_bytes",
            convert=scaled(GiB),
        ),
        "reserve_gib": non_negative_value(
            "number",
            "Memory the framework cannot use, GiB.",
            field="reserve_bytes",
            convert=scaled(GiB),
        ),
        "interference": Section(
            description="What a running collective takes from compute.",
            fields={"nccl_sms": non_negative_value("integer", "SMs NCCL holds.")},
        ),
        "measured": MEASURED,
    },
)
