"""Property-based fuzzing of everything a user types: scenario files, topology files, ``--set``
strings and measured-data CSVs.

Each example runs the real command (click's runner, in this process) and must:

- end with exit status 0, 1 or 2, never a traceback (any exception other than SystemExit);
- finish within :data:`EXAMPLE_TIMEOUT_S` (a SIGALRM timer stops a hang and fails the test);
- keep the process under 1 GB of memory (the peak RSS of this process, ``ru_maxrss``, is
  checked after every example: it only grows, so no example went above it);
- when it rejects the input (exit 2), say so on stderr with one line per error, each starting
  ``error:`` (collsim's own, and click's usage errors in the same form), nothing else on stderr.

The mutated keys are those of the shipped base files and every key of :mod:`collsim.core.schema`
(MoE, CP, stacks, stragglers, reliability, inline devices, ...).

Simulations run with ``--max-events 200000 --max-memory-gib 0.75``: the resource limits
(:mod:`collsim.study.limits`) are what keeps a valid but huge plan from taking the time or the
memory, and the fuzzer checks that they do.

The default suite runs 300 examples (under a minute); the ``slow`` tests run 5,000 (4,000
configuration inputs, 1,000 CSVs) and only when asked for by marker
(``python -m pytest --run-slow -m slow tests/robust/test_fuzz.py``), so that the whole suite
stays under ten minutes.
"""

from __future__ import annotations

import contextlib
import json
import resource
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from collsim.cli import cli
from collsim.cluster.topology import TOPOLOGY as SCHEMA_TOPOLOGY
from collsim.study.scenario import SCENARIO as SCHEMA_SCENARIO

REPO = Path(__file__).resolve().parents[2]
BASE_SCENARIO = yaml.safe_load((REPO / "scenarios" / "ddp_gpt3_1.3b.yaml").read_text())
BASE_PIPELINE = yaml.safe_load((REPO / "scenarios" / "pipeline_13b_1f1b.yaml").read_text())
BASE_TOPOLOGY = yaml.safe_load((REPO / "topologies" / "dgx_h100.yaml").read_text())
MEASURED = (REPO / "validate" / "data" / "localhost_gloo_n2.csv").read_text()

EXAMPLE_TIMEOUT_S = 20.0
MEMORY_LIMIT_BYTES = 10**9
LIMITS = ["--max-events", "200000", "--max-memory-gib", "0.75"]

# -- values ----------------------------------------------------------------------------------------

NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, 3, 4, 7, 8, 16, 64, 1024, 10**7, 10**12, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
)
SCALARS = st.one_of(
    NUMBERS,
    st.booleans(),
    st.none(),
    st.text(max_size=12),
    st.sampled_from(["bf16", "fp8", "1f1b", "interleaved", "ring", "nvls", "full", "x" * 200]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


def _paths(doc: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            out.append(prefix + (str(key),))
            out += _paths(value, prefix + (str(key),))
    return out


def _schema_paths(spec: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key path of a :mod:`collsim.core.schema` section (a keyed mapping by its first key,
    an Either by its mapping option), so that the fuzzer reaches every key the readers read."""
    from collsim.core.schema import Either, Section, choices_of

    if isinstance(spec, Either):
        spec = next((o for o in spec.options if isinstance(o, Section)), None)
    if not isinstance(spec, Section):
        return []
    if spec.values is not None:
        key = str(choices_of(spec.keys)[0]) if spec.keys is not None else "bf16"
        return [prefix + (key,), *_schema_paths(spec.values, prefix + (key,))]
    out = []
    for key, sub in spec.fields.items():
        out.append(prefix + (key,))
        out += _schema_paths(sub, prefix + (key,))
    return out


SCENARIO_PATHS = sorted(
    set(_paths(BASE_SCENARIO) + _paths(BASE_PIPELINE) + _schema_paths(SCHEMA_SCENARIO))
) + [
    ("parallel", "fsdp", "prefetch"),
    ("parallel", "virtual_stages"),
    ("parallel", "sequence_parallel"),
    ("model", "layers"),
    ("model", "seq_len"),
    ("model", "hidden"),
    ("model", "heads"),
    ("model", "kv_heads"),
    ("cluster", "nodes"),
    ("nope",),
    ("parallel", "ddp", "bucket"),
]
TOPOLOGY_PATHS = sorted(set(_paths(BASE_TOPOLOGY) + _schema_paths(SCHEMA_TOPOLOGY))) + [
    ("collectives", "algorithms", "all_reduce"),
    ("collectives", "ops", "all_reduce", "efficiency"),
    ("collectives", "ops", "all_reduce", "knee_bytes"),
    ("fabric", "oversubscription"),
    ("nics", "count"),
]


def _set(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node: Any = doc
    for part in path[:-1]:
        child = node.get(part) if isinstance(node, dict) else None
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def _drop(doc: dict[str, Any], path: tuple[str, ...]) -> None:
    node: Any = doc
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return
    node.pop(path[-1], None)


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any], paths: list[tuple[str, ...]]) -> str:
    """A YAML document: ``base`` with a few keys set to odd values or dropped, or raw text."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        raw = draw(st.binary(max_size=200))
        return raw.decode("latin-1")
    if kind == 1:
        return draw(st.text(max_size=200))
    doc = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(paths))
        if draw(st.integers(0, 4)) == 0:
            _drop(doc, path)
        else:
            _set(doc, path, draw(VALUES))
    text = yaml.safe_dump(doc, allow_unicode=True)
    if kind == 2 and text:  # a truncated file
        text = text[: draw(st.integers(0, len(text)))]
    return text


@st.composite
def plans(draw: st.DrawFn) -> str:
    """A plausible plan (every key of the right type and sign), most of them runnable: what
    reaches the engine, where the resource limits must keep time and memory bounded."""
    doc = json.loads(json.dumps(draw(st.sampled_from([BASE_SCENARIO, BASE_PIPELINE]))))
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    pp = draw(st.sampled_from([1, 2, 4, 8]))
    dp = draw(st.sampled_from([1, 2, 4, 16, 64, 1024, 8192]))
    micro = draw(st.sampled_from([1, 2, 4]))
    doc["cluster"]["nodes"] = max(1, tp * pp * dp // 8)
    doc["parallel"].update(
        tp=tp,
        pp=pp,
        dp=dp,
        zero=draw(st.integers(0, 3)),
        schedule=draw(st.sampled_from(["gpipe", "1f1b"])),
    )
    per_replica = draw(st.sampled_from([1, 2, 8, 64, 1000, 100_000, 10**9]))
    doc["training"].update(
        micro_batch=micro,
        global_batch=micro * dp * per_replica,
        recompute=draw(st.sampled_from(["none", "selective", "full"])),
    )
    model = doc["model"]
    model["layers"] = pp * draw(st.sampled_from([1, 2, 12, 100, 5000, 10**6]))
    model["seq_len"] = draw(st.sampled_from([128, 2048, 32768, 2**20]))
    return yaml.safe_dump(doc)


SET_KEYS = st.one_of(
    st.sampled_from([".".join(p) for p in SCENARIO_PATHS]),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz._", max_size=20),
)
SET_VALUES = st.one_of(
    st.text(max_size=20),
    st.sampled_from([".nan", ".inf", "-.inf", "1e400", "[1, 2", "{a: 1}", "null", "~", "0x10",
                     "1_000", "true", "10000000", "640000000000", "-3", "2.5", "'4'"]),
)  # fmt: skip
SET_TEXTS = st.one_of(
    st.builds(lambda k, v: f"{k}={v}", SET_KEYS, SET_VALUES),
    st.text(max_size=30),
)


@st.composite
def measured_csv(draw: st.DrawFn) -> str:
    """A measured-data CSV: the shipped one with cells replaced, rows cut, or raw bytes."""
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(st.binary(max_size=300)).decode("latin-1")
    lines = MEASURED.splitlines()
    head = [ln for ln in lines if ln.startswith("#")]
    body = [ln for ln in lines if not ln.startswith("#")]
    header, rows = body[0], body[1:]
    if kind == 3:
        rows = rows[: draw(st.integers(0, len(rows)))]
    cells = [r.split(",") for r in rows]
    for _ in range(draw(st.integers(0, 6))):
        if not cells:
            break
        i = draw(st.integers(0, len(cells) - 1))
        # the time columns (6-8) most often: what calibrate and compare compute with
        j = draw(st.one_of(st.sampled_from([6, 6, 7, 8, 0, 1]), st.integers(0, len(cells[i]) - 1)))
        j = min(j, len(cells[i]) - 1)
        cells[i][j] = draw(
            st.one_of(
                st.sampled_from(["nan", "inf", "-5", "0", "1e308", "", "foo", "all_reducer"]),
                st.text(alphabet="0123456789.-e", max_size=8),
            )
        )
    if kind == 1 and cells:
        cells = [c[: draw(st.integers(0, len(c)))] for c in cells]
    if kind == 2:
        head = []
    return "\n".join(head + [header] + [",".join(c) for c in cells]) + "\n"


# -- YAML aliases, special files, long and odd paths, option values -------------------------------


@st.composite
def aliased_yaml(draw: st.DrawFn) -> str:
    """A scenario whose values come through anchors and aliases: levels of lists, each naming
    the level below several times (a small one expands; a "billion laughs" one must be refused
    before it expands), merges, and now and then an anchor that holds itself."""
    levels = draw(st.integers(1, 9))
    width = draw(st.integers(1, 12))
    lines = [f"x0: &a0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"x{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    key = draw(st.sampled_from(["model", "training", "parallel", "cluster", "stragglers"]))
    base = yaml.safe_dump(BASE_SCENARIO, sort_keys=False)
    tail = draw(
        st.sampled_from(
            [
                f"{key}: *a{levels - 1}\n",
                f"extra: *a{levels - 1}\n",
                "p: &p {tp: 1, pp: 1}\nq: {<<: *p, dp: 8}\n",
                "r: &r [1, *r]\n",
                f"model: {{preset: gpt3-1.3b, layers: *a{levels - 1}}}\n",
            ]
        )
    )
    if tail.startswith(f"{key}:") or tail.startswith("model:"):
        kept = [line for line in base.splitlines() if not line.startswith(tail.split(":")[0])]
        base = "\n".join(kept) + "\n"
    return "\n".join(lines) + "\n" + base + tail


#: Names that are not plain files: devices, a pipe, a folder, a missing file, links to them,
#: a name longer than a file system allows, names with spaces, quotes and non-ASCII.
SPECIAL_NAMES = (
    "/dev/zero",
    "/dev/urandom",
    "/dev/null",
    "FIFO",
    "FOLDER",
    "MISSING",
    "LINK_ZERO",
    "LOOP",
    "LONG",
    "odd name 'x'.yaml",
    "ünï cödé.yaml",
    "-starts-with-dash.yaml",
)


def special_path(folder: Path, name: str, suffix: str = ".yaml") -> str:
    """The path ``name`` of :data:`SPECIAL_NAMES` stands for, made in ``folder``."""
    import os

    if name.startswith("/"):
        return name
    if name == "FIFO":
        path = folder / f"pipe{suffix}"
        if not path.exists():
            os.mkfifo(path)
        return str(path)
    if name == "FOLDER":
        path = folder / f"dir{suffix}"
        path.mkdir(exist_ok=True)
        return str(path)
    if name == "MISSING":
        return str(folder / "no" / f"such{suffix}")
    if name == "LINK_ZERO":
        path = folder / f"zero{suffix}"
        if not path.is_symlink():
            path.symlink_to("/dev/zero")
        return str(path)
    if name == "LOOP":
        path = folder / f"loop{suffix}"
        if not path.is_symlink():
            path.symlink_to(path)
        return str(path)
    if name == "LONG":
        return str(folder / ("a" * 300 + suffix))
    path = folder / name.replace(".yaml", suffix)
    if not path.exists():
        path.write_text(yaml.safe_dump(BASE_SCENARIO), encoding="utf-8")
    return str(path)


#: A user's values for options, by the kind of the option: out of range, not numbers, huge.
OPTION_INTS = st.sampled_from(
    ["-1", "0", "1", "2", "3", "8", "64", "4096", "2147483648", "1e3", "x", ""]
)
OPTION_FLOATS = st.sampled_from(
    ["nan", "inf", "-inf", "-1", "0", "1e-300", "0.5", "1", "1e308", "x"]
)
OPTION_TEXTS = st.sampled_from(
    ["", "0", "-1", "1K", "1M", "256M", "1T", "x", "all_reduce", "ring", "all", "a,b", "2,4", "%s"]
)

#: The commands fuzzed option by option and the arguments each needs. Commands that start
#: torch ranks or time kernels (validate bench, step, compute, ddp, fsdp) are left out: a valid
#: draw runs for minutes; their options' checks are tested one by one elsewhere.
OPTION_COMMANDS: dict[tuple[str, ...], list[str]] = {
    ("run",): [str(REPO / "scenarios" / "ddp_gpt3_1.3b.yaml"), *LIMITS],
    ("collective",): ["--topology", "dgx_h100"],
    ("goodput",): ["GOODPUT", *LIMITS],  # the 1.3B DDP plan with the published reliability
    ("schema",): [],
    ("validate", "compare"): [str(REPO / "validate" / "data" / "localhost_gloo_n2.csv")],
    ("validate", "calibrate"): [str(REPO / "validate" / "data" / "localhost_gloo_n2.csv")],
    ("validate", "kernels"): [str(REPO / "validate" / "data" / "cpu_profile.yaml")],
    ("plot", "collectives"): [str(REPO / "validate" / "data" / "localhost_gloo_n2.csv")],
}
#: Options whose values would make a valid run long: drawn from the small values only.
SLOW_OPTIONS = {"--runs", "--max-events", "--max-memory-gib", "--max-gpus", "--max-layers"}


def _command(path: tuple[str, ...]) -> Any:
    import click

    command: Any = cli
    ctx = click.Context(cli)
    for name in path:
        command = command.get_command(ctx, name)
    return command


def _goodput_file(folder: Path) -> str:
    """A small plan (scenarios/ddp_gpt3_1.3b.yaml) with the reliability section of
    scenarios/published/goodput_llama3_405b_16384.yaml: goodput in a second, not a minute."""
    path = folder / "goodput.yaml"
    if not path.exists():
        published = REPO / "scenarios" / "published" / "goodput_llama3_405b_16384.yaml"
        doc = dict(BASE_SCENARIO, reliability=yaml.safe_load(published.read_text())["reliability"])
        path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return str(path)


@st.composite
def option_args(draw: st.DrawFn, folder: Path) -> list[str]:
    """A command of :data:`OPTION_COMMANDS` with some of its options at drawn values."""
    import click

    path = draw(st.sampled_from(sorted(OPTION_COMMANDS)))
    command = _command(path)
    options = [p for p in command.params if isinstance(p, click.Option) and p.opts[0] != "--help"]
    chosen = (
        draw(st.lists(st.sampled_from(options), max_size=4, unique_by=lambda p: p.name))
        if options
        else []
    )
    args = [*path, *(_goodput_file(folder) if a == "GOODPUT" else a for a in OPTION_COMMANDS[path])]
    for option in chosen:
        flag = option.opts[0]
        if option.is_flag:
            args.append(flag)
            continue
        kind = option.type
        if isinstance(kind, click.Choice):
            value = draw(st.sampled_from([*map(str, kind.choices), "bogus"]))
        elif isinstance(kind, click.Path) or flag in ("-o", "--output", "--json", "--plot"):
            name = draw(st.sampled_from(SPECIAL_NAMES + ("out.json", "out.csv", "out.png")))
            value = special_path(
                folder, name, draw(st.sampled_from([".yaml", ".csv", ".json", ".png"]))
            )
        elif flag in SLOW_OPTIONS:
            value = draw(st.sampled_from(["-1", "0", "1", "2", "nan", "x"]))
        elif isinstance(kind, click.types.IntParamType):
            value = draw(OPTION_INTS)
        elif isinstance(kind, click.types.FloatParamType):
            value = draw(OPTION_FLOATS)
        else:
            value = draw(OPTION_TEXTS)
        args += [flag, value]
    return args


# -- running ---------------------------------------------------------------------------------------


class Hang(Exception):
    """An example ran past EXAMPLE_TIMEOUT_S."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def stop(signum: int, frame: Any) -> None:
        raise Hang(f"an example ran past {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def check_run(args: list[str]) -> None:
    """Run one command and check the rules of the module docstring."""
    with time_limit(EXAMPLE_TIMEOUT_S):
        res = CliRunner().invoke(cli, args)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        import traceback

        trace = "".join(traceback.format_exception(res.exception))
        raise AssertionError(f"traceback for {args}:\n{trace}")
    assert res.exit_code in (0, 1, 2), (args, res.exit_code, res.output)
    event(f"{args[0]}: exit {res.exit_code}")  # counted by --hypothesis-show-statistics
    assert "Traceback" not in res.output, (args, res.output)
    if res.exit_code == 2:
        lines = res.stderr.splitlines()
        assert lines, (args, "exit 2 with nothing on stderr")
        for line in lines:
            assert line.startswith("error: "), (args, res.stderr)
    assert peak_rss_bytes() < MEMORY_LIMIT_BYTES, f"peak RSS {peak_rss_bytes():,} B after {args}"


@pytest.fixture(scope="module", autouse=True)
def address_space_cap() -> Iterator[None]:
    """Cap this process's address space while fuzzing (4 GiB above what it maps now): an
    input that would grow without bound fails as a MemoryError traceback in its example,
    which the fuzzer reports, instead of the kernel killing the test run."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * resource.getpagesize()
    cap = mapped + 4 * 2**30
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _scenario(folder: Path) -> Callable[[str], None]:
    def one(text: str) -> None:
        path = folder / "s.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
        check_run(["run", str(path), *LIMITS])

    return one


def _topology(folder: Path) -> Callable[[str], None]:
    def one(text: str) -> None:
        path = folder / "t.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
        check_run(["collective", "--topology", str(path), "--gpus", "8", "-b", "1K", "-e", "1M"])

    return one


def _set_strings(texts: list[str]) -> None:
    args = ["run", str(REPO / "scenarios" / "ddp_gpt3_1.3b.yaml"), *LIMITS]
    for text in texts:
        args += ["--set", text]
    check_run(args)


def _csv(folder: Path) -> Callable[[str], None]:
    def one(text: str) -> None:
        path = folder / "m.csv"
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
        check_run(["validate", "calibrate", str(path), "-o", str(folder / "cal.yaml")])
        check_run(
            [
                "validate",
                "compare",
                str(path),
                "--topology",
                "localhost",
                "--plot",
                str(folder / "c.png"),
            ]
        )

    return one


def _special(folder: Path, case: tuple[str, str]) -> None:
    """A special path where each command reads or writes a file."""
    name, where = case
    scenario = str(REPO / "scenarios" / "ddp_gpt3_1.3b.yaml")
    measured = str(REPO / "validate" / "data" / "localhost_gloo_n2.csv")
    if where == "scenario":
        check_run(["run", special_path(folder, name), *LIMITS])
    elif where == "device":
        check_run(
            ["run", scenario, "--set", f"cluster.device={special_path(folder, name)}", *LIMITS]
        )
    elif where == "measured":
        check_run(
            ["validate", "compare", special_path(folder, name, ".csv"), "--topology", "localhost"]
        )
    elif where == "plot input":
        check_run(
            ["plot", "collectives", special_path(folder, name, ".csv"), "-o", str(folder / "p.png")]
        )
    elif where == "json output":
        check_run(["run", scenario, "--json", special_path(folder, name, ".json"), *LIMITS])
    else:  # an image written by plot
        out = special_path(folder, name, ".png")
        check_run(["plot", "collectives", measured, "-o", out])


SPECIAL_CASES = st.tuples(
    st.sampled_from(SPECIAL_NAMES),
    st.sampled_from(["scenario", "device", "measured", "plot input", "json output", "output"]),
)


def _settings(n: int, shrink: bool = True) -> Any:
    # The default suite draws the same examples every run (derandomize: a CI run judges the
    # code, not the luck of the draw); the slow 5,000-example job (n >= 1000) draws afresh.
    # No "explain" phase: its line tracer makes the simulations ~10 x slower (a 2 s run of
    # 5,000 layers passed the 20 s limit under it), so the time limit would measure the tracer.
    skipped = {Phase.explain} | (set() if shrink else {Phase.shrink})
    phases = [p for p in Phase if p not in skipped]
    return settings(
        max_examples=n,
        phases=phases,
        deadline=None,  # the SIGALRM timer bounds each example instead
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        database=None,
        derandomize=n < 1000,
    )


# -- the default suite: 300 examples ---------------------------------------------------------------


@_settings(70)
@given(text=mutated(BASE_SCENARIO, SCENARIO_PATHS))
def test_fuzz_scenario_files(folder: Path, text: str) -> None:
    _scenario(folder)(text)


@_settings(30)
@given(text=plans())
def test_fuzz_plans(folder: Path, text: str) -> None:
    _scenario(folder)(text)


@_settings(40)
@given(text=mutated(BASE_TOPOLOGY, TOPOLOGY_PATHS))
def test_fuzz_topology_files(folder: Path, text: str) -> None:
    _topology(folder)(text)


@_settings(70)
@given(texts=st.lists(SET_TEXTS, min_size=1, max_size=3))
def test_fuzz_set_strings(texts: list[str]) -> None:
    _set_strings(texts)


@_settings(12, shrink=False)
@given(text=measured_csv())
def test_fuzz_measured_csv(folder: Path, text: str) -> None:
    _csv(folder)(text)


@_settings(20)
@given(text=aliased_yaml())
def test_fuzz_yaml_aliases(folder: Path, text: str) -> None:
    _scenario(folder)(text)


@_settings(20)
@given(case=SPECIAL_CASES)
def test_fuzz_special_files_and_odd_paths(folder: Path, case: tuple[str, str]) -> None:
    _special(folder, case)


@_settings(30)
@given(data=st.data())
def test_fuzz_command_options(folder: Path, data: st.DataObject) -> None:
    check_run(data.draw(option_args(folder)))


# -- the slow job: 5,000 examples (4,000 on the configuration inputs, 1,000 CSVs) ------------------


def _only_when_asked(request: pytest.FixtureRequest) -> None:
    if "slow" not in (request.config.option.markexpr or ""):
        pytest.skip("part of the 5,000-example job, minutes long: run with -m slow")


@pytest.mark.slow
@pytest.mark.timeout(3600)
@_settings(4000)
@given(
    case=st.one_of(
        st.tuples(st.just("scenario"), mutated(BASE_SCENARIO, SCENARIO_PATHS)),
        st.tuples(st.just("pipeline"), mutated(BASE_PIPELINE, SCENARIO_PATHS)),
        st.tuples(st.just("plan"), plans()),
        st.tuples(st.just("topology"), mutated(BASE_TOPOLOGY, TOPOLOGY_PATHS)),
        st.tuples(st.just("set"), st.lists(SET_TEXTS, min_size=1, max_size=3)),
        st.tuples(st.just("aliases"), aliased_yaml()),
        st.tuples(st.just("special"), SPECIAL_CASES),
        st.tuples(st.just("options"), st.just(None)),
    ),
    data=st.data(),
)
def test_fuzz_inputs_4000(
    folder: Path, case: tuple[str, Any], data: st.DataObject, request: pytest.FixtureRequest
) -> None:
    _only_when_asked(request)
    kind, value = case
    if kind in ("scenario", "pipeline", "plan", "aliases"):
        _scenario(folder)(value)
    elif kind == "topology":
        _topology(folder)(value)
    elif kind == "special":
        _special(folder, value)
    elif kind == "options":
        check_run(data.draw(option_args(folder)))
    else:
        _set_strings(value)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@_settings(1000, shrink=False)
@given(text=measured_csv())
def test_fuzz_measured_csv_1000(folder: Path, text: str, request: pytest.FixtureRequest) -> None:
    _only_when_asked(request)
    _csv(folder)(text)
