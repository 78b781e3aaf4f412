"""What a run can tell, and what it tells, on end-to-end KL: the headroom the one-layer swap curves
leave any allocation over Fix at each budget, beside the difference the seeds resolve; how much
attention matters on the teacher (untrained random features against trained ones); and one verdict
per rule against Fix, from the two-way bootstrap over seeds and articles with Holm's step-down over
the rules of a loss and budget where the run kept each window's KL, else from the seeds alone. Each
returns lines or markdown for report.md and the run's last lines."""

import math

from . import stats
from .compare import BOOTSTRAP, groups, interval, md_table, percent, window_diffs

UNTRAINED = "performer"  # the variant of untrained random features in every layer
FAMILY_LEVEL = 0.05  # Holm's family-wise error over the rules of one loss and budget
EDGE = 0.10  # a verdict whose interval clears 0 by less than this share of its width: at the edge


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


def family_verdict(found: stats.Bootstrap, rejected: bool) -> str:
    """better / worse where Holm's step-down over the rule's family (`rejected`) rejects a
    difference of 0 from Fix, by the sign of the combined interval `found`'s mean; else
    inconclusive. A rejection whose interval clears 0 by less than EDGE of its width says so."""
    if not rejected:
        return "inconclusive"
    word = "better" if found.mean < 0 else "worse"
    if not stats.at_edge(found.low, found.high, EDGE):
        return word
    share = stats.clears_by(found.low, found.high)
    return f"{word} (at the edge: clears 0 by {100 * share:.0f}% of its width)"


def combined(results: dict, articles=None) -> dict:
    """{rule name: stats.cluster_bootstrap of its per-window difference from Fix} for the rules
    whose paired seeds all kept each window's end-to-end KL, the seeds and the articles drawn
    again; `articles` names each end-to-end window's article (window order), None: each window
    its own."""
    grouped = groups(results["students"])
    found = {}
    for (variant, loss, budget), by_seed in grouped.items():
        fix = grouped.get(("fix", loss, budget))
        diffs = None if variant == "fix" or not fix else window_diffs(by_seed, fix)
        if diffs:
            clusters = range(len(diffs[0])) if articles is None else articles
            found[f"{variant}/{loss}/b{budget}"] = stats.cluster_bootstrap(
                diffs, clusters, **BOOTSTRAP
            )
    return found


def holm_by_family(found: dict) -> dict:
    """{rule name: (whether Holm's step-down at FAMILY_LEVEL rejects its bootstrap p, how many
    rules its family has)}, a family being the rules of `found` (combined's) at one loss and
    budget."""
    families = {}
    for name in found:
        _, loss, budget = name.split("/")
        families.setdefault((loss, budget), []).append(name)
    rejected = {}
    for names in families.values():
        decisions = stats.holm([found[name].p for name in names], FAMILY_LEVEL)
        rejected.update((name, (decision, len(names))) for name, decision in zip(names, decisions))
    return rejected


def verdict_lines(results: dict, articles=None) -> list:
    """One line per rule, loss and budget against Fix on end-to-end KL. Where the run kept each
    window's KL: family_verdict, the mean difference and its relative change, the 95% interval
    with seeds and articles drawn again (`articles`: one id per end-to-end window, in window
    order; None: the windows as articles), its p and the family Holm weighed, then as
    diagnostics the seeds-only t half width and the text-only window bootstrap. Else the
    seeds-only verdict and the paired difference (mean ± 95% t half width over seeds)."""
    e2e = results["e2e"]
    gains = headroom(results)
    found = combined(results, articles)
    decided = holm_by_family(found)
    unit = "windows as articles" if articles is None else "articles"
    lines = []
    for name, row in sorted(e2e.items(), key=lambda item: _order(item[0])):
        variant, loss, budget = name.split("/")
        if variant == "fix" or "minus_fix" not in row:
            continue
        mean, half = row["minus_fix"]
        seeds = f"{mean:+.3g}" + ("" if half is None else f" ± {half:.2g}")
        change = f"({percent(row['relative'])})"
        if name in found:
            result = found[name]
            rejected, family = decided[name]
            words = family_verdict(result, rejected)
            numbers = f"{result.mean:+.3g} {change}, {_combined_interval(result, family, unit)}"
            text = row.get("window_bootstrap", {}).get("minus_fix")
            text = f", text only 95% {interval(text, '+')}" if text else ""
            diagnostics = f"diagnostics: seeds only {seeds}{text}"
            lines.append(f"{name}: {words}: − fix {numbers}; {diagnostics}")
        else:
            fix_mean = e2e[f"fix/{loss}/{budget}"]["e2e_kl"][0]
            gain = gains.get(budget.removeprefix("b"), {}).get("gain")
            words = verdict(row, fix_mean, gain)
            lines.append(f"{name}: {words}: − fix, seeds only: {seeds} {change}")
    return lines


def no_verdict(results: dict) -> str:
    """Why verdict_lines gives no line: the run has no rule beside Fix, or no Fix student at its
    rules' losses and budgets to compare them with."""
    baselines = ("fix", "performer", "dijiang")  # Fix itself, and baselines that have no rule
    rules = [name for name in results["e2e"] if name.split("/")[0] not in baselines]
    if not rules:
        return "no rule beside Fix in this run"
    variants = dict.fromkeys(name.split("/")[0] for name in sorted(rules, key=_order))
    named = ", ".join(variants)
    return f"no Fix student beside {named} at their losses and budgets (add fix to --variants)"


def _combined_interval(result: stats.Bootstrap, family: int, unit: str) -> str:
    """The combined interval as a verdict line says it: its 95% bounds over seeds and `unit`
    (articles, or windows as articles), its p, and how many rules Holm weighed."""
    bounds = interval((result.low, result.high), "+")
    rules = "1 rule" if family == 1 else f"{family} rules"
    holm = f"Holm over {rules} at {FAMILY_LEVEL:g}"
    return f"seeds × {unit} 95% {bounds}, p {result.p:.2g} ({holm})"


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
        header += ["measured headroom"]
        header += ["seeds resolve (rules' paired half widths)", "text resolves"]
        table = md_table(header, rows)
    return f"""
## Can this run resolve a better allocation?

The headroom: on the one-layer swap curves, the summed swap KL of the end-to-end oracle's dims
against Fix's, 1 − oracle/Fix, the most any allocation could gain as far as the layers' costs add
up, read in sample (on the windows the oracle was chosen on). The measured headroom: the
end-to-end oracle's student against Fix on the end-to-end KL's own windows, which it never saw
(1 − its KL / Fix's). Beside them, what the seeds resolve: each rule's 95% paired half width
against Fix, over Fix's mean end-to-end KL (least to most over the rules), and the text's: the
half span of the window bootstrap's 95% interval of the difference, the same way. A gain below
the resolution cannot be told from noise; such a rule's seeds-only verdict reads "cannot
resolve".

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
    oracle = e2e.get(f"oracle_e2e{suffix}")  # chosen on the swaps' windows, scored on its own
    measured = oracle and -oracle["minus_fix"][0] / fix_mean
    cells.append("—" if measured is None else f"{100 * measured:.1f}%")
    for spread in (seeds, texts):
        span = f"±{100 * spread[0]:.0f}% to ±{100 * spread[-1]:.0f}%" if spread else "not measured"
        cells.append(span)
    return cells
