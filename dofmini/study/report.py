"""Every table of a run: the allocation, and report.md (the statistics across seeds come from
compare)."""

import math

import numpy as np

from ..files import write_text
from . import compare, figures, stats, task_train, verdicts
from .compare import md_table, spaced

TASKS = task_train.TASKS  # the fine-tuned table's columns, in Table 3's order


def allocation_table(result: dict) -> str:
    """Per layer: each head's DoF, the layer's DoF, and every variant's dims at every budget, in
    the same order whether the result was just computed or reloaded from sorted JSON."""
    dims = result["dims"]
    columns = [(b, v) for b in sorted(dims, key=int) for v in sorted(dims[b])]
    rows = [
        [i, spaced(heads, ".1f"), f"{max(heads):.1f}", *(dims[b][v][i] for b, v in columns)]
        for i, heads in enumerate(result["per_head"])
    ]
    rows.append(["sum", "", "", *(sum(dims[b][v]) for b, v in columns)])
    header = ["layer", "DoF per head", "layer DoF", *(f"{v} b{b}" for b, v in columns)]
    return md_table(header, rows)


def write_allocation(out, result: dict, log):
    """dof.csv (per head), and the table on the terminal."""
    rows = ["layer,head,dof"]
    for layer, heads in enumerate(result["per_head"]):
        rows += [f"{layer},{head},{x:.4f}" for head, x in enumerate(heads)]
    write_text(out / "dof.csv", "\n".join(rows) + "\n")
    log(allocation_table(result))
    if result["warning"]:
        log(result["warning"])


def tasks_table(students: dict, teacher: dict) -> str:
    tasks = list(teacher["tasks"])
    if not tasks:
        return (
            "Tasks skipped (--limit 0): these teachers sit at chance on them, so perplexity and "
            "the per-layer errors are what separate the variants."
        )
    rows = []
    for name, result in {"teacher": teacher, **students}.items():
        values = [result["tasks"][t].get("acc_norm", result["tasks"][t]["acc"]) for t in tasks]
        rows.append([name, *(f"{v:.4f}" for v in values), f"{np.mean(values):.4f}"])
    header = ["model", *(f"{t} (n={teacher['tasks'][t]['n']})" for t in tasks), "average"]
    return "acc_norm where a task has it, else acc:\n\n" + md_table(header, rows)


def bank_words(cost: dict | None, curves: bool) -> str:
    """What the layerwise students cost in layer units (bank.cost), as a sentence; "" if none.
    `curves`: whether the run's error curves' students are among them."""
    if not cost or not cost["students"]:
        return ""
    students, distinct = cost["students"], cost["distinct_students"]
    seconds = f"{cost['unit_train_seconds']:.3g} s of training"
    among = " (the error curves among them)" if curves else ""
    return (
        f" The {students} layerwise students{among} came from"
        f" {cost['units']} layer units, each (loss, layer, M, seed) trained once ({seconds});"
        f" one student at a time, their {distinct} distinct dims would take"
        f" {cost['layer_trainings_alone']} layer trainings."
    )


def write(out, results: dict) -> str:
    """report.md and its figures; returns the summary table for the terminal."""
    teacher, students, dof, cfg = (results[k] for k in ("teacher", "students", "dof", "config"))
    grouped = compare.groups(students)
    summary = compare.students(grouped, teacher)
    lines = verdicts.verdict_lines(results, results.get("e2e_articles"))
    verdict_list = "\n".join(f"- {line}" for line in lines)
    cost = bank_words(results.get("bank"), bool(results.get("curves")))
    # the DoF rules allocate by these estimates: a J-limited one belongs at the top, not in a log
    saturated = f"\n\n**DoF {dof['warning']}**" if dof.get("warning") else ""
    text = f"""# dofmini report: {teacher["name"]} ({cfg["profile"]} profile)

ctx {cfg["ctx"]}, seeds {cfg["seeds"]}, budgets {cfg["budgets"]}, {cfg["steps"]} steps of
{cfg["batch"]} windows, DoF λ={dof["lam"]:g}, J={dof["J"]}, {("raw G", "G/J")[dof["normalize"]]};
the stages took {results["timings"]["stages_seconds"]:.0f} s in all.{cost}{saturated}

Means over seeds with 95% Student-t intervals (± half width). An error is measured per layer; each
seed's mean over layers and its worst layer are its two views.

## Each rule against Fix on end-to-end KL

Where the run kept each window's KL: better or worse where Holm's step-down at
{verdicts.FAMILY_LEVEL:g} over the rules of a loss and budget rejects a difference of 0 from Fix,
each rule's p two-sided from a bootstrap that draws the seeds and the held-out text's articles
again ({_bootstrap_words()}; "windows as articles" where the run did not record the articles),
beside that 95% percentile interval; "at the edge" where it clears 0 by less than
{100 * verdicts.EDGE:.0f}% of its width. The seeds-only t-interval and the text-only window
bootstrap (the seeds fixed) follow as diagnostics. Without per-window KL: better or worse where
the 95% t-interval of the difference from Fix, paired seed by seed, excludes 0 ("seeds only").

{verdict_list or "No rule beside Fix in this run."}
{verdicts.power_section(results)}
## Students, by end-to-end KL against the teacher, the metric to choose by

KL(teacher ‖ student) of the next-token distributions, mean per token, on held-out windows apart
from all others, least first; against Fix paired seed by seed ("− fix, text": the window
bootstrap's 95% interval, where the run kept each window's KL). The layer errors feed each layer
the teacher's own inputs and cannot weigh how a layer's error grows through the layers after it.

{summary}
{compare.swap_section(results)}
## Figures

{figures.write(out, results)}

## Feature dimensions per layer

{allocation_table(dof)}


## DoF and the oracle against Fix, seed by seed
{compare.comparisons(grouped, teacher)}

## Per-layer approximation error (teacher inputs, held-out text, mean over heads)

kernel_l2 compares unnormalised kernel values. The softmax and direct losses leave each row's
scale free, so for students trained with them kl and output_rel are the errors that count.
{compare.layer_tables(grouped)}

## Did training flatten?

{compare.training(grouped)}
{compare.curves_section(results)}

## Zero-shot tasks

{tasks_table(students, teacher)}
{finetune_section(results.get("finetune"))}"""
    write_text(out / "report.md", text)
    return summary


def _bootstrap_words() -> str:
    draws, seed = compare.BOOTSTRAP["draws"], compare.BOOTSTRAP["seed"]
    return f"{draws} draws, random.Random({seed})"


def closing(out, results: dict) -> str:
    """The run's last lines: where its files are, how long it took, and each rule's verdict."""
    made = [name for name, _, _ in figures.FIGURES if (out / name).is_file()]
    shown = ", ".join(made) if made else f"none ({figures.missing() or 'nothing to draw'})"
    timings = results["timings"]
    lines = [
        f"results: {out / 'results.json'}",
        f"report: {out / 'report.md'}",
        f"figures in {out}: {shown}",
        f"time: {timings['this_invocation_seconds']:.0f} s this invocation, "
        f"{timings['stages_seconds']:.0f} s in all the stages (reused ones included)",
        "each rule against Fix on end-to-end KL (report.md says how each verdict is reached):",
    ]
    found = verdicts.verdict_lines(results, results.get("e2e_articles"))
    rules = found or ["no rule beside Fix in this run"]
    return "\n".join(lines + [f"  {line}" for line in rules])


def _cell(values) -> str:
    mean, half = stats.mean_ci(values)
    return f"{mean:.4f}" if math.isnan(half) else f"{mean:.4f} ± {half:.4f}"


def finetune_section(found) -> str:
    """The fine-tuned table under its heading, where the run fine-tuned."""
    return f"\n## Fine-tuned tasks (Table 3's shape)\n\n{finetune_table(found)}\n" if found else ""


def finetune_table(found: dict) -> str:
    """Table 3's shape: fine-tuned accuracy per task and the mean over the tasks run (mean ± 95%
    t over seeds), each model's degradation from the teacher, and, for every student beside a
    Fix of its loss and budget, the share of Fix's degradation it removes (stats.share_removed
    on 1 − mean accuracy, seed by seed); first the teacher before fine-tuning on the same
    evaluation examples, and on which tasks fine-tuning lifted it beyond its interval."""
    models = found["models"]
    tuned = [t for t in TASKS if t in task_train.trainable_tasks()]
    means = {label: [_mean(r, tuned) for r in seeds.values()] for label, seeds in models.items()}
    teacher = sum(means["teacher"]) / len(means["teacher"])
    before = found["zero_shot"]
    zero = [f"{before[t]['acc']:.4f}" if t in tuned else "—" for t in TASKS]
    zero_mean = _mean(before, tuned)
    rows = [["teacher, not fine-tuned", *zero, f"{zero_mean:.4f}", "", ""]]
    for label, by_seed in models.items():
        accs = {t: [r[t]["acc"] for r in by_seed.values()] for t in tuned}
        cells = [_cell(accs[t]) if t in tuned else "—" for t in TASKS]
        drop = "" if label == "teacher" else _cell([teacher - m for m in means[label]])
        rows.append([label, *cells, _cell(means[label]), drop, _share(label, means, teacher)])
    header = ["model", *TASKS, "mean", "teacher − model", "share of Fix's degradation removed"]
    lrs = ", ".join(f"{t} {r['lr']:g} ({r['source']})" for t, r in found["lr"].items())
    caption = f"Fine-tuned accuracy (acc; —: no pinned training split). Rates: {lrs}."
    lifted = lifted_tasks(models["teacher"], before, tuned)
    counts = {way: f"{len(found)} of {len(tuned)}" for way, found in lifted.items()}
    which = {way: f" ({', '.join(found)})" if found else "" for way, found in lifted.items()}
    said = (
        f"Fine-tuning lifted the teacher beyond its zero-shot acc on {counts['seeds']} tasks by "
        f"the 95% t-interval over seeds{which['seeds']}, on {counts['examples']} by the 95% "
        f"Wilson interval over the task's evaluation examples{which['examples']} (the seeds "
        "share the examples: their interval leaves the examples' noise out)."
    )
    return f"{caption}\n\n{md_table(header, rows)}\n\n{said}"


def _mean(by_task: dict, tasks: list) -> float:
    return sum(by_task[t]["acc"] for t in tasks) / len(tasks)


def lifted_tasks(by_seed: dict, before: dict, tasks: list) -> dict:
    """{way: the tasks whose fine-tuned acc lies wholly above the acc before fine-tuning}:
    "seeds", its 95% t-interval over seeds (none with one seed: no interval); "examples", the
    95% Wilson interval of the seeds' mean over the task's n evaluation examples."""
    lifted = {"seeds": [], "examples": []}
    for task in tasks:
        mean, half = stats.mean_ci([r[task]["acc"] for r in by_seed.values()])
        zero = before[task]["acc"]
        if mean - half > zero:  # NaN (one seed) compares False
            lifted["seeds"].append(task)
        if stats.wilson(mean, before[task]["n"])[0] > zero:
            lifted["examples"].append(task)
    return lifted


def _share(label: str, means: dict, teacher: float) -> str:
    variant, _, rest = label.partition("/")
    fix = f"fix/{rest}"
    if label == "teacher" or variant == "fix" or fix not in means:
        return ""
    errors = [[1 - m for m in means[name]] for name in (fix, label)]
    found, why = stats.share_removed(1 - teacher, *errors)
    return why if found is None else f"{found[0]:.2f} ± {found[1]:.2f}"
