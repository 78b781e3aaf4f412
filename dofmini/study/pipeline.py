"""The run's stages, written once, in the order they run; runner.Runner executes them in plan mode
(what is done, what the rest will cost) or in run mode. Each stage names its file, its key (the
settings and inputs its result depends on, from the Run's students and units), its compute
(compute.py) and its work (estimate.py's kinds). In order:

1. the teacher's evaluation, then DoF and every rule's dims at every budget;
2. with an oracle, the error curves: each Fix student of curve_dims, seed by seed, trained and
   its held-out layer errors measured (one at a run budget is evaluated whole there);
3. with oracle_e2e, the swap curves (each curve student's layers swapped into the teacher);
4. every other student, the end-to-end oracle's first, then variant by variant, so a run cut
   short leaves whole variants: trained (layerwise ones assembled from the bank's units), then
   its evaluation, its untrained draw's layer errors and its end-to-end KL;
5. with --finetune, fine-tuning (finetune_stages.py).
DiJiang runs at the head size whatever --budgets says; the Performer's draw, like every rule, at
each budget. A key that needs a result still pending in plan mode (dims from DoF or the curves, a
rate from the grid) is None, and its stage is pending too."""

import dataclasses
import itertools
import time
from functools import partial

import numpy as np

from . import bank, compare, compute, devices, endtoend, evaluate, finetune_stages, report
from .compute import (
    LAYERWISE,
    ORACLES,
    TRAINED_PRF,
    valid_allocation,
    valid_errors,
    valid_evaluation,
)
from .oracle import curves_record, seed_mean_oracle
from .run import ALLOCATIONS, CALIBRATION, check_texts
from .runner import PENDING
from .store import log

SWAP_STAGE = "end-to-end swap curves"


def run_all(run, runner) -> dict:
    """Every stage in order; in run mode the results (results.json), in plan mode PENDING (a plan
    records its rows and writes nothing)."""
    check_texts(run)  # before any work
    teacher = teacher_evaluation(run, runner)
    allocation = dof_estimate(run, runner)
    oracles = set(ORACLES) & set(run.cfg.variants)
    curve_students = fix_curve_students(run) if oracles else []
    curves, results = error_curves(run, runner, curve_students, allocation)
    if "oracle_e2e" in run.cfg.variants:
        swaps = swap_curves(run, runner, curve_students)
        curves = PENDING if PENDING in (curves, swaps) else {**curves, "e2e": swaps}
    planned = students(run, allocation, curves)
    rest = [spec for spec in planned if spec.name not in results]
    order = {v: i for i, v in enumerate(dict.fromkeys(spec.variant for spec in rest))}
    rest.sort(key=lambda spec: (spec.variant != "oracle_e2e", order[spec.variant]))
    for spec in rest:
        trained = train(run, runner, spec, planned)
        results[spec.name] = evaluate_student(run, runner, spec, trained)
    found = {spec.name: results[spec.name] for spec in planned}  # plan order, however run
    tuned = finetune_stages.run_all(run, runner, planned) if run.cfg.finetune else None
    if runner.planning or PENDING in (teacher, allocation, curves, tuned, *found.values()):
        return PENDING
    every = curve_students + planned
    return collect(run, runner, teacher, allocation, curves, found, every, tuned)


def ppl_windows(run) -> int:
    counts = [len(run.texts[text]) // run.ctx for text in evaluate.PPL_TEXTS]
    return sum(min(n, run.cfg.eval_windows or n) for n in counts)


def teacher_evaluation(run, runner):
    path = run.cfg.out / "teacher.json"
    key = {"teacher": run.inputs["teacher"], **run.eval_key()}
    work = {"teacher ppl window": ppl_windows(run), "teacher tasks": 1}
    name = "teacher evaluation"
    found = evaluation(run, runner, name, path, key, lambda: run.teacher, work)
    if found is not PENDING:
        runner.log(f"teacher: WikiText-2 perplexity {found['wikitext2_ppl']:.2f} (ctx {run.ctx})")
    return found


def evaluation(run, runner, name: str, path, key, model, work: dict, student=False):
    """The stage of model()'s evaluation (compute.evaluation: saved in parts, removed once it is
    whole), a `student`'s with its layer errors."""
    measure = compute.evaluation(run, name, path, key, model, student)
    valid = partial(valid_evaluation, run, student)
    then = lambda _: compute.remove_parts(run, path)  # noqa: E731
    return runner.stage(name, path, key, measure, work, valid, split=True, then=then)


def dof_estimate(run, runner):
    cfg, inputs = run.cfg, run.inputs
    key = dict(teacher=inputs["teacher"], calib=inputs[CALIBRATION], device=inputs["device"])
    key.update(seed=run.dof_seed, budgets=run.budgets, rules=ALLOCATIONS, lam=run.lam, J=cfg.J)
    key.update(ctx=run.ctx, calib_windows=cfg.calib_windows, normalize=not cfg.raw_gram)
    heads = run.teacher.config.n_layer * run.teacher.config.n_head
    work = {"dof window": cfg.calib_windows, "dof head": heads}
    path = cfg.out / "allocation.json"
    then = lambda found: report.write_allocation(cfg.out, found, log)  # noqa: E731
    valid = partial(valid_allocation, run)
    return runner.stage("DoF estimate", path, key, partial(compute.allocation, run), work, valid,
                        then=then)  # fmt: skip


def fix_curve_students(run) -> list:
    """The Fix students of the error curves, seed by seed, M by M."""
    n_layer, grid = run.teacher.config.n_layer, itertools.product(run.cfg.seeds, run.cfg.curve_dims)
    return [run.student("fix", "softmax", m, seed, (m,) * n_layer) for seed, m in grid]


def students(run, allocation, curves) -> list:
    """Every student of the run's budgets, in plan (report) order, with its dims where known: the
    curves' Fix students first, then seed by seed DiJiang, the Performer's draw and each trained
    variant at each loss and budget."""
    cfg, keys = run.cfg, []
    if set(ORACLES) & set(cfg.variants):
        keys += [("fix", "softmax", m, seed) for seed in cfg.seeds for m in cfg.curve_dims]
    for seed in cfg.seeds:
        if "dijiang" in cfg.variants:
            keys.append(("dijiang", "direct", run.teacher.config.head_dim, seed))
        if "performer" in cfg.variants:
            keys += [("performer", "none", b, seed) for b in run.budgets]
        for loss, b in itertools.product(cfg.losses, run.budgets):
            keys += [(v, loss, b, seed) for v in cfg.variants if v in TRAINED_PRF]
    found = [key for key in dict.fromkeys(keys) if key[0] != "fix" or key[2] in run.budgets]
    return [run.student(*key, dims_of(run, *key[:3], allocation, curves)) for key in found]


def dims_of(run, variant: str, loss: str, budget: int, allocation, curves):
    """A student's dims: uniform; DoF's once estimated; an oracle's once its curves are in (the
    end-to-end oracle's under curves["e2e"]); None while pending."""
    if variant in ALLOCATIONS:
        return None if allocation is PENDING else allocation["dims"][str(budget)][variant]
    if variant in ORACLES:
        if curves is None or curves is PENDING:
            return None
        return (curves["e2e"] if variant == "oracle_e2e" else curves)["oracle"][str(budget)]
    return (budget,) * run.teacher.config.n_layer


def train(run, runner, spec, together):
    """A student's training (its file's record), `together` the students whose layer units may
    train in the same pass (compute.train_student)."""
    fitting = partial(compute.train_student, run, spec, together)
    work = partial(training_work, run, runner, spec, together)
    return runner.stage(spec.name, spec.path(run.cfg.out), spec.key, fitting, work, split=True)


def training_work(run, runner, spec, together) -> dict:
    """A training's steps; a layerwise student's only for the units bank.to_train gives it (all
    of them while its dims are unknown): the teacher's pass scales with the deepest, the losses
    with the count. Units planned by earlier stages count as trained."""
    steps, n_layer = spec.settings.steps, run.teacher.config.n_layer
    if spec.variant == "performer":
        return {}
    if spec.loss not in LAYERWISE:
        return {("step", spec.loss, "dijiang" if spec.variant == "dijiang" else "prf"): steps}
    count = deepest = n_layer
    if spec.dims is not None:
        planned = runner.planned
        done = lambda unit: unit in planned or bank.is_trained(run, unit)  # noqa: E731
        fresh = bank.to_train(run, spec, together, done)
        planned.update(fresh)
        count, deepest = len(fresh), max((unit.layer + 1 for unit in fresh), default=0)
    work = {("teacher pass", spec.loss): steps * deepest / n_layer}
    work[("unit step", spec.loss)] = steps * count / n_layer
    return dict(work, units=None if spec.dims is None else count)


def error_curves(run, runner, curve_students: list, allocation) -> tuple:
    """(The curves record: every layer's held-out KL at each of curve_dims and the oracle dims it
    implies, {name: result} of the curve students at a run budget, evaluated whole here). Their
    units train together with those of every student of known dims."""
    cfg = run.cfg
    errors, seconds, whole = {}, 0.0, {}
    together = curve_students + students(run, allocation, PENDING)
    for spec in curve_students:
        trained = train(run, runner, spec, together)
        key = run.of_student(spec, windows=run.windows["curves"])
        path = cfg.out / "eval" / f"{spec.stem}-curve.json"
        model = compute.loader(run, spec)
        measure = partial(curve_errors, run, model)
        work = {"layer window": cfg.curve_windows}
        found = runner.stage(spec.name, path, key, measure, work, partial(valid_errors, run))
        errors.setdefault(str(spec.seed), []).append(found)
        if spec.budget in run.budgets:  # a student too, timed with the students
            whole[spec.name] = evaluate_student(run, runner, spec, trained, model)
        elif trained is not PENDING:
            seconds += trained["info"]["train_seconds"]
    if not errors or any(PENDING in by_m for by_m in errors.values()):
        return (PENDING if errors else None), whole
    return curves_record(errors, cfg.curve_dims, run.budgets, seconds), whole


def curve_errors(run, model) -> dict:
    return compute.layer_errors(run, model(), "curves")


def swap_curves(run, runner, curve_students: list):
    """Each layer's end-to-end KL with only that layer swapped for the Fix curve student's at each
    of curve_dims, every seed; their seed means ("mean_kl" [L][M]) and the end-to-end oracle dims
    at each budget (the exact DP of oracle_allocate on those means)."""
    cfg, kl = run.cfg, {}
    windows = run.windows["swaps"]
    work = {"teacher ppl window": cfg.e2e_windows * (run.teacher.config.n_layer + 1)}
    for spec in curve_students:
        key = run.of_student(spec, e2e=windows)
        path = cfg.out / "eval" / f"{spec.stem}-swap.json"
        swaps = lambda spec=spec: endtoend.swap_kl(run, compute.load(run, spec))  # noqa: E731
        valid = partial(endtoend.valid_swap_kl, run)
        found = runner.stage(SWAP_STAGE, path, key, swaps, work, valid)
        kl.setdefault(str(spec.seed), []).append(found)  # [M][layer]
    if any(PENDING in by_m for by_m in kl.values()):
        return PENDING
    return dict(seed_mean_oracle(kl, cfg.curve_dims, run.budgets), windows=list(windows))


def evaluate_student(run, runner, spec, trained, model=None) -> dict:
    """A trained student's evaluation (perplexity, tasks, layer errors), its untrained draw's
    layer errors (a trained PRF variant's) and its end-to-end KL, with its training record."""
    cfg = run.cfg
    model = model or compute.loader(run, spec)
    path = cfg.out / "eval" / f"{spec.stem}.json"
    key = run.of_student(spec, errors=run.windows["errors"])
    work = {"layer window": cfg.error_windows, "student ppl window": ppl_windows(run)}
    work["student tasks"] = 1
    evaluated = evaluation(run, runner, spec.name, path, key, model, work, student=True)
    before = None
    if spec.variant in TRAINED_PRF:  # the draw training started from (a Performer of these dims)
        drawn = f"{'-'.join(map(str, spec.dims or ()))}-s{spec.seed}"
        path = cfg.out / "eval" / f"untrained-{drawn}.json"
        own = dict(teacher=run.inputs["teacher"], dims=spec.dims, seed=spec.seed)
        own.update(errors=run.windows["errors"], **run.eval_key())
        key = None if spec.key is None else own
        errors = lambda: compute.layer_errors(run, compute.performer(run, spec))  # noqa: E731
        work = {"layer window": cfg.error_windows}
        before = runner.stage(spec.name, path, key, errors, work, partial(valid_errors, run))
    path = cfg.out / "eval" / f"{spec.stem}-e2e.json"
    key = run.of_student(spec, e2e=run.windows["e2e"], per_window=True)
    kl = lambda: endtoend.student_kl(run, model())  # noqa: E731
    work = {"e2e window": cfg.e2e_windows}
    valid = partial(endtoend.valid_student_kl, run)
    found = runner.stage(spec.name, path, key, kl, work, valid)
    if PENDING in (trained, evaluated, before, found):
        return PENDING
    result = {**evaluated, **trained["info"], "variant": spec.variant, "loss": spec.loss}
    result.update(budget=spec.budget, seed=spec.seed, dims=list(spec.dims))
    if before is not None:
        result["layer_error_before"] = before
    kl_layers = result["layer_error"]["kl"]
    kl_text = "—" if None in kl_layers else f"{np.mean(kl_layers):.4g}"
    ppl = result["wikitext2_ppl"]
    runner.log(f"{spec.name}: WikiText-2 perplexity {ppl:.2f}, mean KL {kl_text}")
    runner.log(f"{spec.name}: end-to-end KL {found['e2e_kl']:.4g}")
    return dict(result, e2e_kl=found["e2e_kl"], e2e_kl_windows=found["windows"])


def collect(run, runner, teacher_result, allocation, curves, students, every, tuned) -> dict:
    """results.json: every number, the settings, the inputs' hashes and what made them."""
    config = {k: v for k, v in dataclasses.asdict(run.cfg).items() if k not in ("out", "data")}
    inputs = dict(run.inputs, read=run.files_read())  # the data files in the order read
    config.update(ctx=run.ctx, lam=run.lam, budgets=list(run.budgets))
    trainings = [s["train_seconds"] for s in students.values() if "same_training_as" not in s]
    seconds = teacher_result["eval_seconds"] + allocation["seconds"] + sum(trainings)
    seconds += sum(s["eval_seconds"] for s in students.values())
    seconds += curves["curve_only_train_seconds"] if curves else 0.0
    seconds += finetune_stages.train_seconds(tuned) if tuned else 0.0
    model_cfg = run.teacher.config
    teacher = dict(teacher_result, name=model_cfg.name, identity=run.teacher.identity)
    teacher.update(head_dim=model_cfg.head_dim, n_layer=model_cfg.n_layer, e2e_kl=0.0)
    found = dict(teacher=teacher, dof=allocation, curves=curves)
    found.update(students=students, config=config, inputs=inputs)
    found["e2e"] = compare.e2e_summary(compare.groups(students))  # the metric to choose by
    found["bank"] = bank.cost(run, list(dict.fromkeys(every)))
    articles = run.articles()
    found["held_out"] = {
        role: dict(windows=windows, articles=articles[role], article_count=len(set(articles[role])))
        for role, windows in run.windows.items()
    }
    found["e2e_articles"] = articles["e2e"]  # the verdicts' clusters
    if tuned is not None:
        found["finetune"] = tuned
    # a resumed run skips finished stages, so its own wall time says little
    timings = {"stages_seconds": seconds, "this_invocation_seconds": time.time() - runner.t0}
    return dict(found, provenance=devices.provenance(run.teacher), timings=timings)
