"""Every table and chart of a run: the allocation, the λ/J sweep, and report.md with its SVG charts
(the statistics across seeds come from compare).
"""

import numpy as np

from ..files import write_text
from . import compare, plots


def allocation_table(result: dict) -> str:
    """Per layer: each head's DoF, the layer's DoF, and every variant's dims at every budget, in
    the same order whether the result was just computed or reloaded from sorted JSON."""
    budgets = sorted(result["dims"], key=int)
    columns = [(b, v) for b in budgets for v in sorted(result["dims"][b])]
    head = " | ".join(f"{v} b{b}" for b, v in columns)
    lines = [f"| layer | DoF per head | layer DoF | {head} |", "|---" * (3 + len(columns)) + "|"]
    for layer, heads in enumerate(result["per_head"]):
        cells = " | ".join(str(result["dims"][b][v][layer]) for b, v in columns)
        per_head = " ".join(f"{x:.1f}" for x in heads)
        lines.append(f"| {layer} | {per_head} | {max(heads):.1f} | {cells} |")
    sums = " | ".join(str(sum(result["dims"][b][v])) for b, v in columns)
    lines.append(f"| sum | | | {sums} |")
    return "\n".join(lines)


def write_allocation(out, result: dict, log):
    """dof.csv (per head), allocation.svg (the first budget), and the table on the terminal."""
    rows = ["layer,head,dof"]
    for layer, heads in enumerate(result["per_head"]):
        rows += [f"{layer},{head},{x:.4f}" for head, x in enumerate(heads)]
    write_text(out / "dof.csv", "\n".join(rows) + "\n")
    budget = min(result["dims"], key=int)
    title = f"DoF allocation, budget {budget} (λ={result['lam']:g}, J={result['J']})"
    svg = plots.allocation_chart(result["dims"][budget]["dof"], result["per_head"], title)
    write_text(out / "allocation.svg", svg)
    log(allocation_table(result))
    if result["warning"]:
        log(result["warning"])


def write_sweep(out, rows: list, log):
    lines = ["| Σ̂ | λ | J | layer DoF | dof dims |", "|---|---|---|---|---|"]
    for r in rows:
        layer = " ".join(f"{x:.0f}" for x in r["layer_dof"])
        dims = " ".join(map(str, r["dims"]))
        gram = "G/J" if r["normalize"] else "G"
        lines.append(f"| {gram} | 2^{np.log2(r['lam']):.0f} | {r['J']} | {layer} | {dims} |")
    write_text(out / "sweep.md", "\n".join(lines) + "\n")
    log("\n".join(lines))


def tasks_table(students: dict, teacher: dict) -> str:
    rows = {"teacher": teacher["tasks"], **{k: s["tasks"] for k, s in students.items()}}
    tasks = list(teacher["tasks"])
    if not tasks:
        return (
            "Tasks skipped (--limit 0): these teachers sit at chance on them, so perplexity and "
            "the per-layer errors are what separate the variants."
        )
    counts = [teacher["tasks"][t]["n"] for t in tasks]
    lines = [
        "| model | " + " | ".join(f"{t} (n={n})" for t, n in zip(tasks, counts)) + " | average |",
        "|---" * (len(tasks) + 2) + "|",
    ]
    for name, result in rows.items():
        values = [result[t].get("acc_norm", result[t]["acc"]) for t in tasks]
        cells = " | ".join(f"{v:.4f}" for v in values)
        lines.append(f"| {name} | {cells} | {np.mean(values):.4f} |")
    return "acc_norm where a task has it, else acc:\n\n" + "\n".join(lines)


def _train_time(student: dict) -> str:
    if "same_training_as" in student:  # its tensors were copied, not trained again
        return f"— (same training as {student['same_training_as']})"
    return f"{student['train_seconds']:.1f}"


def write(out, results: dict) -> str:
    """report.md and its charts; returns the summary table for the terminal."""
    teacher, students, dof_result = results["teacher"], results["students"], results["dof"]
    cfg, grouped = results["config"], compare.groups(students)
    summary = compare.summary_table(grouped, teacher)
    errors, charts = compare.layer_tables(grouped, out)
    charts += [
        c for c in (compare.budget_chart(grouped, out), compare.loss_chart(grouped, out)) if c
    ]
    times = [
        "| student | train s | evaluation s |",
        "|---|---|---|",
        f"| teacher | — | {teacher['eval_seconds']:.1f} |",
    ]
    times += [f"| {k} | {_train_time(s)} | {s['eval_seconds']:.1f} |" for k, s in students.items()]
    gram = "G/J" if dof_result["normalize"] else "raw G"
    text = "\n".join(
        [
            f"# dofmini report: {teacher['name']} ({cfg['profile']} profile)",
            "",
            f"ctx {cfg['ctx']}, seeds {cfg['seeds']}, budgets {cfg['budgets']}, "
            f"{cfg['steps']} steps "
            f"of {cfg['batch']} windows, DoF λ={dof_result['lam']:g}, J={dof_result['J']}, {gram}; "
            f"the stages took {results['timings']['stages_seconds']:.0f} s in all.",
            "",
            "Means over seeds with 95% Student-t intervals (± half width).",
            "",
            "## Feature dimensions per layer",
            "",
            allocation_table(dof_result),
            "",
            "![allocation](allocation.svg)",
            "",
            "## Students",
            "",
            summary,
            "",
            "## DoF and the oracle against Fix, seed by seed",
            *compare.comparisons(grouped, teacher),
            "",
            "## Per-layer approximation error (teacher inputs, held-out text, mean over heads)",
            "",
            "kernel_l2 compares unnormalised kernel values. The softmax and direct losses leave "
            "each "
            "row's scale free,",
            "so for students trained with them kl and output_rel are the errors that count.",
            *errors,
            "",
            " ".join(charts),
            "",
            "## Did training flatten?",
            "",
            *compare.flattening_table(grouped),
            *compare.curves_section(results, out),
            "",
            "## Zero-shot tasks",
            "",
            tasks_table(students, teacher),
            "",
            "## Times",
            "",
            "\n".join(times),
            "",
        ]
    )
    write_text(out / "report.md", text)
    return summary
