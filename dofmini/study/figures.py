"""report.md's figures as PNG files beside it, one function per figure, each from results.json's
dict alone. matplotlib is an optional extra (`pip install matplotlib`); without it, or with one
that fails to import, the report says why and how to get them and the run goes on. The Agg backend
(no display), a fixed size and dpi."""

import os

import numpy as np

from ..distill import TERMS
from . import stats
from .compare import groups

DPI = 100
PANEL = (3.6, 3.0)  # inches per panel
INSTALL = "`pip install matplotlib` (or `pip install dofmini[test]`)"
BAD_BACKEND = "unset MPLBACKEND or set it to a backend matplotlib names (the figures use Agg)"
REINSTALL = "`pip install --force-reinstall matplotlib`, or uninstall it to run without figures"


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only: no display, the same pixels
    everywhere), or a str: why matplotlib cannot serve and how to fix it. The one place it is
    imported, so that a broken install or an invalid $MPLBACKEND costs the figures, not the run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError as err:
        if err.name == "matplotlib":
            return f"matplotlib is not installed; {INSTALL} and run again to get them"
        cause = " ".join(f"{type(err).__name__}: {err}".split())
        return f"matplotlib cannot be imported ({cause}); {REINSTALL}"
    except Exception as err:  # noqa: BLE001 - whatever a broken matplotlib raises
        cause = " ".join(f"{type(err).__name__}: {err}".split())  # one line
        fix = BAD_BACKEND if "MPLBACKEND" in os.environ else REINSTALL
        return f"matplotlib cannot be imported ({cause}); {fix}"
    return pyplot


def missing() -> str:
    """Why the run can draw no figures (matplotlib absent or broken; what to do), or ""."""
    found = _pyplot()
    return found if isinstance(found, str) else ""


def _panels(count: int, columns: int = 3):
    """A figure of `count` panels, at most `columns` a row: (figure, flat list of its axes)."""
    pyplot = _pyplot()
    columns = min(count, columns)
    rows = -(-count // columns)
    size = (PANEL[0] * columns, PANEL[1] * rows)
    figure, axes = pyplot.subplots(rows, columns, figsize=size, squeeze=False, layout="constrained")
    for extra in axes.flat[count:]:
        extra.set_visible(False)
    return figure, list(axes.flat[:count])


def _legend_beside(figure, axes):
    """One legend for the rules in `axes`, right of the panels, where it hides no point; each
    label once, in the order first drawn."""
    found = {}
    for ax in axes:
        handles, labels = ax.get_legend_handles_labels()
        for handle, label in zip(handles, labels):
            found.setdefault(label, handle)
    if found:
        figure.legend(found.values(), found.keys(), loc="outside right upper", fontsize=6)


def _save(figure, path):
    figure.savefig(path, dpi=DPI)
    _pyplot().close(figure)


def _first_seed(results: dict) -> dict:
    """{(variant, loss, budget): dims per layer} from each group's first seed (every seed of a
    group has the same dims)."""
    return {key: next(iter(by_seed.values()))["dims"] for key, by_seed in _groups(results).items()}


def _groups(results: dict) -> dict:
    return groups(results["students"])


def _label(variant: str, loss: str, losses: set) -> str:
    return variant if len(losses) == 1 else f"{variant} ({loss})"


def _styles(results: dict) -> dict:
    """{(variant, loss): its colour, marker and dash}, the same in every figure and whatever order
    the students ran in: matplotlib's ten colours, then the ten again with another marker and
    dash, so no two rules of a run look alike."""
    rules = sorted({(variant, loss) for variant, loss, _ in _groups(results)})
    markers, dashes = "os^D", ("-", "--", ":", "-.")
    styles = {}
    for i, rule in enumerate(rules):
        turn = i // 10 % len(markers)
        styles[rule] = dict(color=f"C{i % 10}", marker=markers[turn], linestyle=dashes[turn])
    return styles


def allocation(results: dict, path):
    """(a) DoF per layer, each head's and the layer's (the heads' max), beside each rule's features
    per layer at every budget."""
    per_head, dims = results["dof"]["per_head"], _first_seed(results)
    styles = _styles(results)
    budgets = sorted({budget for _, _, budget in dims})
    losses = {loss for _, loss, _ in dims}
    figure, axes = _panels(1 + len(budgets), columns=4)
    layers = np.arange(len(per_head))
    axes[0].bar(layers, [max(h) for h in per_head], color="0.85", label="layer (max of heads)")
    for head, values in enumerate(np.transpose(per_head)):
        axes[0].plot(layers, values, "o", ms=4, label=f"head {head}")
    top = 1.4 * max(map(max, per_head))  # headroom above the bars for the heads' legend
    axes[0].set(title="DoF", xlabel="layer", ylabel="DoF", ylim=(0, top))
    axes[0].legend(fontsize=6)
    for ax, budget in zip(axes[1:], budgets):
        for (variant, loss, b), layer_dims in dims.items():
            if b == budget:
                label = _label(variant, loss, losses)
                ax.plot(layers, layer_dims, ms=3, label=label, **styles[variant, loss])
        ax.set(title=f"features per layer, budget {budget}", xlabel="layer", ylabel="features")
    _legend_beside(figure, axes[1:])
    _save(figure, path)


def error_curves(results: dict, path) -> bool:
    """(b) each layer's error against its features, the swap curves' end-to-end KL where the run
    has them (else the layer KL curves), with each layerwise rule's features at each budget marked
    on the curve; False (no file) where the run has no curves."""
    curves = results.get("curves")
    if not curves:
        return False
    measured = curves.get("e2e") or curves
    what = "end-to-end KL, one layer swapped" if curves.get("e2e") else "layer KL"
    ms, mean = measured["dims"], measured["mean_kl"]
    by_rule = {}  # (variant, loss): its dims per layer at every budget
    for (variant, loss, _), layer_dims in _first_seed(results).items():
        if loss in TERMS:  # layerwise-trained PRF, as the curves' students; not untrained draws
            by_rule.setdefault((variant, loss), []).append(layer_dims)
    styles = _styles(results)
    losses = {loss for _, loss in by_rule}
    figure, axes = _panels(len(mean))
    for layer, (ax, curve) in enumerate(zip(axes, mean)):
        ax.loglog(ms, curve, "k.-", lw=1, label="Fix students")
        for (variant, loss), all_dims in by_rule.items():
            marked = [dims[layer] for dims in all_dims if ms[0] <= dims[layer] <= ms[-1]]
            errors = [stats.loglog_at(ms, curve, m) for m in marked]
            points = dict(styles[variant, loss], linestyle="none")
            label = _label(variant, loss, losses)
            ax.plot(marked, errors, ms=4, alpha=0.8, label=label, **points)
        ax.set(title=f"layer {layer}", xlabel="features M", ylabel=what)
    _legend_beside(figure, axes[:1])
    _save(figure, path)
    return True


def training_loss(results: dict, path):
    """(c) the logged training loss, mean over layers and seeds, per student group; a panel per
    budget."""
    grouped = _groups(results)
    budgets = sorted({budget for _, _, budget in grouped})
    if not budgets:  # no students
        return False
    losses = {loss for _, loss, _ in grouped}
    styles = _styles(results)
    figure, axes = _panels(len(budgets))
    for ax, budget in zip(axes, budgets):
        for (variant, loss, b), by_seed in grouped.items():
            curves = [s.get("loss_curve") or [] for s in by_seed.values()]
            if b != budget or not all(curves) or len({len(c) for c in curves}) != 1:
                continue
            steps = [step for step, _ in curves[0]]
            values = np.mean([[value for _, value in c] for c in curves], axis=0)
            line = dict(styles[variant, loss], marker=None)
            ax.semilogy(steps, values, lw=1, label=_label(variant, loss, losses), **line)
        ax.set(title=f"budget {budget}", xlabel="step", ylabel="training loss")
        if not ax.lines:  # only untrained students at this budget
            ax.text(0.5, 0.5, "nothing trained", ha="center", transform=ax.transAxes)
    _legend_beside(figure, axes)
    _save(figure, path)


def e2e_kl(results: dict, path):
    """(d) end-to-end KL per rule and budget (mean, 95% t-interval over seeds), and each rule's
    paired difference from Fix relative to Fix's mean; no bar where one seed."""
    e2e = results["e2e"]
    if not e2e:  # no students
        return False
    keys = [name.split("/") for name in e2e]
    rules = sorted({(variant, loss) for variant, loss, _ in keys})
    budgets = sorted({int(budget.removeprefix("b")) for _, _, budget in keys})
    losses = {loss for _, loss in rules}
    styles = _styles(results)
    figure, (absolute, relative) = _panels(2, columns=2)
    for i, (variant, loss) in enumerate(rules):
        found = [
            (b, e2e[f"{variant}/{loss}/b{b}"]) for b in budgets if f"{variant}/{loss}/b{b}" in e2e
        ]
        shift = 1.03 ** (i - len(rules) / 2)  # the rules side by side on the log axis
        style = dict(styles[variant, loss], ms=3, lw=1, capsize=2)
        means = [row["e2e_kl"][0] for _, row in found]
        halves = [row["e2e_kl"][1] or 0.0 for _, row in found]
        label = _label(variant, loss, losses)
        absolute.errorbar([b * shift for b, _ in found], means, halves, label=label, **style)
        # in % of Fix's mean: none where that is 0 (its "relative" None)
        paired = [(b, row) for b, row in found if row.get("relative") is not None]
        scales = [100 / e2e[f"fix/{loss}/b{b}"]["e2e_kl"][0] for b, _ in paired]  # % of Fix
        diffs = [row["minus_fix"][0] * scale for (_, row), scale in zip(paired, scales)]
        spans = [(row["minus_fix"][1] or 0.0) * scale for (_, row), scale in zip(paired, scales)]
        points = dict(style, linestyle="none")
        relative.errorbar([b * shift for b, _ in paired], diffs, spans, **points)
    absolute.set(xscale="log", yscale="log", xlabel="budget (features per layer)")
    absolute.set(ylabel="end-to-end KL (nats/token)", xticks=budgets, xticklabels=budgets)
    _legend_beside(figure, [absolute])
    relative.axhline(0, color="k", lw=0.8)
    relative.set(xscale="log", xticks=budgets, xticklabels=budgets)
    relative.set(xlabel="budget (features per layer)", ylabel="− Fix, paired, % of Fix")
    for ax in (absolute, relative):
        ax.xaxis.set_minor_locator(_pyplot().NullLocator())  # the budgets alone label the log axis
    _save(figure, path)


FIGURES = (
    ("allocation.png", allocation, "DoF per layer and head, and each rule's features per layer"),
    ("error_curves.png", error_curves, "each layer's error against its features, rules marked"),
    ("training_loss.png", training_loss, "training loss, mean over layers and seeds"),
    ("e2e_kl.png", e2e_kl, "end-to-end KL per rule and budget, 95% t-intervals over seeds"),
)


def write(out, results: dict) -> str:
    """Every figure the run's results allow, into `out`; the markdown that shows them, or that
    says why there are none and how to get them where matplotlib is absent or broken (said in one
    warning line too)."""
    why = missing()
    shown = []
    for name, draw, caption in FIGURES:
        (out / name).unlink(missing_ok=True)  # an earlier run's figure never stands for this one
        if not why and draw(results, out / name) is not False:
            shown.append(f"![{caption}]({name})")
    if why:
        print(f"warning: no figures: {why}", flush=True)  # stdout, as the run's other lines
        return f"No figures: {why}."
    return "\n\n".join(shown)
