"""How other rules for keeping a knee would have done on the held-out sizes of measured files::

    python validate/probes/knee_rules.py validate/data/localhost_gloo_n*.csv \
        validate/data/earlier/*/*.csv

For each file: fit every op on the even powers of two (as ``collsim validate holdout`` does), once
per rule, and print each op's median |error| on the odd powers of two >= ``--min-size``. The
prediction is the fitted curve itself (a + b x size + c x max(0, size - K)), which is what the
calibrated topology reproduces; the figures match ``holdout``'s to the rounding. Rules:

- ``F0.05`` (the shipped rule), ``F0.10``, ``F0.20``: the best knee on the grid, kept when the
  F-test of hinge against line rejects the line at that level;
- ``always``: the best knee whenever its extra slope is > 0; ``line``: never a knee;
- ``loo``, ``loo_interior``: the knee when leaving each fitted size out in turn (all of them, or
  all but the smallest and largest) and predicting it from the others gives a smaller sum of
  squared relative errors than the line does (slow: about a minute per file);
- ``spread``: the knee when it lowers a chi-square that weighs each fitted point by its own
  measured spread (standard error of its median from its p90 and iterations) by more than
  -2 ln 0.05 (not the tool's rule; an experiment).

The summary gives, per rule, the worst and mean median |error| of the checked ops (all_reduce,
all_gather, broadcast) and how many (file, op) pairs miss 10 %.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable
from pathlib import Path

from collsim.core.units import parse_size
from collsim.validate.data.dataset import read_measurements
from collsim.validate.fit.calibrate import select_rows
from collsim.validate.fit.numerics import RegimeFit, best_knee, fit_line, fit_two_regime

CHECKED = ("all_reduce", "all_gather", "broadcast")
#: (sizes in bytes, times in s, relative standard error of each time) -> the fit kept
Rule = Callable[[list[float], list[float], list[float]], RegimeFit]


def line(sizes: list[float], times: list[float], spread: object = None) -> RegimeFit:
    a, b, err = fit_line(sizes, times)
    return RegimeFit(a, b, err, err)


def best_hinge(sizes: list[float], times: list[float]) -> RegimeFit | None:
    """The knee on the grid with the least sum of squared relative residuals (as the tool)."""
    best = best_knee(sizes, times)
    return None if best is None else best[1]


def f_test(alpha: float) -> Rule:
    return lambda sizes, times, spread: fit_two_regime(sizes, times, alpha=alpha)


def always(sizes: list[float], times: list[float], spread: object = None) -> RegimeFit:
    return best_hinge(sizes, times) or line(sizes, times)


def leave_one_out(interior: bool) -> Rule:
    def rule(sizes: list[float], times: list[float], spread: object = None) -> RegimeFit:
        straight, hinge = line(sizes, times), best_hinge(sizes, times)
        if hinge is None:
            return straight
        m = len(sizes)
        loss_line = loss_hinge = 0.0
        for i in range(1, m - 1) if interior else range(m):
            s = sizes[:i] + sizes[i + 1 :]
            t = times[:i] + times[i + 1 :]
            p_line = line(s, t).time_s(sizes[i])
            h = best_hinge(s, t)
            p_hinge = p_line if h is None else h.time_s(sizes[i])
            loss_line += ((p_line - times[i]) / times[i]) ** 2
            loss_hinge += ((p_hinge - times[i]) / times[i]) ** 2
        return hinge if loss_hinge < loss_line else straight

    return rule


def spread_gate(sizes: list[float], times: list[float], spread: list[float]) -> RegimeFit:
    """The knee when it lowers the chi-square of the relative residuals, each weighed by its
    point's own standard error, by more than the 0.05 quantile of chi-square(2) (-2 ln 0.05):
    the lack of fit is judged against the measured spread, not against the residuals."""
    straight, hinge = line(sizes, times), best_hinge(sizes, times)
    if hinge is None:
        return straight

    def chi2(fit: RegimeFit) -> float:
        return sum(((fit.time_s(s) - t) / t / e) ** 2 for s, t, e in zip(sizes, times, spread))

    return hinge if chi2(straight) - chi2(hinge) > -2.0 * math.log(0.05) else straight


def relative_standard_error(row: dict[str, object]) -> float:
    """Of a point's median time, from its p90 and iteration count: sigma ~ (p90 - median) /
    1.2816 (the normal 0.9 quantile), SE(median) ~ sqrt(pi / 2) sigma / sqrt(iters) (the
    large-sample standard error of a normal median); floored at 0.1 %."""
    median, p90 = float(row["time_us"]), float(row["p90_us"])
    sigma = max(p90 - median, 0.0) / 1.2816
    se = math.sqrt(math.pi / 2) * sigma / math.sqrt(max(1, int(row["iters"])))
    return max(se / median, 1e-3)


RULES: dict[str, Rule] = {
    "F0.05": f_test(0.05),
    "F0.10": f_test(0.10),
    "F0.20": f_test(0.20),
    "always": always,
    "line": line,
    "loo": leave_one_out(False),
    "loo_interior": leave_one_out(True),
    "spread": spread_gate,
}


def held_out_errors(path: str, rule: Rule, min_bytes: int) -> dict[str, float]:
    """Per op, the median |error| on the held-out sizes of one file under one rule."""
    meas = read_measurements(path)
    fitted = select_rows(meas.rows, "even")
    held = select_rows(meas.rows, "odd", min_bytes=min_bytes)
    out: dict[str, float] = {}
    for op in meas.ops():
        pts = [r for r in fitted if r["op"] == op]
        fit = rule(
            [float(r["size_bytes"]) for r in pts],
            [float(r["time_us"]) * 1e-6 for r in pts],
            [relative_standard_error(r) for r in pts],
        )
        errs = [
            abs(fit.time_s(float(r["size_bytes"])) / (float(r["time_us"]) * 1e-6) - 1)
            for r in held
            if r["op"] == op
        ]
        if errs:
            out[op] = statistics.median(errs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument(
        "--rules", default=",".join(RULES), help="comma-separated, from " + ", ".join(RULES)
    )
    parser.add_argument("--min-size", default="256K")
    parser.add_argument("--target", type=float, default=0.10)
    args = parser.parse_args()
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        parser.error(f"unknown rule(s) {', '.join(unknown)}; choose from {', '.join(RULES)}")
    min_bytes = parse_size(args.min_size)
    checked: dict[str, list[float]] = {r: [] for r in rules}
    print(f"# median |error| (%) on held-out sizes >= {args.min_size}, per op, per rule")
    for path in args.files:
        n = read_measurements(path).world_size
        for rule in rules:
            errs = held_out_errors(path, RULES[rule], min_bytes)
            checked[rule] += [errs[op] for op in CHECKED if op in errs]
            print(
                f"{Path(path).parent.name}/{Path(path).name} n={n} {rule:<12} "
                + " ".join(f"{op}={e * 100:.1f}" for op, e in errs.items())
            )
    print(f"# rule          worst   mean  misses (checked ops: {', '.join(CHECKED)})")
    for rule in rules:
        vals = checked[rule]
        print(
            f"  {rule:<12} {max(vals) * 100:6.1f} {statistics.mean(vals) * 100:6.2f}  "
            f"{sum(v > args.target for v in vals)}/{len(vals)}"
        )


if __name__ == "__main__":
    main()
