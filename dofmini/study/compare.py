"""The study's statistics, student against student: students grouped by (variant, loss, budget),
each metric as the mean over seeds with a 95% t-interval, DoF and the oracle against Fix seed by
seed (a paired design: a seed draws the same data order for every variant), the per-layer errors,
the error-against-features curves with the oracle allocation they imply, and whether training had
flattened."""

import math

import numpy as np

from ..files import write_text
from . import plots, stats

# (label, key, view): view reduces a student's per-layer errors to one number per seed, None reads
# a perplexity. The worst layer stands beside the mean, as a gain on average can hide a worse layer.
METRICS = (
    ("mean KL", "kl", np.mean), ("worst-layer KL", "kl", max),
    ("mean output error", "output_rel", np.mean), ("worst-layer output error", "output_rel", max),
    ("mean kernel L2", "kernel_l2", np.mean),
    ("WikiText-2 ppl", "wikitext2_ppl", None), ("held-out ppl", "heldout_ppl", None),
)  # fmt: skip
ERRORS = ("kl", "output_rel", "kernel_l2")
PERMUTATIONS, PERMUTATION_SEED = 10000, 0  # for the permutation p-value of a rank correlation


def md_table(header, rows) -> list:
    """A markdown table's lines: the header, its rule, then one line per row (cells str()ed)."""
    line = lambda cells: "| " + " | ".join(map(str, cells)) + " |"  # noqa: E731
    return [line(header), "|---" * len(header) + "|", *map(line, rows)]


def groups(students: dict) -> dict:
    """{(variant, loss, budget): {seed: student result}} in run order."""
    out = {}
    for s in students.values():
        out.setdefault((s["variant"], s["loss"], s["budget"]), {})[s["seed"]] = s
    return out


def metric(student: dict, key: str, view):
    """One seed's value of a METRICS row; None where the student has no such error."""
    if view is None:
        return student[key]
    errors = student["layer_error"][key]
    return None if None in errors else float(view(errors))


def _pm(mean, half, sign="") -> str:
    """'mean ± half width', or the mean alone where there is no interval (one seed: nan)."""
    return f"{mean:{sign}.4g}" + (f" ± {half:.2g}" if math.isfinite(half) else "")


def _ci(values) -> str:
    values = [v for v in values if v is not None]
    return _pm(*stats.mean_ci(values)) if values else "—"


def summary_table(grouped: dict, teacher: dict) -> str:
    labels = [label for label, _, _ in METRICS]
    teacher_cells = ["—" if view else f"{teacher[key]:.2f}" for _, key, view in METRICS]
    rows = [["teacher", "—", "—", "—", *teacher_cells, "—"]]
    for (variant, loss, budget), by_seed in grouped.items():
        runs = list(by_seed.values())
        cells = [_ci([metric(s, key, view) for s in runs]) for _, key, view in METRICS]
        train = np.mean([s["train_seconds"] for s in runs])
        rows.append([variant, loss, budget, len(runs), *cells, f"{train:.0f}"])
    header = ["variant", "loss", "budget", "seeds", *labels, "train s"]
    return "\n".join(md_table(header, rows))


def against_fix(fix: dict, other: dict) -> list:
    """Other against Fix over the seeds both have: (label, Fix's (mean, half width), other's,
    other − Fix paired seed by seed, relative change of the mean) for every metric both have.

    The view is taken per seed, then averaged: the worst-layer KL is the mean over seeds of each
    seed's largest layer KL, not the largest layer of the seed-averaged errors.
    """
    seeds = sorted(set(fix) & set(other))
    rows = []
    for label, key, view in METRICS:
        f, o = ([metric(runs[s], key, view) for s in seeds] for runs in (fix, other))
        if None not in f + o:
            ci_f, ci_o = stats.mean_ci(f), stats.mean_ci(o)
            rows.append((label, ci_f, ci_o, stats.paired_diff(o, f), ci_o[0] / ci_f[0] - 1))
    return rows


def comparisons(grouped: dict, teacher: dict) -> list:
    """Per loss and budget, DoF (and the oracle) against Fix in every metric, and the share of
    Fix's perplexity degradation removed where Fix is worse than the teacher beyond noise."""
    lines = []
    for (variant, loss, budget), by_seed in grouped.items():
        fix = grouped.get(("fix", loss, budget))
        if variant not in ("dof", "dof_clip", "oracle") or not fix:
            continue
        seeds = sorted(set(by_seed) & set(fix))
        lines.append(f"\n**{variant} − fix, {loss} loss, budget {budget} ({len(seeds)} seeds)**\n")
        rows = [
            (label, _pm(*f), _pm(*o), _pm(*d, "+"), f"{100 * rel:+.1f}%")
            for label, f, o, d, rel in against_fix(fix, by_seed)
        ]
        header = ["metric", "fix", variant, f"{variant} − fix, paired (95% CI)", "relative"]
        lines += md_table(header, rows)
        for label, key, view in METRICS:
            if view is None:
                f, o = ([runs[s][key] for s in seeds] for runs in (fix, by_seed))
                lines.append(f"- {label}: {_share_text(stats.share_removed(teacher[key], f, o))}")
    return lines


def _share_text(share) -> str:
    interval, reason = share
    if interval is None:
        return f"share of Fix's degradation removed: not defined ({reason})"
    return f"share of Fix's degradation removed {100 * interval[0]:.1f}% ± {100 * interval[1]:.1f}%"


def layer_tables(grouped: dict, out) -> tuple:
    """Per-layer error tables (mean over seeds, after and before training), a chart per error."""
    lines, charts = [], []
    for name in ERRORS:
        series, rows = {}, []
        for (variant, loss, budget), by_seed in grouped.items():
            runs = list(by_seed.values())
            if None in runs[0]["layer_error"][name]:
                continue
            label = f"{variant}/{loss}/b{budget}"
            series[label] = np.mean([s["layer_error"][name] for s in runs], axis=0).tolist()
            rows.append((label, series[label]))
            if "layer_error_before" in runs[0]:
                before = np.mean([s["layer_error_before"][name] for s in runs], axis=0)
                rows.append((f"{label} before training", before))
        if not rows:
            continue
        layers = [f"L{i}" for i in range(len(rows[0][1]))]
        rows = [[label, *(f"{x:.4g}" for x in v), f"{np.mean(v):.4g}"] for label, v in rows]
        lines += [f"\n**{name}**\n", *md_table(["student", *layers, "mean"], rows)]
        svg = plots.line_chart(series, f"per-layer {name} by student", name, name != "output_rel")
        write_text(out / f"error_{name}.svg", svg)
        charts.append(f"![{name}](error_{name}.svg)")
    return lines, charts


def budget_chart(grouped: dict, out, name: str = "kl") -> str:
    """Mean-layer error against budget, one line per variant and loss, with 95% CI bars."""
    points = {}
    for (variant, loss, budget), by_seed in grouped.items():
        values = [metric(s, name, np.mean) for s in by_seed.values()]
        if None not in values and variant != "performer":
            points.setdefault(f"{variant}/{loss}", []).append((budget, *stats.mean_ci(values)))
    series = {k: tuple(map(list, zip(*sorted(v)))) for k, v in points.items() if len(v) > 1}
    if not series:
        return ""
    title, xlabel = f"mean-layer {name} against budget", "features per layer (budget)"
    svg = plots.xy_chart(series, title, xlabel, name, log_x=True, log_y=True)
    write_text(out / f"budget_{name}.svg", svg)
    return f"![{name} against budget](budget_{name}.svg)"


def curves_section(results: dict, out) -> list:
    """The per-layer error curves, how well layer DoF predicts them, and the oracle allocation."""
    curves = results.get("curves")
    if not curves:
        return []
    ms, mean = curves["dims"], curves["mean_kl"]  # mean[layer][k]
    layer_dof = [max(h) for h in results["dof"]["per_head"]]
    series = {
        f"layer {i} (DoF {d:.0f})": (ms, e, None) for i, (d, e) in enumerate(zip(layer_dof, mean))
    }
    title = "held-out KL per layer against its features"
    write_text(out / "curves_kl.svg", plots.xy_chart(series, title, "features M", "KL", True, True))
    target = float(np.median([errs[len(ms) // 2] for errs in mean]))
    needed = [stats.features_needed(ms, errs, target) for errs in mean]
    # a layer that never reaches the target within the measured Ms ranks above every one that does
    ranked = [min(n, ms[-1] + 1) for n in needed]
    rho = stats.spearman(layer_dof, ranked)
    p = stats.permutation_p(layer_dof, ranked, seed=PERMUTATION_SEED, n=PERMUTATIONS)
    rows = [
        [i, f"{d:.1f}", *(f"{x:.4g}" for x in errs), f"{n:.1f}"]
        for i, (d, errs, n) in enumerate(zip(layer_dof, mean, needed))
    ]
    oracle = [
        [b, " ".join(map(str, results["dof"]["dims"][b]["dof"])), " ".join(map(str, dims))]
        for b, dims in curves["oracle"].items()
    ]
    header = ["layer", "layer DoF", *(f"M={m}" for m in ms), f"M to reach KL {target:.3g}"]
    return [
        "",
        "## Per-layer error against features, and the oracle allocation",
        "",
        f"Fix students at M = {', '.join(map(str, ms))} features in every layer, seeds "
        f"{', '.join(curves['kl'])}; held-out KL on windows disjoint from those of the tables "
        "above, mean over seeds.",
        "",
        "![curves](curves_kl.svg)",
        "",
        *md_table(header, rows),
        "",
        f"Spearman rank correlation between layer DoF and the M a layer needs to reach "
        f"KL {target:.3g}: {rho:+.2f} (a layer still above it at M = {ms[-1]} ranks last); "
        f"two-sided permutation p = {p:.3g} (every order of the layers when there are at most "
        f"{PERMUTATIONS}, else {PERMUTATIONS} drawn with seed {PERMUTATION_SEED}).",
        "",
        "The oracle allocation minimises the summed KL of these curves at each budget, "
        "each taken as the power of M through its measured points:",
        "",
        *md_table(["budget", "DoF dims", "oracle dims"], oracle),
    ]


def loss_chart(grouped: dict, out) -> str:
    """The training-loss curve (mean over layers) of each trained group's first seed."""
    series = {}
    for (variant, loss, budget), by_seed in grouped.items():
        curve = by_seed[min(by_seed)].get("loss_curve") or []
        if len(curve) > 1:
            series[f"{variant}/{loss}/b{budget}"] = (*map(list, zip(*curve)), None)
    if not series:
        return ""
    title = "training loss (mean over layers), first seed"
    write_text(out / "training_loss.svg", plots.xy_chart(series, title, "step", "loss", log_y=True))
    return "![training loss](training_loss.svg)"


def flattening_table(grouped: dict) -> list:
    """Whether training had flattened: each group's logged loss (mean over layers and seeds) at the
    first log, half way and the end, and the share of the decrease from the first log to the end
    that came in the second half (near 0%: flat)."""
    rows = []
    for (variant, loss, budget), by_seed in grouped.items():
        curves = [s.get("loss_curve") or [] for s in by_seed.values()]
        if any(len(c) < 3 for c in curves):
            continue
        points = [(c[0], c[len(c) // 2 - 1], c[-1]) for c in curves]  # [seed][3] of (step, loss)
        first, half, end = np.mean([[value for _, value in p] for p in points], axis=0)
        steps = "/".join(str(step) for step, _ in points[0])
        share = f"{100 * (half - end) / (first - end):.1f}%"
        rows.append(
            [
                f"{variant}/{loss}/b{budget} (steps {steps})",
                *(f"{v:.4f}" for v in (first, half, end)),
                share,
            ]
        )
    header = ["student", "first log", "half way", "end", "share of the decrease in the second half"]
    return md_table(header, rows) if rows else []
