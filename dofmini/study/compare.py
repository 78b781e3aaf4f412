"""The study's statistics, variant against variant: students grouped by (variant, loss, budget),
each metric as the mean over seeds with a 95% Student-t interval, DoF and the oracle against Fix
seed by seed (a paired design: a seed draws the same data order for every variant), the per-layer
errors, the error-against-features curves with the oracle allocation they imply, and whether
training had flattened.
"""

import numpy as np

from ..files import write_text
from . import plots, stats

ERROR_METRICS = ("kl", "output_rel", "kernel_l2")
PPL_METRICS = (("wikitext2_ppl", "WikiText-2 ppl"), ("heldout_ppl", "held-out ppl"))


def groups(students: dict) -> dict:
    """{(variant, loss, budget): {seed: student result}} in run order."""
    out = {}
    for s in students.values():
        out.setdefault((s["variant"], s["loss"], s["budget"]), {})[s["seed"]] = s
    return out


def metric(student: dict, name: str):
    """A student's mean-over-layers error, or its perplexity; None where it has none."""
    if name in ("wikitext2_ppl", "heldout_ppl"):
        return student[name]
    values = student["layer_error"][name]
    return None if None in values else float(np.mean(values))


def _ci(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    mean, half = stats.mean_ci(values)
    if len(values) == 1:
        return f"{mean:.4g}"
    return f"{mean:.4g} ± {half:.2g}"


def summary_table(grouped: dict, teacher: dict) -> str:
    names = ["mean KL", "mean output error", "mean kernel L2", "WikiText-2 ppl", "held-out ppl"]
    lines = [
        "| variant | loss | budget | seeds | " + " | ".join(names) + " | train s |",
        "|---" * (len(names) + 5) + "|",
    ]
    lines.append(
        "| teacher | — | — | — | — | — | — | "
        f"{teacher['wikitext2_ppl']:.2f} | {teacher['heldout_ppl']:.2f} | — |"
    )
    for (variant, loss, budget), by_seed in grouped.items():
        runs = list(by_seed.values())
        cells = [_ci([metric(s, m) for s in runs]) for m in ERROR_METRICS]
        cells += [_ci([s[m] for s in runs]) for m, _ in PPL_METRICS]
        train = np.mean([s["train_seconds"] for s in runs])
        lines.append(
            f"| {variant} | {loss} | {budget} | {len(runs)} | "
            + " | ".join(cells)
            + f" | {train:.0f} |"
        )
    return "\n".join(lines)


def comparisons(grouped: dict, teacher: dict) -> list:
    """DoF − Fix and oracle − Fix per seed, per loss and budget, for every metric; and the share of
    Fix's perplexity degradation removed, where Fix is worse than the teacher beyond its
    interval."""
    lines = []
    for (variant, loss, budget), by_seed in grouped.items():
        fix = grouped.get(("fix", loss, budget))
        if variant not in ("dof", "dof_clip", "oracle") or not fix:
            continue
        seeds = sorted(set(by_seed) & set(fix))
        lines.append(f"\n**{variant} − fix, {loss} loss, budget {budget} ({len(seeds)} seeds)**\n")
        lines += [
            "| metric | fix | " + variant + " | difference (95% CI) | relative |",
            "|---|---|---|---|---|",
        ]
        for name in (*ERROR_METRICS, *(m for m, _ in PPL_METRICS)):
            f = [metric(fix[s], name) for s in seeds]
            d = [metric(by_seed[s], name) for s in seeds]
            if None in f or None in d:
                continue
            lines.append(
                f"| {name} | {_ci(f)} | {_ci(d)} | {_paired(d, f)} | "
                f"{100 * (np.mean(d) / np.mean(f) - 1):+.1f}% |"
            )
        for name, label in PPL_METRICS:
            f = [fix[s][name] for s in seeds]
            d = [by_seed[s][name] for s in seeds]
            share = stats.share_removed(teacher[name], f, d)
            lines.append(f"- {label}: {_share_text(share)}")
    return lines


def _paired(a, b) -> str:
    if len(a) < 2:
        return f"{a[0] - b[0]:+.4g} (one seed: no interval)"
    mean, half = stats.paired_diff(a, b)
    return f"{mean:+.4g} ± {half:.2g}"


def _share_text(share) -> str:
    interval, reason = share
    if interval is None:
        return f"share of Fix's degradation removed: not defined ({reason})"
    mean, half = interval
    return f"share of Fix's degradation removed {100 * mean:.1f}% ± {100 * half:.1f}%"


def layer_tables(grouped: dict, out) -> tuple:
    """Per-layer error tables (mean over seeds, before and after training), a chart per metric."""
    lines, charts = [], []
    for name in ERROR_METRICS:
        series, rows = {}, []
        for (variant, loss, budget), by_seed in grouped.items():
            runs = list(by_seed.values())
            if None in runs[0]["layer_error"][name]:
                continue
            label = f"{variant}/{loss}/b{budget}"
            after = np.mean([s["layer_error"][name] for s in runs], axis=0)
            series[label] = after.tolist()
            rows.append((label, after))
            if "layer_error_before" in runs[0]:
                before = np.mean([s["layer_error_before"][name] for s in runs], axis=0)
                rows.append((f"{label} before training", before))
        if not rows:
            continue
        n_layer = len(rows[0][1])
        lines += [
            f"\n**{name}**\n",
            "| student | " + " | ".join(f"L{i}" for i in range(n_layer)) + " | mean |",
            "|---" * (n_layer + 2) + "|",
        ]
        for label, values in rows:
            cells = " | ".join(f"{x:.4g}" for x in values)
            lines.append(f"| {label} | {cells} | {np.mean(values):.4g} |")
        file = f"error_{name}.svg"
        svg = plots.line_chart(series, f"per-layer {name} by student", name, name != "output_rel")
        write_text(out / file, svg)
        charts.append(f"![{name}]({file})")
    return lines, charts


def budget_chart(grouped: dict, out, name: str = "kl") -> str:
    """Mean-layer error against budget, one line per variant and loss, with 95% CI bars."""
    lines = {}
    for (variant, loss, budget), by_seed in grouped.items():
        values = [metric(s, name) for s in by_seed.values()]
        if None in values or variant == "performer":
            continue
        mean, half = stats.mean_ci(values)
        lines.setdefault(f"{variant}/{loss}", []).append((budget, mean, half))
    lines = {k: v for k, v in lines.items() if len(v) > 1}
    if not lines:
        return ""
    series = {}
    for label, points in lines.items():
        points.sort()
        series[label] = tuple(list(column) for column in zip(*points))
    svg = plots.xy_chart(
        series,
        f"mean-layer {name} against budget",
        "features per layer (budget)",
        name,
        log_x=True,
        log_y=True,
    )
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
        f"layer {i} (DoF {d:.0f})": (ms, errs, None)
        for i, (d, errs) in enumerate(zip(layer_dof, mean))
    }
    svg = plots.xy_chart(
        series,
        "held-out KL per layer against its features",
        "features M",
        "KL",
        log_x=True,
        log_y=True,
    )
    write_text(out / "curves_kl.svg", svg)
    target = float(np.median([errs[len(ms) // 2] for errs in mean]))
    needed = [stats.features_needed(ms, errs, target) for errs in mean]
    # a layer that never reaches the target within the measured Ms ranks above every one that does
    rho = stats.spearman(layer_dof, [min(n, ms[-1] + 1) for n in needed])
    lines = [
        "",
        "## Per-layer error against features, and the oracle allocation",
        "",
        f"Fix students at M = {', '.join(map(str, ms))} features in every layer, seeds "
        f"{', '.join(curves['kl'])}; held-out KL on windows disjoint from those of the tables "
        "above, mean over seeds.",
        "",
        "![curves](curves_kl.svg)",
        "",
        "| layer | layer DoF | "
        + " | ".join(f"M={m}" for m in ms)
        + f" | M to reach KL {target:.3g} |",
        "|---" * (len(ms) + 3) + "|",
    ]
    for i, (d, errs, n) in enumerate(zip(layer_dof, mean, needed)):
        cells = " | ".join(f"{x:.4g}" for x in errs)
        lines.append(f"| {i} | {d:.1f} | {cells} | {n:.1f} |")
    lines += [
        "",
        f"Spearman rank correlation between layer DoF and the M a layer needs to reach "
        f"KL {target:.3g}: {rho:+.2f} (a layer still above it at M = {ms[-1]} ranks last).",
        "",
        "The oracle allocation minimises the summed KL of these curves at each budget, "
        "each taken as the power of M through its measured points:",
        "",
        "| budget | DoF dims | oracle dims |",
        "|---|---|---|",
    ]
    for budget, dims in curves["oracle"].items():
        dof_dims = results["dof"]["dims"][budget]["dof"]
        lines.append(f"| {budget} | {' '.join(map(str, dof_dims))} | {' '.join(map(str, dims))} |")
    return lines


def loss_chart(grouped: dict, out) -> str:
    """The training-loss curve (mean over layers) of each trained group's first seed."""
    series = {}
    for (variant, loss, budget), by_seed in grouped.items():
        curve = by_seed[min(by_seed)].get("loss_curve") or []
        if len(curve) > 1:
            steps, values = zip(*curve)
            series[f"{variant}/{loss}/b{budget}"] = (list(steps), list(values), None)
    if not series:
        return ""
    svg = plots.xy_chart(
        series, "training loss (mean over layers), first seed", "step", "loss", log_y=True
    )
    write_text(out / "training_loss.svg", svg)
    return "![training loss](training_loss.svg)"


def flattening_table(grouped: dict) -> list:
    """Whether training had flattened: each group's logged loss (mean over layers and seeds) at the
    first log, half way and the end, and the share of the decrease between the first log and the
    end that came in the second half (near 0%: flat)."""
    lines = [
        "| student | first log | half way | end | share of the decrease in the second half |",
        "|---|---|---|---|---|",
    ]
    for (variant, loss, budget), by_seed in grouped.items():
        curves = [s.get("loss_curve") or [] for s in by_seed.values()]
        if any(len(c) < 3 for c in curves):
            continue
        points = [(c[0], c[len(c) // 2 - 1], c[-1]) for c in curves]  # [seed][3] of (step, loss)
        first, half, end = np.mean([[value for _, value in p] for p in points], axis=0)
        steps = "/".join(str(step) for step, _ in points[0])
        lines.append(
            f"| {variant}/{loss}/b{budget} (steps {steps}) | {first:.4f} | {half:.4f} | "
            f"{end:.4f} | {100 * (half - end) / (first - end):.1f}% |"
        )
    return lines if len(lines) > 2 else []
