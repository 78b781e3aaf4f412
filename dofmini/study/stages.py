"""The stages of reproduce.py's comparison, one function each: the teacher's evaluation, DoF, the
error curves and the oracle, each student's training and evaluation. Each saves its
result under the file and key keys.py gives it (runs.stage)."""

import dataclasses
import functools
import itertools
import shutil
import time
from pathlib import Path

import numpy as np

from .. import dof
from ..distill import TERMS, train_direct
from ..students import load_student, make_student
from ..tensor_files import read_tensors, save_tensors
from . import bank, devices, evaluate, runs
from .bank import trained
from .keys import (
    ALLOCATIONS,
    CALIBRATION,
    Run,
    Student,
    check_texts,
    eval_key,
    settings,
    stage_files,
    student_file,
    train_key,
    valid_errors,
)
from .oracle import curves_record
from .runs import log

ORACLES = ("oracle", "oracle_e2e")  # least summed layer KL; least summed one-layer-swap e2e KL
TRAINED_PRF = ("fix", *ALLOCATIONS, *ORACLES)  # variants whose draw is trained
LAYERWISE = tuple(TERMS)  # losses trained layer by layer, in the bank's units


def student_keys(run: Run) -> list:
    """(variant, loss, budget, seed) of every student in run order, the oracle's curves first."""
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
    return list(dict.fromkeys(keys))


def dims_of(run: Run, variant: str, budget: int, allocation, curves=None):
    """A student's dims: uniform; DoF's once estimated; an oracle's once its curves are in (the
    end-to-end oracle's under curves["e2e"])."""
    if variant in ALLOCATIONS:
        return None if allocation is None else tuple(allocation["dims"][str(budget)][variant])
    if variant in ORACLES:
        found = (curves or {}).get("e2e") if variant == "oracle_e2e" else curves
        return None if found is None else tuple(found["oracle"][str(budget)])
    return (budget,) * run.teacher.config.n_layer


def evaluate_model(run: Run, model, part=None) -> dict:
    cfg, texts = run.cfg, {name: run.texts[name] for name in evaluate.PPL_TEXTS}
    options = (cfg.data, cfg.eval_windows, cfg.limit, run.tasks(), part)
    return evaluate.evaluate_model(model, run.tokenizer, texts, run.ctx, *options)


def evaluation(run: Run, name: str, path: Path, key: dict, valid, model, student=False) -> dict:
    """The stage `name` saved at `path` with `key` (a saved result checked by `valid`): `model`'s
    perplexity and tasks, a `student`'s layer errors first, each part saved as it finishes
    (saved_parts), which a rerun after an interrupt reuses; the parts are removed once the whole
    is saved."""
    parts = [*(["layer_error"] if student else []), *evaluate.PPL_TEXTS, *run.tasks()]

    def compute():
        part = saved_parts(run, name, path, key, parts)
        errors = lambda: layer_errors(run, model)
        found = {"layer_error": part("layer_error", errors)} if student else {}
        return {**found, **evaluate_model(run, model, part)}

    result = run.stage(name, path, key, valid, compute, split=True)
    folder = parts_folder(run, path)
    if devices.is_writer() and folder.exists():
        shutil.rmtree(folder)
        for above in (folder.parent, folder.parent.parent):  # eval/parts, eval: left empty
            if not any(above.iterdir()):
                above.rmdir()
    return result


def parts_folder(run: Run, path: Path) -> Path:
    return run.cfg.out / "eval" / "parts" / path.stem


def saved_parts(run: Run, name: str, path: Path, key: dict, parts: list):
    """part(part name, compute) for stage `name`'s evaluation: each part's result saved as it
    finishes under eval/parts/<stage file>/<part>.json with the stage's key and its own name
    (runs.stage: reused only for that exact key; under torchrun every rank shares the work and the
    writer alone saves). One line names the parts a rerun reuses and those it does again."""
    folder = parts_folder(run, path)
    file = lambda part: (folder / f"{part}.json", {**key, "part": part})
    found = {part: runs.saved(*file(part)) for part in parts}
    done = [part for part in parts if found[part] is not None]
    if done:
        todo = [part for part in parts if found[part] is None]
        log(f"{name}: {', '.join(done)} done; redoing {', '.join(todo) or 'nothing'}")

    def part(which: str, compute):
        if found[which] is not None:
            return found[which]
        return runs.stage(*file(which), compute, split=True)

    return part


def evaluate_teacher(run: Run) -> dict:
    check_texts(run)  # the first stage: before any work
    name = "teacher evaluation"
    result = evaluation(run, name, *stage_files(run)[name], run.teacher)
    log(f"teacher: WikiText-2 perplexity {result['wikitext2_ppl']:.2f} (ctx {run.ctx})")
    return result


def estimate_allocation(run: Run) -> dict:
    """Per-head DoF on calibration text, and each variant's dims at each budget (Algorithm 1)."""
    cfg = run.cfg
    n_layer = run.teacher.config.n_layer
    cap = run.teacher.config.head_dim

    def compute():
        t0 = time.time()
        calib = run.texts["calib"]
        normalize = not cfg.raw_gram
        seed = cfg.seeds[0]
        per_head = dof.estimate_dof(run.teacher, calib, run.lam, cfg.J, seed, normalize, run.ctx)
        if not (per_head.amax(-1) > 0).all():
            raise runs.RunError(f"--lam {run.lam}: a layer's DoF is 0 at this λ; use a smaller λ")
        dims = {str(b): {"fix": [b] * n_layer} for b in run.budgets}
        for b, variant in itertools.product(dims, ALLOCATIONS):
            rule, aggregate, clip, share = ALLOCATIONS[variant]
            floor = max(1, int(int(b) * (share or 0)))
            most = clip and cap or None
            dims[b][variant] = dof.allocate(per_head, int(b), rule, most, aggregate, floor)
        found = dict(lam=run.lam, J=cfg.J, seed=seed, normalize=normalize, dims=dims)
        found["calibration"] = f"{CALIBRATION}: first {len(calib)} tokens, ctx {run.ctx}"
        found.update(per_head=per_head.tolist(), warning=saturation_warning(per_head, cfg.J))
        return dict(found, seconds=time.time() - t0)

    return run.stage("DoF estimate", *stage_files(run)["DoF estimate"], compute)


def saturation_warning(per_head, J):
    """A message if any head's DoF [L, H] exceeds J/2 (J then limits it), else None."""
    if not (over := int((per_head > J / 2).sum())):
        return None
    layer, head = divmod(int(per_head.argmax()), per_head.shape[-1])
    return (
        f"warning: {over} of {per_head.numel()} heads have DoF above J/2 = "
        f"{J / 2:g} (largest {per_head.max():.0f}, layer {layer} head {head}):"
        " J limits these estimates; use a larger J or a larger lam"
    )


def train_student(run: Run, spec: Student, together=()):
    """Train one student (draw it, for the Performer) into its file, or load it if finished with
    this key, or copy a finished twin: another PRF variant trained with exactly this key (the
    oracle often allocates Fix's dims). A layerwise one is assembled from the bank's units
    (bank.assemble; `together`: the run's students whose units may train in the same pass); an
    interrupted training resumes from its progress file."""
    run.clock.begin(spec.name)
    key = train_key(run, spec)
    path = spec.path(run.cfg.out)
    out = run.cfg.out
    others = TRAINED_PRF if spec.variant in TRAINED_PRF else ()
    twins = [dataclasses.replace(spec, variant=v) for v in others if v != spec.variant]
    twins = [t for t in twins if trained(t.path(out), {**key, "variant": t.variant}, own=False)]
    record = {"loss": spec.loss, "variant": spec.variant, "key": key}
    if trained(path, key):
        log(f"skip: {path} done")
    elif twins:
        tensors, meta = read_tensors(twins[0].path(out))
        info = {**meta["info"], "same_training_as": twins[0].name}
        save_tensors(tensors, path, {**meta, "variant": spec.variant, "key": key, "info": info})
        log(f"{spec.name}: the same training as {twins[0].name} (same dims, loss and seed): copied")
    elif spec.loss in LAYERWISE:
        log(f"{spec.name}: dims {list(spec.dims)}, from units")
        bank.assemble(run, spec, path, record, together)
    else:
        log(f"{spec.name}: dims {list(spec.dims)}")
        train, tokens = settings(run, spec.seed), run.texts["train"]
        runs.train_into(path, record, train, tokens, fitting(run, spec), log)
    devices.barrier()  # the writer has saved it
    student, meta = load_student(run.teacher, path, {"key": key})
    return student, meta["info"]


def fitting(run: Run, spec: Student):
    """train(log=, resume=, on_step=) -> (student, record): a whole student's training, the
    direct baseline's (PRF or DiJiang) or the Performer's draw, untrained."""
    tokens, train = run.texts["train"], settings(run, spec.seed)
    if spec.variant == "performer":  # the draw, untrained
        untrained = {"train_seconds": 0.0, "loss_curve": []}
        return lambda **_: (performer(run, spec), untrained)
    kind = "dijiang" if spec.variant == "dijiang" else "prf"
    start = make_student(run.teacher, kind, spec.dims, spec.seed)
    return functools.partial(train_direct, start, tokens, train, share=devices.shared)


def curve_specs(run: Run) -> list:
    """The Fix students of the error curves, seed by seed, M by M."""
    n_layer, cfg = run.teacher.config.n_layer, run.cfg
    grid = itertools.product(cfg.seeds, cfg.curve_dims)  # seed by seed, M by M
    return [Student("fix", "softmax", m, s, (m,) * n_layer) for s, m in grid]


def error_curves(run: Run, allocation: dict) -> dict:
    """Every layer's held-out KL at each of curve_dims features (Fix students, assembled from
    units that train together with those of every student of known dims), on the held-out
    windows after the reported errors' ones."""
    cfg = run.cfg
    errors = {}
    curve_only_seconds = 0.0
    windows = (cfg.curve_windows, cfg.error_windows)
    curve_students = curve_specs(run)
    together = curve_students + specs(run, allocation, None)
    for spec in curve_students:
        student, info = train_student(run, spec, together)
        compute = functools.partial(layer_errors, run, student, *windows)
        found = run.stage(spec.name, *student_file(run, spec, curve=True), compute)
        errors.setdefault(str(spec.seed), []).append(found)
        if spec.budget not in run.budgets:  # the others are Fix students, timed with the students
            curve_only_seconds += info["train_seconds"]
    return curves_record(errors, cfg.curve_dims, run.budgets, curve_only_seconds)


def specs(run: Run, allocation: dict, curves) -> list:
    """Every student with its dims, in run order (the curve-only Fix students are done already)."""
    return [
        Student(variant, loss, budget, seed, dims_of(run, variant, budget, allocation, curves))
        for variant, loss, budget, seed in student_keys(run)
        if variant != "fix" or budget in run.budgets
    ]


def train_and_evaluate(run: Run, spec: Student, together=()) -> dict:
    """One student's training record, layer errors before and after training, perplexity, tasks
    (`together`: train_student's)."""
    student, info = train_student(run, spec, together)
    evaluated = evaluation(run, spec.name, *student_file(run, spec), student, student=True)
    result = {**evaluated, **info}
    result.update(dataclasses.asdict(spec), dims=list(spec.dims))
    if spec.variant in TRAINED_PRF:  # the draw training started from (a Performer of these dims)
        key = {"teacher": run.inputs["teacher"], "dims": spec.dims, "seed": spec.seed}
        path = run.cfg.out / "eval" / f"untrained-{'-'.join(map(str, spec.dims))}-s{spec.seed}.json"
        compute = lambda: layer_errors(run, performer(run, spec))
        valid = functools.partial(valid_errors, run)
        result["layer_error_before"] = runs.stage(
            path, {**key, **eval_key(run)}, compute, False, valid
        )
    kl = result["layer_error"]["kl"]
    kl_text = "—" if None in kl else f"{np.mean(kl):.4g}"
    log(f"{spec.name}: WikiText-2 perplexity {result['wikitext2_ppl']:.2f}, mean KL {kl_text}")
    return result


def performer(run: Run, spec: Student):  # the untrained draw where training starts
    return make_student(run.teacher, "prf", spec.dims, spec.seed)


def layer_errors(run: Run, student, windows=None, offset=0) -> dict:
    windows, heldout = windows or run.cfg.error_windows, run.texts["heldout"]
    return evaluate.layer_errors(run.teacher, student, heldout, run.ctx, windows, offset)
