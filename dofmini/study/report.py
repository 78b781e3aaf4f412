"""Every table of a run: the allocation, and report.md (the statistics across seeds come from
compare)."""

import itertools

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
    if students == 1:  # nothing shared: no comparison to draw
        return f" The layerwise student came from {cost['units']} layer units ({seconds})."
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
    verdict_list = "\n".join(f"- {line}" for line in verdicts_or_why(results))
    cost = bank_words(results.get("bank"), bool(results.get("curves")))
    # the DoF rules allocate by these estimates: a J-limited one belongs at the top, not in a log
    saturated = f"\n\n**DoF {dof['warning']}**" if dof.get("warning") else ""
    text = f"""# dofmini report: {teacher["name"]} ({cfg["profile"]} profile)

ctx {cfg["ctx"]}, seeds {list(cfg["seeds"])}, budgets {cfg["budgets"]}, {cfg["steps"]} steps of
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

{verdict_list}
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
    return "\n".join(lines + [f"  {line}" for line in verdicts_or_why(results)])


def verdicts_or_why(results: dict) -> list:
    """Each rule's verdict against Fix (on the articles the run recorded), or the one line that
    says why there is none."""
    found = verdicts.verdict_lines(results, results.get("e2e_articles"))
    return found or [verdicts.no_verdict(results)]


def finetune_section(found) -> str:
    """The fine-tuned table under its heading, where the run fine-tuned."""
    return f"\n## Fine-tuned tasks (Table 3's shape)\n\n{finetune_table(found)}\n" if found else ""


def finetune_table(found: dict) -> str:
    """Table 3's shape: fine-tuned acc per task and the mean over the tasks run (means over
    seeds), the tasks on which fine-tuning lifted each model above the teacher's zero-shot acc,
    each model's degradation from the fine-tuned teacher and each student's difference from the
    Fix of its loss and budget (each paired by seed and evaluation example: `paired`), and the
    share of Fix's degradation it removes (stats.share_removed on 1 − mean acc, seed by seed);
    first the teacher before fine-tuning on the same evaluation examples."""
    if "selection" not in found:  # 0.9.0's records: chosen on what they report, no 0/1 scores
        why = "fine-tuning results from before the selection split keep no per-example scores"
        raise ValueError(f"finetune_table: {why}; fine-tune again to pair them")
    models, before = found["models"], found["zero_shot"]
    tuned = [t for t in TASKS if t in task_train.trainable_tasks()]
    means = {label: [_mean(r, tuned) for r in seeds.values()] for label, seeds in models.items()}
    teacher = sum(means["teacher"]) / len(means["teacher"])
    zero = [f"{before[t]['acc']:.4f}" if t in tuned else "—" for t in TASKS]
    rows = [["teacher, not fine-tuned", *zero, f"{_mean(before, tuned):.4f}", "", "", "", ""]]
    lifted = {}
    for label, by_seed in models.items():
        accs = {t: sum(r[t]["acc"] for r in by_seed.values()) / len(by_seed) for t in tuned}
        cells = [f"{accs[t]:.4f}" if t in tuned else "—" for t in TASKS]
        mean = sum(means[label]) / len(means[label])
        zero_shot = {seed: before for seed in by_seed}  # the same examples, scored once
        lifted[label] = [t for t in tuned if paired(by_seed, zero_shot, [t]).low > 0]
        drop = "" if label == "teacher" else _interval(paired(models["teacher"], by_seed, tuned))
        fix = _fix_of(label, models)
        minus_fix = "" if fix is None else _interval(paired(by_seed, models[fix], tuned))
        share = "" if fix is None else _share(means, label, fix, teacher)
        up = f"{len(lifted[label])} of {len(tuned)}"
        rows.append([label, *cells, f"{mean:.4f}", up, drop, minus_fix, share])
    header = ["model", *TASKS, "mean", "lifted above zero-shot", "teacher − model", "model − Fix",
              "share of Fix's degradation removed"]  # fmt: skip
    return f"{_finetune_caption(found, tuned, lifted['teacher'])}\n\n{md_table(header, rows)}"


def _finetune_caption(found: dict, tuned: list, lifted: list) -> str:
    """What the fine-tuned table shows and how each of its numbers was chosen and measured."""
    lrs = ", ".join(f"{t} {r['lr']:g} ({r['source']})" for t, r in found["lr"].items())
    records = next(iter(found["models"]["teacher"].values()))
    sizes = [records[t]["examples"] for t in tuned]
    counts = ", ".join(f"{t} {n['train']}/{n['select']}/{n['test']}" for t, n in zip(tuned, sizes))
    which = f" ({', '.join(lifted)})" if lifted else ""
    return (
        f"Fine-tuned acc (means over seeds; —: no pinned training split). Rates: {lrs}. A grid's "
        "rate, and each task's best epoch (MMLU: its one), are chosen by the acc on a selection "
        "split held out of the task's training examples, drawn once by "
        f"random.Random({found['selection']['seed']}), the same for every model and seed; the "
        "acc reported is the evaluation examples' at that epoch, never used to choose. Examples "
        f"trained on / selection / evaluation: {counts}. The intervals (teacher − model and "
        'model − Fix, on the mean acc over the tasks, each task weighed alike) and "lifted" '
        "(above the teacher's zero-shot acc on a task) come from 95% percentile bootstraps "
        f"({_bootstrap_words()}) drawing the seeds and the evaluation examples again, paired by "
        "seed and example; a task counts as lifted where the interval of fine-tuned − zero-shot "
        f"lies above 0. Fine-tuning lifted the teacher on {len(lifted)} of {len(tuned)} "
        f"tasks{which}."
    )


def paired(by_seed: dict, other: dict, tasks: list) -> stats.Bootstrap:
    """stats.cluster_bootstrap of by_seed's acc − other's over `tasks`, paired by seed and
    evaluation example, each example its own cluster; each task's differences weighed so that
    the mean is the mean over the tasks of the acc differences. by_seed, other: {seed: {task:
    a record with "ids" and "correct" (0/1 per example)}}; a ValueError where their seeds, or
    the examples a task's records scored, differ."""
    if set(by_seed) != set(other):
        raise ValueError(
            f"paired: seeds {sorted(by_seed)} against {sorted(other)}; expected one set"
        )
    first = next(iter(by_seed.values()))
    for seed, task in itertools.product(by_seed, tasks):
        if not by_seed[seed][task]["ids"] == other[seed][task]["ids"] == first[task]["ids"]:
            raise ValueError(f"paired: seed {seed}, {task}: the records scored other examples")
    cells = sum(len(first[t]["ids"]) for t in tasks)
    weight = {t: cells / (len(tasks) * len(first[t]["ids"])) for t in tasks}
    rows = []
    for seed, records in by_seed.items():
        pairs = [(t, zip(records[t]["correct"], other[seed][t]["correct"])) for t in tasks]
        rows.append([weight[t] * (a - b) for t, both in pairs for a, b in both])
    clusters = [f"{t}:{i}" for t in tasks for i in first[t]["ids"]]
    return stats.cluster_bootstrap(rows, clusters, **compare.BOOTSTRAP)


def _interval(found: stats.Bootstrap) -> str:
    return f"{found.mean:+.4f} [{found.low:+.4f}, {found.high:+.4f}]"


def _mean(by_task: dict, tasks: list) -> float:
    return sum(by_task[t]["acc"] for t in tasks) / len(tasks)


def _fix_of(label: str, models: dict):
    """The label of the Fix student of `label`'s loss and budget, or None (the teacher, Fix
    itself, or no such Fix in the run)."""
    variant, _, rest = label.partition("/")
    fix = f"fix/{rest}"
    return fix if label != "teacher" and variant != "fix" and fix in models else None


def _share(means: dict, label: str, fix: str, teacher: float) -> str:
    errors = [[1 - m for m in means[name]] for name in (fix, label)]
    found, why = stats.share_removed(1 - teacher, *errors)
    return why if found is None else f"{found[0]:.2f} ± {found[1]:.2f}"
