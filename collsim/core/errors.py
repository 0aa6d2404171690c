"""The one exception tree of collsim.

::

    CollsimError                                                                        exit 1
    ├── ConfigError       malformed input (unknown key, wrong type, bandwidth <= 0)     exit 2
    │   ├── ConfigErrors  several ConfigErrors of one file, one line each               exit 2
    │   └── LimitError    a plan beyond a resource limit (names the option that raises it) exit 2
    ├── InfeasibleError   valid but impossible (tp*pp*dp != world, exceeds HBM)         exit 1
    ├── UnavailableError  a part of collsim this version does not have                  exit 3
    └── SimulationError   an engine invariant broke: a bug, shown with a traceback      exit 70

    CollsimWarning        legal but poor settings (fewer micro-batches than stages, ...)

Each class declares its process exit status as the class attribute ``exit_code`` and the prefix
of its one-line message as ``prefix``; ``collsim.cli`` maps them to the exit once, for every
subcommand. (70 is ``EX_SOFTWARE`` of BSD ``sysexits.h``: an internal error.)

Messages state the rule, the offending value and where it came from, e.g.
``topologies/x.yaml:12: links.nvlink.bandwidth_gbps: must be > 0, got -5``.
"""

from __future__ import annotations

import copy

__all__ = [
    "CollsimError",
    "ConfigError",
    "InfeasibleError",
    "SimulationError",
    "UnavailableError",
    "ConfigErrors",
    "LimitError",
    "CollsimWarning",
]


class CollsimError(Exception):
    """Base of every error collsim raises on purpose."""

    exit_code: int = 1
    """Process exit status of the ``collsim`` command when this error ends it."""
    prefix: str = "error: "
    """What the command prints before the message (one line on stderr)."""

    def lines(self) -> list[str]:
        """The message as the command prints it: one line per error, whitespace collapsed."""
        return [self.prefix + " ".join(str(self).split())]


class ConfigError(CollsimError):
    """Malformed input: the file, the key path, the bad value and the rule.

    Args:
        message: the rule and the offending value, e.g. ``must be > 0, got -5``.
        key_path: dotted path of the key, e.g. ``parallel.tp`` (optional).
        file: the file the value came from (optional).
        line: 1-based line of the key in ``file`` (optional).
    """

    exit_code = 2

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

    def at(self, *, file: str | None, line: int | None, key_path: str | None) -> ConfigError:
        """A copy of this error (same class) at another location."""
        new = copy.copy(self)
        new.file, new.line, new.key_path = file, line, key_path
        new.args = (new.__str__(),)
        return new

    def located(
        self, *, file: str | None = None, line: int | None = None, key_prefix: str | None = None
    ) -> ConfigError:
        """A copy with the location filled in where it was missing."""
        key = self.key_path
        if key_prefix:
            key = f"{key_prefix}.{key}" if key else key_prefix
        return self.at(
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
        prefix: what the command prints before the message (``"infeasible: "``; ``""`` for a
            message that already says it, such as the memory verdict ``does not fit: ...``).
    """

    exit_code = 1

    def __init__(
        self, message: str, *, reason: str = "infeasible", prefix: str = "infeasible: "
    ) -> None:
        self.reason = reason
        self.prefix = prefix
        super().__init__(message)


class ConfigErrors(ConfigError):
    """Every error found in one input, reported together (one line each, exit 2).

    Args:
        errors: the errors, in the order of the file (at least one).
    """

    def __init__(self, errors: list[ConfigError]) -> None:
        if not errors:
            raise ValueError("ConfigErrors needs at least one error")
        self.errors = list(errors)
        first = self.errors[0]
        super().__init__(first.message, key_path=first.key_path, file=first.file, line=first.line)

    def __str__(self) -> str:
        return "\n".join(ConfigError.__str__(e) for e in self.errors)

    def lines(self) -> list[str]:
        return [line for e in self.errors for line in e.lines()]

    def located(
        self, *, file: str | None = None, line: int | None = None, key_prefix: str | None = None
    ) -> ConfigError:
        return ConfigErrors(
            [e.located(file=file, line=line, key_prefix=key_prefix) for e in self.errors]
        )


class LimitError(ConfigError):
    """A plan whose simulation would need more than a documented resource limit allows.

    The message says what the run would need, what to change, and which option raises the
    limit (see :mod:`collsim.study.limits`).
    """


class UnavailableError(CollsimError):
    """A part of collsim this version does not have (exit 3)."""

    exit_code = 3


class SimulationError(CollsimError):
    """An engine invariant broke. This is a bug in collsim, not in the input."""

    exit_code = 70


class CollsimWarning(UserWarning):
    """A legal plan that is likely to perform poorly."""
