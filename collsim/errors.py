"""The one exception tree of collsim.

::

    CollsimError
    ├── ConfigError       malformed input (unknown key, wrong type, bandwidth <= 0)     CLI exit 2
    ├── InfeasibleError   valid but impossible (tp*pp*dp != world, exceeds HBM)         CLI exit 1
    └── SimulationError   an engine invariant broke: a bug, shown with a traceback

    CollsimWarning        legal but poor settings (fewer micro-batches than stages, ...)

Messages state the rule, the offending value and where it came from, e.g.
``topologies/x.yaml:12: links.nvlink.bandwidth_gbps: must be > 0, got -5``.
"""

from __future__ import annotations

__all__ = [
    "CollsimError",
    "ConfigError",
    "InfeasibleError",
    "SimulationError",
    "CollsimWarning",
]


class CollsimError(Exception):
    """Base of every error collsim raises on purpose."""


class ConfigError(CollsimError):
    """Malformed input: the file, the key path, the bad value and the rule.

    Args:
        message: the rule and the offending value, e.g. ``must be > 0, got -5``.
        key_path: dotted path of the key, e.g. ``parallel.tp`` (optional).
        file: the file the value came from (optional).
        line: 1-based line of the key in ``file`` (optional).
    """

    def __init__(
        self,
        message: str,
        *,
        key_path: str | None = None,
        file: str | None = None,
        line: int | None = None,
    ) -> None:
        self.message = message
        self.key_path = key_path
        self.file = file
        self.line = line
        super().__init__(self.__str__())

    def __str__(self) -> str:
        where = ""
        if self.file is not None:
            where = f"{self.file}:{self.line}: " if self.line is not None else f"{self.file}: "
        key = f"{self.key_path}: " if self.key_path else ""
        return f"{where}{key}{self.message}"

    def located(
        self, *, file: str | None = None, line: int | None = None, key_prefix: str | None = None
    ) -> ConfigError:
        """A copy with the location filled in where it was missing."""
        key = self.key_path
        if key_prefix:
            key = f"{key_prefix}.{key}" if key else key_prefix
        return ConfigError(
            self.message,
            key_path=key,
            file=self.file if self.file is not None else file,
            line=self.line if self.line is not None else line,
        )


class InfeasibleError(CollsimError):
    """A valid plan that cannot run: sizes do not multiply out, or it does not fit in memory.

    Sweeps and searches catch it and count the reason; the CLI exits with code 1.

    Args:
        message: one line saying what is impossible.
        reason: a short stable tag for counting (``"memory"``, ``"world_size"``, ...).
    """

    def __init__(self, message: str, *, reason: str = "infeasible") -> None:
        self.reason = reason
        super().__init__(message)


class SimulationError(CollsimError):
    """An engine invariant broke. This is a bug in collsim, not in the input."""


class CollsimWarning(UserWarning):
    """A legal plan that is likely to perform poorly."""
