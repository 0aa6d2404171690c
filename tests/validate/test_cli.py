"""``collsim validate`` usage errors: one line naming the option, exit code 2, no work done."""

from __future__ import annotations

from pathlib import Path

import pytest

from collsim.cli import main

BAD = [
    (["bench", "--backend", "nope"], "--backend"),
    (["compare", "missing.csv", "--topology", "localhost"], "MEASURED"),
    (["bench", "-b", "1M", "-e", "1K"], "-b/--minbytes"),
    (["bench", "--iters", "2", "--rounds", "5"], "--rounds"),
    (["bench", "--ops", "all_reduce,nope"], "--ops"),
    (["step", "--world-sizes", "2,x"], "--world-sizes"),
    (["calibrate", "missing.csv", "-o", "x.yaml"], "MEASURED"),
    (["holdout"], "MEASURED"),
    (["nope"], "nope"),
]


@pytest.mark.parametrize("args, names", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_usage_errors_are_one_line(
    args: list[str],
    names: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["validate", *args])
    out, err = capsys.readouterr()
    assert exc.value.code == 2
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error:") and names in lines[0]
    assert "Usage:" not in out + err and "Traceback" not in out + err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_bad_algorithm_pin_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = Path(__file__).resolve().parents[2] / "validate" / "data" / "localhost_gloo_n2.csv"
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "validate",
                "calibrate",
                str(data),
                "-o",
                str(tmp_path / "t.yaml"),
                "--algorithm",
                "broadcast",
            ]
        )
    out, err = capsys.readouterr()
    assert exc.value.code == 2
    assert (out + err).strip().count("\n") == 0 and "--algorithm" in err
    assert not (tmp_path / "t.yaml").exists()


def test_compare_writes_a_plot_only_where_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --plot, validate compare prints its table and writes nothing: no plot beside
    the measured file, none in the working directory; with --plot, that one file."""
    data = Path(__file__).resolve().parents[2] / "validate" / "data" / "localhost_gloo_n2.csv"
    measured = tmp_path / "m.csv"
    measured.write_bytes(data.read_bytes())
    main(["validate", "compare", str(measured), "--topology", "localhost"])
    out, err = capsys.readouterr()
    assert "median|err|" in out and "# wrote" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.csv"]
    plot = tmp_path / "out" / "c.svg"
    plot.parent.mkdir()
    main(["validate", "compare", str(measured), "--topology", "localhost", "--plot", str(plot)])
    assert plot.exists() and f"# wrote {plot}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.csv", "out"]
