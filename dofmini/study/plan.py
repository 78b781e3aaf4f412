"""A run's stages in run order, each with the files its results are saved in and their keys: what
reproduce.py's plan marks done (every file saved with its key), the stages its progress lines
count, and what the estimate costs. It comes after endtoend.py, whose files a student's stage
includes, and finetune_stages.py, whose stages follow the students' when the run fine-tunes. A
student's key needs its dims: DoF's come from the saved allocation, an oracle's from the saved
error curves (and swap curves); until those are saved its key is None. A row's validator checks
a saved result's shape (runs.saved)."""

from . import bank, endtoend, finetune_stages, runs, stages, task_train
from .endtoend import SWAP_STAGE
from .keys import Student, stage_files, student_file
from .oracle import curves_record


def stages_of(run) -> list:
    """[(stage name, file, key, validator)] of every result the run saves, in run order; one row
    a file: a curve student its curve errors, a student its evaluation and end-to-end KL (a Fix
    student of the curves all three), the swap curves one per curve student; with --finetune, then
    finetune_rows."""
    rows = [(name, *saved) for name, saved in stage_files(run).items()]
    curve_specs, curve_rows, later, specs = _students(run)
    if "oracle_e2e" in run.cfg.variants:
        rows += [(SWAP_STAGE, *endtoend.stage_file(run, s, swap=True)) for s in curve_specs]
    students = list(curve_rows)
    for spec in curve_specs + later:
        if spec.budget not in run.budgets:  # a curve student only
            continue
        for file, key, valid in (student_file(run, spec), endtoend.stage_file(run, spec)):
            students.append((spec.name, file, key if spec.dims else None, valid))
    return rows + students + (finetune_rows(run, specs) if run.cfg.finetune else [])


def finetune_rows(run, specs: list) -> list:
    """The rows of every fine-tuning (finetune_stages.run_all's, `specs` the students it tunes),
    in its order: the teacher's zero-shot accuracy on each task's evaluation split (one stage,
    ZERO_STAGE), each grid point as one stage (GRID_STAGE), then each model at each seed, a row a
    task; file and key None while unknown: a task's rate until its grid points are all saved, a
    student's key until its dims are known."""
    tuning = finetune_stages
    tasks = task_train.trainable_tasks()
    rates = tuning.learning_rates(run, saved_only=True)
    points = [where for task in tasks for where in tuning.grid(run, task)]
    rows = [(tuning.ZERO_STAGE, *tuning.zero_shot_file(run, task), None) for task in tasks]
    rows += [(tuning.GRID_STAGE, *tuning.stage_file(run, *where), None) for where in points]
    for stage_name, name, seed, spec in tuning.models_of(run, specs):
        key = tuning.model_key(run, spec)
        for task in tasks:
            if key is None or rates[task] is None:
                rows.append((stage_name, None, None, None))
                continue
            saved = tuning.stage_file(run, name, key, task, rates[task]["lr"], seed)
            rows.append((stage_name, *saved, None))
    return rows


def _students(run) -> tuple:
    """(the curve students, their curve rows, the other students in run order, stages.specs:
    every student of the run's budgets, in run order), dims where known."""
    oracles = set(stages.ORACLES) & set(run.cfg.variants)
    curve_specs = stages.curve_specs(run) if oracles else []
    curve_rows = [(s.name, *student_file(run, s, curve=True)) for s in curve_specs]
    allocation = runs.saved(*stage_files(run)["DoF estimate"])
    curves = saved_curves(run, curve_specs, curve_rows)
    specs = stages.specs(run, allocation, curves)
    later = [spec for spec in specs if spec not in curve_specs]
    return curve_specs, curve_rows, later, specs


def saved_curves(run, curve_specs: list, curve_rows: list):
    """The oracles' curves record from the saved curve errors (with the swap curves under "e2e"
    once saved), or None while one is missing."""
    errors = {}
    for spec, (_, *saved) in zip(curve_specs, curve_rows):
        errors.setdefault(str(spec.seed), []).append(runs.saved(*saved))
    if not errors or any(None in by_m for by_m in errors.values()):
        return None
    curves = curves_record(errors, run.cfg.curve_dims, run.budgets, 0.0)
    swaps = "oracle_e2e" in run.cfg.variants and endtoend.swap_curves(run, saved_only=True)
    return {**curves, "e2e": swaps} if swaps else curves


def new_units(run) -> dict:
    """{layerwise student's name: (the units it trains first, the layers the teacher runs for
    them), or None while its dims are unknown}: a unit an earlier student trains, or one already
    saved, costs nothing (bank.plan), and a student with none to train maps to (0, 0); the first
    of a loss and seed with one to train trains every known one of that loss and seed."""
    curve_specs, _, later, _ = _students(run)
    specs = [s for s in curve_specs + later if s.loss in stages.LAYERWISE]
    saved = {row["unit"] for row in bank.plan(run, [s for s in specs if s.dims]) if row["done"]}
    seen, found = set(saved), {}
    for spec in specs:
        if not spec.dims:
            found[spec.name] = None
            continue
        units = [unit for unit in bank.units_of(spec) if unit.name not in seen]
        if units:  # the first of its batch to train trains the batch (bank.assemble)
            units = [unit for unit in bank.batch(spec, specs) if unit.name not in seen]
        seen.update(unit.name for unit in units)
        deepest = max((unit.layer + 1 for unit in units), default=0)
        found[spec.name] = (len(units), deepest)
    return found


def names(rows: list) -> list:
    return list(dict.fromkeys(row[0] for row in rows))


def done(rows: list) -> set:
    """The names of the stages whose every file is saved with its key."""
    pending = {name for name, *saved in rows if saved[1] is None or runs.saved(*saved) is None}
    return set(names(rows)) - pending


def students(run) -> dict:
    """{stage name: Student without dims} of every student, for what a stage costs."""
    found = (Student(*key, ()) for key in stages.student_keys(run))
    return {student.name: student for student in found}
