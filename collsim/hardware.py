"""Hardware catalogue: GPUs and a generic CPU as data (``collsim/data/hardware.yaml``).

Figures come from /work/shared/reference/hardware.yaml (vendor datasheets as reproduced by
torchtitan and the ml-engineering handbook). ``matmul_efficiency`` is the measured best-shape
matmul rate (MAMF, ml-engineering) over the bf16 peak; the compute model multiplies it in.

Example::

    h100 = get_device("h100")
    h100.peak_flops_for("bf16")      # 9.89e14
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from collsim.errors import ConfigError
from collsim.units import GB, TB, tflops_to_flops
from collsim.yamlio import ConfigReader, load_yaml, positive

__all__ = ["Device", "get_device", "list_devices", "CATALOGUE_PATH"]

CATALOGUE_PATH = Path(__file__).parent / "data" / "hardware.yaml"

_DTYPE_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "float8": "fp8",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    """One accelerator (or CPU socket) of the catalogue."""

    name: str
    """Full name, e.g. ``"H100 SXM"``."""
    peak_flops: dict[str, float] = field(hash=False)
    """Dense peak FLOP/s by dtype key (``bf16``, ``fp16``, ``fp32``, ``tf32``, ``fp8``...)."""
    matmul_efficiency: float
    """Measured best-shape matmul rate (MAMF) over the bf16 peak, in (0, 1]."""
    memory_bytes: float
    """Memory (HBM) capacity in bytes."""
    memory_bandwidth_bps: float
    """Memory bandwidth in bytes/s."""
    key: str = ""
    """Catalogue key (``"h100"``)."""

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


@lru_cache(maxsize=1)
def _catalogue() -> dict[str, Device]:
    doc = load_yaml(CATALOGUE_PATH)
    root = ConfigReader(doc.data, doc=doc)
    devices = root.section("devices")
    out: dict[str, Device] = {}
    for key, _ in list(devices.items()):
        entry = devices.section(key)
        peak = entry.section("peak_tflops")
        peak_flops = {
            str(k): tflops_to_flops(peak.get(k, float, check=positive))
            for k, _ in list(peak.items())
        }
        peak.finish()
        name = entry.get("name", str)
        aliases = entry.get("aliases", list, default=[])
        mamf = entry.get("mamf_tflops", float, check=positive)
        bf16 = peak_flops.get("bf16")
        if bf16 is None:
            raise entry.error("peak_tflops.bf16 is required (MAMF is a bf16 rate)")
        device = Device(
            key=str(key),
            name=name,
            peak_flops=peak_flops,
            matmul_efficiency=min(1.0, tflops_to_flops(mamf) / bf16),
            memory_bytes=entry.get("memory_gb", float, check=positive) * GB,
            memory_bandwidth_bps=entry.get("memory_bandwidth_tbps", float, check=positive) * TB,
        )
        entry.finish()
        for alias in [str(key), name, *aliases]:
            out[_norm(str(alias))] = device
    devices.finish()
    root.finish()
    return out


def _norm(name: str) -> str:
    return " ".join(name.lower().replace("_", " ").replace("-", " ").split())


def get_device(name: str) -> Device:
    """Look up a device by key (``"a100"``, ``"h100"``, ``"h200"``, ``"b200"``, ``"cpu"``) or name.

    Raises:
        ConfigError: no such device; the message lists the keys.
    """
    try:
        return _catalogue()[_norm(name)]
    except KeyError:
        raise ConfigError(
            f"unknown device {name!r}; choose from {', '.join(list_devices())}"
        ) from None


def list_devices() -> list[str]:
    """Catalogue keys, sorted."""
    return sorted({d.key for d in _catalogue().values()})
