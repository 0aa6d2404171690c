"""The examples in docs/ run as tests (STYLE.md section 9, after SimPy's docs/conftest.py).

What is checked, in ``docs/scenarios.md``, ``docs/topologies.md`` and ``docs/commands.md``:

- every fenced ```` ```console ```` block: each ``$ collsim ...`` line runs through
  :func:`collsim.cli.main` in a fresh folder, must end with exit status 0 (or the status its
  trailing ``# exit status N`` comment gives), and every output line shown under it must appear
  in its output, in the order shown (``...`` stands for lines left out). Blocks fenced
  ```` ```console norun ```` (torch runs, long runs) are only shown: their commands and flags
  are parsed, not run;
- every ```` ```yaml ```` block loads with the real loader (:func:`load_scenario` or
  :func:`load_topology`, told apart by their sections); a block fenced ```` ```yaml invalid ````
  must raise ConfigError instead. ```` ```yaml file=NAME ```` blocks are also written to NAME in
  the folder where that document's console blocks run;
- the presets table of ``docs/scenarios.md`` is what its script prints from
  ``collsim.workload.PRESETS``;
- every command, subcommand and long option of the CLI is named in ``docs/commands.md``.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import warnings
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from collsim.core.errors import CollsimWarning, ConfigError

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
DOC_NAMES = ("scenarios.md", "topologies.md", "commands.md")

#: read-only inputs the examples use, linked into each example's folder.
LINKED = ("scenarios", "validate", "tests")

_EXIT = re.compile(r"\s+#\s*exit status (\d+)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a document."""

    doc: str
    line: int
    lang: str
    options: tuple[str, ...]
    text: str

    @property
    def file(self) -> str | None:
        for option in self.options:
            if option.startswith("file="):
                return option.removeprefix("file=")
        return None

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def read_blocks(name: str) -> list[Block]:
    """The fenced blocks of ``docs/<name>``, with the line of each opening fence."""
    blocks: list[Block] = []
    lines = (DOCS / name).read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```") and lines[i].strip() != "```":
            info = lines[i][3:].split()
            start = i
            body: list[str] = []
            i += 1
            while i < len(lines) and lines[i].rstrip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append(Block(name, start + 1, info[0], tuple(info[1:]), "\n".join(body)))
        i += 1
    return blocks


ALL_BLOCKS = [b for name in DOC_NAMES for b in read_blocks(name)]
CONSOLE = [b for b in ALL_BLOCKS if b.lang == "console" and "norun" not in b.options]
YAML = [b for b in ALL_BLOCKS if b.lang == "yaml"]


@dataclass(frozen=True)
class Step:
    """One ``$ command`` of a console block and the output lines shown under it."""

    argv: tuple[str, ...]
    exit_code: int
    expected: tuple[str, ...]


def parse_console(text: str) -> list[Step]:
    """Commands (``$ ``, continued by a trailing backslash) and their expected lines."""
    steps: list[Step] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            raise AssertionError(f"output before the first command: {lines[i]!r}")
        command = lines[i][2:]
        while command.endswith("\\"):
            i += 1
            command = command[:-1] + " " + lines[i].strip()
        i += 1
        code = 0
        match = _EXIT.search(command)
        if match:
            code = int(match.group(1))
            command = command[: match.start()]
        expected = []
        while i < len(lines) and not lines[i].startswith("$ "):
            line = lines[i].rstrip()
            if line and line.strip() != "...":
                expected.append(line)
            i += 1
        argv = tuple(shlex.split(command))
        assert argv[0] == "collsim", f"only collsim commands run here, got {command!r}"
        steps.append(Step(argv[1:], code, tuple(expected)))
    return steps


def expand_globs(argv: tuple[str, ...]) -> tuple[str, ...]:
    """Arguments with ``*``/``?``/``[`` expanded in the current folder, as a shell would
    (sorted; a pattern that matches nothing stays as it is)."""
    import glob

    out: list[str] = []
    for arg in argv:
        matches = sorted(glob.glob(arg)) if any(c in arg for c in "*?[") else []
        out.extend(matches or [arg])
    return tuple(out)


def run_cli(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``collsim ARGV`` in this process: (exit status, stdout + stderr)."""
    from collsim.cli import main

    capsys.readouterr()
    code = 0
    with warnings.catch_warnings():
        # The CLI prints its CollsimWarnings; a command that lets one escape is still a pass
        # here, as it is for a user (the warning goes to stderr).
        warnings.simplefilter("default", CollsimWarning)
        try:
            main(list(argv))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return code, out + err


def _prepare(folder: Path, doc: str) -> None:
    for name in LINKED:
        (folder / name).symlink_to(REPO / name, target_is_directory=True)
    for block in YAML:
        if block.doc == doc and block.file:
            (folder / block.file).write_text(block.text + "\n", encoding="utf-8")


@pytest.mark.parametrize("block", CONSOLE, ids=[b.id for b in CONSOLE])
def test_console_example(
    block: Block,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _prepare(tmp_path, block.doc)
    monkeypatch.chdir(tmp_path)
    for step in parse_console(block.text):
        code, output = run_cli(expand_globs(step.argv), capsys)
        shown = f"collsim {shlex.join(step.argv)}\n{output}"
        assert code == step.exit_code, f"exit status {code}, documented {step.exit_code}\n{shown}"
        got = {line.rstrip() for line in output.splitlines()}
        missing = [line for line in step.expected if line not in got]
        assert not missing, f"documented lines not in the output: {missing}\n{shown}"
        # and in the order shown (stdout, then stderr), so a line cannot move to another table
        lines = [line.rstrip() for line in output.splitlines()]
        at = 0
        for line in step.expected:
            found = lines.index(line, at) if line in lines[at:] else -1
            assert found >= 0, f"documented line out of order: {line!r}\n{shown}"
            at = found + 1


def test_each_doc_has_runnable_examples() -> None:
    """The console tests cannot pass by finding nothing."""
    for name in DOC_NAMES:
        runnable = [b for b in CONSOLE if b.doc == name]
        assert len(runnable) >= 2, f"{name}: {len(runnable)} runnable console blocks"
        assert all(parse_console(b.text) for b in runnable)
    assert sum(len(parse_console(b.text)) for b in CONSOLE) >= 20


NORUN = [b for b in ALL_BLOCKS if b.lang == "console" and "norun" in b.options]


@pytest.mark.parametrize("block", NORUN, ids=[b.id for b in NORUN])
def test_shown_example_parses(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Examples that are only shown (torch, slow) still name real commands and valid flags."""
    from collsim.cli import cli

    _prepare(tmp_path, block.doc)
    monkeypatch.chdir(tmp_path)
    for step in parse_console(block.text):
        args = list(expand_globs(step.argv))
        command: click.Command = cli
        parent, name = None, "collsim"
        while isinstance(command, click.Group):
            ctx = click.Context(command, info_name=name, parent=parent)
            name = args.pop(0)
            found = command.get_command(ctx, name)
            assert found is not None, f"no command {name!r} in {step.argv}"
            command, parent = found, ctx
        command.make_context(name, args, parent=parent)  # UsageError on a bad flag
        # what this step would write exists for the next ones (plot breakdown plans.csv)
        for flag, value in zip(step.argv, step.argv[1:]):
            target = Path(value).resolve()
            if flag in ("-o", "--output") and tmp_path.resolve() in target.parents:
                target.touch()


def _kind(data: object) -> str:
    if isinstance(data, dict) and "intra_node" in data:
        return "topology"
    if isinstance(data, dict) and "training" in data:
        return "scenario"
    raise AssertionError("a YAML example must be a whole topology or a whole scenario")


def _load(path: Path) -> None:
    import yaml

    from collsim.cluster.topology import load_topology
    from collsim.study.scenario import load_scenario

    if _kind(yaml.safe_load(path.read_text(encoding="utf-8"))) == "topology":
        load_topology(path)
    else:
        load_scenario(path).cluster.load()


@pytest.mark.parametrize("block", YAML, ids=[b.id for b in YAML])
def test_yaml_example_loads(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _prepare(tmp_path, block.doc)
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "example.yaml"
    path.write_text(block.text + "\n", encoding="utf-8")
    if "invalid" in block.options:
        with pytest.raises(ConfigError):
            _load(path)
    else:
        _load(path)


SCENARIO_YAML = [
    b for b in YAML if "invalid" not in b.options and "training:" in b.text and "model" in b.text
]


def _exit_option(block: Block) -> int:
    """The exit status a block's ``exit=N`` option documents (0 without one)."""
    for option in block.options:
        if option.startswith("exit="):
            return int(option.removeprefix("exit="))
    return 0


@pytest.mark.parametrize("block", SCENARIO_YAML, ids=[b.id for b in SCENARIO_YAML])
def test_yaml_scenario_example_runs(
    block: Block,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A whole scenario shown in the docs runs as ``collsim run`` with the exit status it
    documents (0: it fits), not only loads."""
    import yaml

    if _kind(yaml.safe_load(block.text)) != "scenario":
        pytest.skip("a topology")
    _prepare(tmp_path, block.doc)
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "example.yaml"
    path.write_text(block.text + "\n", encoding="utf-8")
    code, output = run_cli(("run", str(path)), capsys)
    assert code == _exit_option(block), f"exit status {code}\n{output}"


def test_yaml_examples_cover_both_loaders() -> None:
    import yaml

    kinds = [_kind(yaml.safe_load(b.text)) for b in YAML if "invalid" not in b.options]
    assert kinds.count("scenario") >= 3 and kinds.count("topology") >= 3, kinds


def test_presets_table_matches_the_code() -> None:
    """The table between the markers is what the script above it prints, row per preset."""
    from collsim.workload import PRESETS

    text = (DOCS / "scenarios.md").read_text(encoding="utf-8")
    table = text.split("<!-- presets-table: begin -->\n")[1].split("<!-- presets-table: end -->")[0]
    script = next(
        b.text
        for b in ALL_BLOCKS
        if b.doc == "scenarios.md" and b.lang == "python" and "PRESETS" in b.text
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(script, "docs/scenarios.md", "exec"), {})
    assert table == printed.getvalue()
    rows = [line.split("|")[1:-1] for line in table.splitlines()[2:]]
    assert [r[0].strip().strip("`") for r in rows] == list(PRESETS)
    for row, spec in zip(rows, PRESETS.values()):
        cells = [int(c.strip().replace(",", "")) for c in row[1:]]
        assert cells == [
            spec.num_layers,
            spec.hidden,
            spec.num_heads,
            spec.kv_heads,
            spec.ffn_hidden,
            spec.seq_len,
            spec.vocab,
            spec.num_parameters(),
        ]


def _commands() -> list[tuple[str, click.Command]]:
    from collsim.cli import SUBCOMMANDS, cli

    ctx = click.Context(cli)
    out = []
    for name in SUBCOMMANDS:
        command = cli.get_command(ctx, name)
        assert command is not None
        out.append((name, command))
        if isinstance(command, click.Group):
            out += [(f"{name} {sub}", command.commands[sub]) for sub in command.commands]
    return out


def test_every_command_and_option_is_documented() -> None:
    text = (DOCS / "commands.md").read_text(encoding="utf-8")

    def section(name: str) -> str | None:
        """The text under the heading that names `collsim NAME`, up to the next heading."""
        found = re.search(
            rf"^#+ [^\n]*`collsim {re.escape(name)}`.*?(?=^#+ |\Z)", text, re.M | re.S
        )
        return found.group(0) if found else None

    missing = []
    for name, command in _commands():
        own = section(name)
        if own is None:
            missing.append(f"heading for collsim {name}")
            continue
        # options shared by a group's subcommands may be described once, under the group
        where = own + (section(name.split()[0]) or "")
        for param in command.params:
            for opt in param.opts + param.secondary_opts:
                if opt.startswith("--") and opt != "--help" and opt not in where:
                    missing.append(f"collsim {name} {opt}")
    assert not missing, missing
