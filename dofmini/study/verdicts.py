"""What a run can tell, and what it tells, on end-to-end KL: the headroom the one-layer swap curves
leave any allocation over Fix at each budget, beside the difference the seeds resolve; how much
attention matters on the teacher (untrained random features against trained ones); and one verdict
per rule against Fix. Each returns lines or markdown for report.md and the run's last lines."""

import math

from . import stats
from .compare import groups, interval, md_table

UNTRAINED = "performer"  # the variant of untrained random features in every layer


def headroom(results: dict) -> dict:
    """Per budget (str) on the swap curves (results["curves"]["e2e"]): the summed one-layer swap
    KL of Fix ("fix") and of the end-to-end oracle's dims ("oracle"), each curve read between its
    measured points as the oracle reads it, and "gain", 1 − oracle/fix: the most any allocation
    could take off Fix's KL, as far as one-layer swaps add up. {} where the run has no swaps."""
    swap = (results.get("curves") or {}).get("e2e")
    if not swap:
        return {}
    ms = swap["dims"]
    curves = swap["mean_kl"]
    found = {}
    for budget, dims in swap["oracle"].items():
        fix = math.fsum(stats.loglog_at(ms, curve, int(budget)) for curve in curves)
        best = math.fsum(stats.loglog_at(ms, curve, m) for curve, m in zip(curves, dims))
        found[budget] = dict(fix=fix, oracle=best, gain=1 - best / fix)
    return found


def resolution(row: dict, fix_mean: float):
    """The half width of a rule's paired difference from Fix relative to Fix's mean end-to-end KL
    (what the seeds resolve); None with one seed."""
    half = row["minus_fix"][1]
    return None if half is None or not fix_mean else half / fix_mean


def verdict(row: dict, fix_mean: float, gain=None) -> str:
    """better / worse where the rule's seed-paired 95% interval of its difference from Fix excludes
    0; else "cannot resolve" where the headroom `gain` (relative, or None: unknown) is below the
    interval's half width relative to Fix, else inconclusive; one seed has no interval."""
    mean, half = row["minus_fix"]
    if half is None:
        return "one seed: no interval; run `--seeds 0,1,2`"
    if mean + half < 0:
        return "better"
    if mean - half > 0:
        return "worse"
    resolves = resolution(row, fix_mean)
    if gain is not None and gain < resolves:
        return f"cannot resolve (headroom {100 * gain:.1f}% < ±{100 * resolves:.0f}%)"
    return "inconclusive"


def verdict_lines(results: dict) -> list:
    """One line per rule, loss and budget against Fix on end-to-end KL: the verdict, the paired
    difference (mean ± 95% t half width over seeds), the relative change, and the text interval
    where the run has per-window KL."""
    e2e = results["e2e"]
    gains = headroom(results)
    lines = []
    for name, row in sorted(e2e.items(), key=lambda item: _order(item[0])):
        variant, loss, budget = name.split("/")
        if variant == "fix" or "minus_fix" not in row:
            continue
        fix_mean = e2e[f"fix/{loss}/{budget}"]["e2e_kl"][0]
        gain = gains.get(budget.removeprefix("b"), {}).get("gain")
        mean, half = row["minus_fix"]
        spread = "" if half is None else f" ± {half:.2g}"
        text = row.get("window_bootstrap", {}).get("minus_fix")
        text = f", text 95% {interval(text, '+')}" if text else ""
        numbers = f"{mean:+.3g}{spread} ({100 * row['relative']:+.1f}%){text}"
        lines.append(f"{name}: {verdict(row, fix_mean, gain)}: − fix {numbers}")
    return lines


def _order(name: str) -> tuple:
    variant, loss, budget = name.split("/")
    return loss, int(budget.removeprefix("b")), variant


def regime(results: dict) -> str:
    """How much attention matters on this teacher: the end-to-end KL of untrained random features
    in every layer (the Performer students, which have no loss) against the trained Fix students'
    (the first loss run) at each budget."""
    grouped, parts = groups(results["students"]), []
    fixes = {}
    for (variant, _, budget), by_seed in grouped.items():
        if variant == "fix":
            fixes.setdefault(budget, by_seed)
    for (variant, _, budget), by_seed in grouped.items():
        fix = fixes.get(budget)
        if variant != UNTRAINED or not fix:
            continue
        untrained = stats.mean_ci([s["e2e_kl"] for s in by_seed.values()])
        trained = stats.mean_ci([s["e2e_kl"] for s in fix.values()])
        ratio = untrained[0] / trained[0] if trained[0] else math.inf
        parts.append(
            f"budget {budget}: untrained {_pm(*untrained)} nats against Fix's trained "
            f"{_pm(*trained)} ({ratio:.0f}×)"
        )
    if not parts:
        return f"not measured (the run has no `{UNTRAINED}` students with Fix beside them)"
    return "; ".join(parts)


def _pm(mean, half) -> str:
    return f"{mean:.3g}" + ("" if math.isnan(half) else f" ± {half:.2g}")


def power_section(results: dict) -> str:
    """report.md's section: the headroom per budget beside what the seeds (and the text, where
    measured) resolve, and the regime line."""
    gains = headroom(results)
    e2e = results["e2e"]
    rows = []
    for budget, found in gains.items():
        for name in (name for name in e2e if name.startswith("fix/")):
            if name.endswith(f"/b{budget}"):
                rows.append([budget, name.split("/")[1], *_resolves(e2e, name, found)])
    table = "no swap curves in this run (variant `oracle_e2e` makes them)"
    if rows:
        header = ["budget", "loss", "Fix, summed swaps", "oracle, summed swaps", "headroom"]
        header += ["seeds resolve (rules' paired half widths)", "text resolves"]
        table = md_table(header, rows)
    return f"""
## Can this run resolve a better allocation?

The headroom: on the one-layer swap curves, the summed swap KL of the end-to-end oracle's dims
against Fix's, 1 − oracle/Fix, the most any allocation could gain as far as the layers' costs add
up. Beside it, what the seeds resolve: each rule's 95% paired half width against Fix, over Fix's
mean end-to-end KL (least to most over the rules), and the text's: the half span of the window
bootstrap's 95% interval of the difference, the same way. A gain below the resolution cannot be
told from noise; such a rule's verdict reads "cannot resolve".

{table}

How much attention matters on this teacher (end-to-end KL of untrained random features in every
layer against trained ones): {regime(results)}.
"""


def _resolves(e2e: dict, fix_name: str, found: dict) -> list:
    """A power table row's cells after budget and loss: the headroom `found`, and the rules'
    half widths (seeds, text) relative to Fix's mean, least to most."""
    suffix, fix_mean = fix_name.removeprefix("fix"), e2e[fix_name]["e2e_kl"][0]
    rules = [row for name, row in e2e.items() if name.endswith(suffix) and name != fix_name]
    seeds = sorted(r for row in rules if (r := resolution(row, fix_mean)) is not None)
    texts = [row.get("window_bootstrap", {}).get("minus_fix") for row in rules]
    texts = sorted((high - low) / 2 / fix_mean for low, high in filter(None, texts))
    cells = [f"{found['fix']:.3g}", f"{found['oracle']:.3g}", f"{100 * found['gain']:.1f}%"]
    for spread in (seeds, texts):
        span = f"±{100 * spread[0]:.0f}% to ±{100 * spread[-1]:.0f}%" if spread else "not measured"
        cells.append(span)
    return cells
