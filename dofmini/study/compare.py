"""The report's sections, student against student: each metric as the mean over seeds with a 95%
t-interval, DoF and the oracle against Fix seed by seed (a seed draws the same data order for every
variant), the per-layer errors, whether training flattened, and the error-against-features curves
with the oracle allocation they imply. Each returns markdown."""

import math

import numpy as np

from . import stats

# (label, key, view): view reduces a student's per-layer errors to one number per seed, None reads
# a perplexity. The worst layer stands beside the mean, as a gain on average can hide a worse layer.
METRICS = (
    ("end-to-end KL", "e2e_kl", None), ("mean KL", "kl", np.mean), ("worst-layer KL", "kl", max),
    ("mean output error", "output_rel", np.mean), ("worst-layer output error", "output_rel", max),
    ("mean kernel L2", "kernel_l2", np.mean),
    ("WikiText-2 ppl", "wikitext2_ppl", None), ("held-out ppl", "heldout_ppl", None),
)  # fmt: skip
PERMUTATIONS, PERMUTATION_SEED = 10000, 0  # for the permutation p-value of a rank correlation
BOOTSTRAP = dict(seed=0, draws=2000, level=0.95)  # window_bootstrap (results.json), verdicts too


def md_table(header, rows) -> str:
    lines = ["| " + " | ".join(map(str, cells)) + " |" for cells in [header, *rows]]
    return "\n".join([lines[0], "|---" * len(header) + "|", *lines[1:]])


def spaced(values, spec="") -> str:
    return " ".join(format(v, spec) for v in values)


def groups(students: dict) -> dict:
    """{(variant, loss, budget): {seed: student result}} in run order."""
    out = {}
    for s in students.values():
        out.setdefault((s["variant"], s["loss"], s["budget"]), {})[s["seed"]] = s
    return out


def metric(student: dict, key: str, view):
    """One seed's value of a METRICS row; None where the student has no such error."""
    if view is None:
        return student.get(key)  # a perplexity, or the end-to-end KL (None before it existed)
    errors = student["layer_error"][key]
    return None if None in errors else float(view(errors))


def percent(relative) -> str:
    """A relative change in %, or "—" where Fix's mean is 0 (no relative change: None)."""
    return "—" if relative is None else f"{100 * relative:+.1f}%"


def _pm(mean, half, sign="") -> str:
    """'mean ± half width', or the mean alone where there is no interval (one seed: nan, None)."""
    return f"{mean:{sign}.4g}" + (f" ± {half:.2g}" if math.isfinite(half or math.nan) else "")


def students(grouped: dict, teacher: dict) -> str:
    """The summary table: every metric as mean ± CI over seeds, and the end-to-end KL against Fix
    seed by seed."""
    teacher_cells = ["—" if view else f"{teacher[key]:.2f}" for _, key, view in METRICS]
    rows = [["teacher", "—", "—", "—", teacher_cells[0], "—", "—", "—", *teacher_cells[1:], "—"]]
    e2e = e2e_summary(grouped)
    for variant, loss, budget in by_e2e(grouped, e2e):
        by_seed = grouped[variant, loss, budget]
        found = e2e[f"{variant}/{loss}/b{budget}"]
        values = [[metric(s, key, view) for s in by_seed.values()] for _, key, view in METRICS]
        cis = [None if None in v else stats.mean_ci(v) for v in values]
        cells = [_pm(*ci) if ci else "—" for ci in cis]
        diff = ["—", "—", "—"]
        if "minus_fix" in found:
            diff = [_pm(*found["minus_fix"], "+"), percent(found["relative"]), "—"]
        if "minus_fix" in found.get("window_bootstrap", {}):
            diff[2] = interval(found["window_bootstrap"]["minus_fix"], "+")
        train = f"{np.mean([s['train_seconds'] for s in by_seed.values()]):.0f}"
        rows.append([variant, loss, budget, len(by_seed), cells[0], *diff, *cells[1:], train])
    labels = [label for label, _, _ in METRICS]
    header = ["variant", "loss", "budget", "seeds", labels[0], "− fix, paired", "relative"]
    return md_table([*header, "− fix, text", *labels[1:], "train s"], rows)


def by_e2e(grouped: dict, e2e: dict) -> list:
    """The keys of `grouped`, least mean end-to-end KL first (those without one last)."""
    mean = lambda key: e2e["{}/{}/b{}".format(*key)]["e2e_kl"][0]
    return sorted(grouped, key=lambda key: (mean(key) is None, mean(key) or 0.0))


def interval(bounds, sign="") -> str:
    """'[low, high]', a percentile interval."""
    low, high = bounds
    return f"[{low:{sign}.3g}, {high:{sign}.3g}]"


def against_fix(fix: dict, other: dict) -> list:
    """(label, Fix's (mean, half width), other's, other − Fix paired seed by seed, relative change
    of the mean) over the seeds both have, for every metric both have. A view is taken per seed:
    the worst-layer KL is the mean over seeds of each seed's largest layer KL."""
    seeds, rows = sorted(set(fix) & set(other)), []
    for label, key, view in METRICS:
        f, o = ([metric(runs[s], key, view) for s in seeds] for runs in (fix, other))
        if None not in f + o:
            ci_f, ci_o = stats.mean_ci(f), stats.mean_ci(o)
            relative = ci_o[0] / ci_f[0] - 1 if ci_f[0] else None  # None: Fix's mean is 0
            rows.append((label, ci_f, ci_o, stats.paired_diff(o, f), relative))
    return rows


def comparisons(grouped: dict, teacher: dict) -> str:
    """Per loss and budget, DoF (and the oracle) against Fix in every metric, and the share of
    Fix's degradation removed where Fix is worse than the teacher beyond noise."""
    parts = []
    for (variant, loss, budget), by_seed in grouped.items():
        fix = grouped.get(("fix", loss, budget))
        if variant in ("fix", "performer", "dijiang") or not fix:
            continue
        seeds = sorted(set(by_seed) & set(fix))
        rows = [
            (label, _pm(*f), _pm(*o), _pm(*d, "+"), percent(rel))
            for label, f, o, d, rel in against_fix(fix, by_seed)
        ]
        header = ["metric", "fix", variant, f"{variant} − fix, paired (95% CI)", "relative"]
        parts.append(f"\n**{variant} − fix, {loss} loss, budget {budget} ({len(seeds)} seeds)**\n")
        parts.append(md_table(header, rows))
        for label, key, view in METRICS:
            if view is None:
                f, o = ([runs[s][key] for s in seeds] for runs in (fix, by_seed))
                ci, why = stats.share_removed(teacher[key], f, o)
                share = f"{100 * ci[0]:.1f}% ± {100 * ci[1]:.1f}%" if ci else f"not defined ({why})"
                parts.append(f"- {label}: share of Fix's degradation removed: {share}")
    return "\n".join(parts)


def layer_tables(grouped: dict) -> str:
    """Per-layer error tables: mean over seeds, after and before training."""
    parts = []
    for name in ("kl", "output_rel", "kernel_l2"):
        rows = []
        for (variant, loss, budget), by_seed in grouped.items():
            runs, label = list(by_seed.values()), f"{variant}/{loss}/b{budget}"
            if None in runs[0]["layer_error"][name]:
                continue
            for key, suffix in (("layer_error", ""), ("layer_error_before", " before training")):
                if key in runs[0]:
                    rows.append([label + suffix, *np.mean([s[key][name] for s in runs], axis=0)])
        if rows:
            rows = [[label, *(f"{x:.4g}" for x in v), f"{np.mean(v):.4g}"] for label, *v in rows]
            layers = [f"L{i}" for i in range(len(rows[0]) - 2)]
            parts += [f"\n**{name}**\n", md_table(["student", *layers, "mean"], rows)]
    return "\n".join(parts)


def training(grouped: dict) -> str:
    """Whether training had flattened: the logged loss (mean over layers and seeds) at the first
    log, half way and the end, and the share of the decrease after the first log that came in the
    second half."""
    rows = []
    for (variant, loss, budget), by_seed in grouped.items():
        curves = [s.get("loss_curve") or [] for s in by_seed.values()]
        if all(len(c) >= 3 for c in curves):
            points = [(c[0], c[len(c) // 2 - 1], c[-1]) for c in curves]  # [seed][3] (step, loss)
            start, half, end = np.mean([[value for _, value in p] for p in points], axis=0)
            share = f"{100 * (half - end) / (start - end):.1f}%"
            label = f"{variant}/{loss}/b{budget} (steps {'/'.join(str(s) for s, _ in points[0])})"
            rows.append([label, *(f"{v:.4f}" for v in (start, half, end)), share])
    header = ["student", "first log", "half way", "end", "share of the decrease in the second half"]
    return md_table(header, rows) if rows else ""


def curves_section(results: dict) -> str:
    """The per-layer error curves of Fix students, how well DoF predicts the features a layer and a
    head need, and the oracle allocation they imply."""
    curves = results.get("curves")
    if not curves:
        return ""
    ms, dof = curves["dims"], results["dof"]
    block = _curves_block(curves, dof["per_head"])
    oracle = [[b, spaced(dof["dims"][b]["dof"]), spaced(m)] for b, m in curves["oracle"].items()]
    return f"""
## Per-layer error against features, DoF as a predictor, and the oracle allocation

Fix students at M = {", ".join(map(str, ms))} in every layer, seeds {", ".join(curves["kl"])}:
held-out KL (windows apart from the tables above), mean over seeds. β fits KL ≈ a·M^(−β) per
layer; the summed error is least with M ∝ a^(1/(1+β)), so a proportional rule ties Fix at best
where β ≤ 1. Does DoF order the M a layer (a head) needs to reach the common KL? Spearman's ρ, a
two-sided permutation p ({PERMUTATIONS} orders drawn with seed {PERMUTATION_SEED}, or all where
fewer), and the log-log slope of M needed on DoF (1 where M needed ∝ DoF) over those that reach
it; one above it at M = {ms[-1]} ranks last, one below it at M = {ms[0]} counts as {ms[0]}. The
oracle minimises the summed KL of these curves at each budget, each the power of M through its
measured points.

{block}

{md_table(["budget", "DoF dims", "oracle dims"], oracle)}"""


def _curves_block(curves: dict, per_head) -> str:
    """A curves record's table: per layer its DoF, seed-mean KL at each M, the M it needs to reach
    the common KL and its β (and its heads' where the record has them); and how well DoF orders
    the M needed."""
    ms = curves["dims"]
    mean = curves["mean_kl"]
    found = needs(curves)
    header = ["layer", "DoF (max)", *(f"M={m}" for m in ms)]
    header += [f"M to KL {found['layer_target']:.3g}", "β"]
    rows = [
        [i, f"{max(h):.1f}", *(f"{x:.4g}" for x in errs), f"{n:.1f}", f"{b:.2f}"]
        for i, (h, errs, n, b) in enumerate(zip(per_head, mean, found["layer"], found["beta"]))
    ]
    if "head" in found:
        header += ["DoF (mean)", "head DoF", f"head M to KL {found['head_target']:.3g}"]
        for row, h, head_needs in zip(rows, per_head, found["head"]):
            row += [f"{np.mean(h):.1f}", spaced(h, ".0f"), spaced(head_needs, ".0f")]
    evidence = evidence_table(ms, dof_views(per_head, found))
    return "\n\n".join([md_table(header, rows), evidence])


def needs(curves: dict) -> dict:
    """From the curves' record: the M each layer ("layer") and each head ("head", [L][H]) needs to
    reach a common KL ("layer_target", "head_target": the median at the middle M, so about half
    reach it there), and each layer's power law β (KL ≈ a·M^(−β), fitted through its points)."""
    ms, mean = curves["dims"], curves["mean_kl"]
    found = {"beta": [-stats.loglog_slope(ms, errs) for errs in mean]}
    levels = [("layer", mean)]
    if "kl_heads" in curves:  # the swap curves have one per layer
        heads = np.mean(list(curves["kl_heads"].values()), axis=0).transpose(1, 2, 0)  # [L, H, M]
        levels.append(("head", heads.reshape(-1, len(ms))))
    for level, errors in levels:
        target = float(np.median([curve[len(ms) // 2] for curve in errors]))
        found[f"{level}_target"] = target
        found[level] = [stats.features_needed(ms, curve, target) for curve in errors]
    if "head" in found:
        found["head"] = np.reshape(found["head"], heads.shape[:2]).tolist()  # [L][H]
    return found


def dof_views(per_head, found: dict) -> list:
    """The (level, DoF, M needed) of evidence_table: heads where `found` has them, and layers
    under both aggregations."""
    heads = [("heads", np.ravel(per_head), np.ravel(found["head"]))] if "head" in found else []
    return heads + [
        ("layers, DoF max over heads", [max(h) for h in per_head], found["layer"]),
        ("layers, DoF mean over heads", [np.mean(h) for h in per_head], found["layer"]),
    ]


def evidence_table(ms, views) -> str:
    """For each (level, DoF values, M needed): Spearman's ρ, its permutation p, and the log-log
    slope of M needed on DoF. A curve still above the target at the largest M ranks last."""
    rows, cap = [], ms[-1] + 1
    for name, dof, needed in views:
        rho, p, slope, used = stats.dof_predicts(dof, needed, cap, PERMUTATION_SEED, PERMUTATIONS)
        rows.append([name, f"{rho:+.2f}", f"{p:.3g}", f"{slope:.2f}", f"{used} of {len(needed)}"])
    return md_table(["level", "Spearman ρ", "permutation p", "log-log slope", "points"], rows)


def e2e_summary(grouped: dict) -> dict:
    """For results.json, per "variant/loss/bB": its seeds, "e2e_kl" (mean, 95% t half width over
    seeds; None where one seed), and where Fix has the budget "minus_fix", its paired difference
    from Fix seed by seed (mean, half width), and "relative", its mean over Fix's less 1. Where
    every seed has its per-window KL, "window_bootstrap": the same two as 95% percentile
    intervals [low, high] with the text's windows drawn again (stats.window_bootstrap), and the
    bootstrap's seed, draws and level."""
    found, as_json = {}, lambda mean, half: [mean, half if math.isfinite(half) else None]
    for (variant, loss, budget), by_seed in grouped.items():
        e2e = stats.mean_ci([s["e2e_kl"] for s in by_seed.values()])
        row = {"seeds": sorted(by_seed), "e2e_kl": as_json(*e2e)}
        fix = grouped.get(("fix", loss, budget))
        if fix:
            _, _, _, diff, relative = against_fix(fix, by_seed)[0]  # METRICS[0]: end-to-end KL
            row.update(minus_fix=as_json(*diff), relative=relative)
        windows = [s.get("e2e_kl_windows") for s in by_seed.values()]
        if None not in windows:
            text = dict(BOOTSTRAP, e2e_kl=stats.window_bootstrap(windows, **BOOTSTRAP))
            diffs = window_diffs(by_seed, fix or {})
            if diffs:
                text["minus_fix"] = stats.window_bootstrap(diffs, **BOOTSTRAP)
            row["window_bootstrap"] = text
        found[f"{variant}/{loss}/b{budget}"] = row
    return found


def window_diffs(by_seed: dict, fix: dict):
    """[seed][window]: a student's per-window end-to-end KL less Fix's, over the seeds both have
    (in seed order); None where they share no seed or one of those seeds lacks its windows."""
    seeds = sorted(set(by_seed) & set(fix))
    pairs = [(by_seed[s].get("e2e_kl_windows"), fix[s].get("e2e_kl_windows")) for s in seeds]
    if not pairs or not all(own and base for own, base in pairs):
        return None
    return [np.subtract(own, base).tolist() for own, base in pairs]


def swap_section(results: dict) -> str:
    """Each layer's end-to-end KL with only it swapped for a Fix student's, what DoF says of it,
    and the end-to-end oracle it implies."""
    swap = (results.get("curves") or {}).get("e2e")
    if not swap:
        return ""
    block = _curves_block(swap, results["dof"]["per_head"])
    oracle = [[b, spaced(dims)] for b, dims in swap["oracle"].items()]
    held_out = results.get("held_out")  # 0.9: each role's windows drawn over the whole text
    where = (
        f"{len(swap['windows'])} held-out windows in {held_out['swaps']['article_count']} articles"
        if held_out
        else f"{swap['windows'][1]} held-out windows from window {swap['windows'][0]}"
    )
    return f"""
Each layer's cost end to end: the teacher with only that layer swapped for the Fix student's at M
features (seeds {", ".join(swap["kl"])}, mean), on {where}, disjoint from those of the table
above, so the end-to-end oracle
(`oracle_e2e`, least summed swap KL by the same exact DP as `oracle`) is scored out of sample.

{block}

{md_table(["budget", "end-to-end oracle dims"], oracle)}"""
