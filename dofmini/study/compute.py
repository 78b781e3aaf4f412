"""What the stages of reproduce.py's comparison compute (pipeline.py says which, in what order,
under which file and key): a model's evaluation in resumable parts, DoF and each rule's dims, a
student's training (or its copy from a twin, or its assembly from layer units) and layer errors;
beside each, the check of its result's shape that a saved one must pass to be reused."""

import dataclasses
import functools
import itertools
import shutil
import time
from pathlib import Path

from .. import dof
from ..distill import TERMS, train_direct
from ..students import load_student, make_student
from ..tensor_files import read_tensors, save_tensors
from . import bank, devices, evaluate, store
from .run import (
    ALLOCATIONS,
    CALIBRATION,
    Run,
    Student,
    has_fields,
    is_list_of,
    is_number,
    valid_score,
)
from .store import log

ORACLES = ("oracle", "oracle_e2e")  # least summed layer KL; least summed one-layer-swap e2e KL
TRAINED_PRF = ("fix", *ALLOCATIONS, *ORACLES)  # variants whose draw is trained
LAYERWISE = tuple(TERMS)  # losses trained layer by layer, in the bank's units


def evaluate_model(run: Run, model, part=None) -> dict:
    cfg, texts = run.cfg, {name: run.texts[name] for name in evaluate.PPL_TEXTS}
    options = (cfg.data, cfg.eval_windows, cfg.limit, run.tasks(), part)
    return evaluate.evaluate_model(model, run.tokenizer, texts, run.ctx, *options)


def parts_folder(run: Run, path: Path) -> Path:
    return run.cfg.out / "eval" / "parts" / path.stem


def evaluation(run: Run, name: str, path: Path, key: dict, model, student=False):
    """compute() of the evaluation saved at `path` with `key`: model()'s perplexity and tasks, a
    `student`'s layer errors first, each part saved as it finishes under eval/parts/<stage
    file>/<part>.json with the stage's key and its own name (reused only for that exact key;
    under torchrun every rank shares the work and the writer alone saves). One line names the
    parts a rerun reuses and those it does again."""
    parts = [*(["layer_error"] if student else []), *evaluate.PPL_TEXTS, *run.tasks()]
    folder = parts_folder(run, path)

    def compute():
        file = lambda part: (folder / f"{part}.json", {**key, "part": part})
        valid = lambda part: functools.partial(valid_part, run, part)  # noqa: E731
        found = {part: store.saved(*file(part), valid(part)) for part in parts}
        if done := [part for part in parts if found[part] is not None]:
            todo = [part for part in parts if found[part] is None]
            log(f"{name}: {', '.join(done)} done; redoing {', '.join(todo) or 'nothing'}")

        def part(which: str, compute_part):
            if found[which] is not None:
                return found[which]
            return store.load_or_compute(*file(which), compute_part, True, valid(which))

        errors = lambda: layer_errors(run, model())  # noqa: E731
        measured = {"layer_error": part("layer_error", errors)} if student else {}
        return {**measured, **evaluate_model(run, model(), part)}

    return compute


def valid_part(run: Run, part: str, result) -> bool:
    """A part of an evaluation (evaluation's, above): the layer errors; a text's {"result":
    (perplexity, NLL, tokens), "seconds"}; a task's {"result": its score, "seconds"}."""
    if part == "layer_error":
        return valid_errors(run, result)
    texts = lambda v: is_list_of(v, 3, is_number)  # noqa: E731
    scored = texts if part in evaluate.PPL_TEXTS else valid_score
    return has_fields(result, ("seconds",), is_number) and has_fields(result, ("result",), scored)


def valid_evaluation(run: Run, student: bool, result) -> bool:
    """evaluate.evaluate_model's: each perplexity and task; a student's layer errors too."""
    texts = [f"{name}_{what}" for name in evaluate.PPL_TEXTS for what in ("ppl", "tokens")]
    scores = lambda v: has_fields(v, run.tasks(), valid_score)  # noqa: E731
    found = has_fields(result, texts, is_number) and scores(result.get("tasks"))
    return found and (not student or valid_errors(run, result.get("layer_error")))


def remove_parts(run: Run, path: Path):
    """The parts of the evaluation saved at `path`, removed once it is whole."""
    folder = parts_folder(run, path)
    if devices.is_writer() and folder.exists():
        shutil.rmtree(folder)
        for above in (folder.parent, folder.parent.parent):  # eval/parts, eval: left empty
            if not any(above.iterdir()):
                above.rmdir()


def allocation(run: Run) -> dict:
    """Per-head DoF on calibration text, and each variant's dims at each budget (Algorithm 1)."""
    cfg = run.cfg
    n_layer = run.teacher.config.n_layer
    cap = run.teacher.config.head_dim
    t0 = time.time()
    calib = run.texts["calib"]
    normalize = not cfg.raw_gram
    seed = run.dof_seed
    per_head = dof.estimate_dof(run.teacher, calib, run.lam, cfg.J, seed, normalize, run.ctx)
    if not (per_head.amax(-1) > 0).all():
        raise store.RunError(f"--lam {run.lam}: a layer's DoF is 0 at this λ; use a smaller λ")
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


def valid_allocation(run: Run, result) -> bool:
    """The DoF stage's: per head DoF, and each variant's dims (each >= 1) at each budget."""
    n_layer, variants = run.teacher.config.n_layer, ("fix", *ALLOCATIONS)
    dims = lambda v: is_list_of(v, n_layer, lambda m: type(m) is int and m >= 1)  # noqa: E731
    budget = lambda v: has_fields(v, variants, dims)  # noqa: E731
    per_head = is_list_of(isinstance(result, dict) and result.get("per_head"), n_layer, bool)
    return per_head and has_fields(result.get("dims"), map(str, run.budgets), budget)


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


def twins(run: Run, spec: Student) -> list:
    """The other PRF variants of `spec`'s loss, budget, seed and dims whose training is saved:
    exactly this training (the oracle often allocates Fix's dims)."""
    others = TRAINED_PRF if spec.variant in TRAINED_PRF else ()
    found = [dataclasses.replace(spec, variant=v) for v in others if v != spec.variant]
    out = run.cfg.out
    return [t for t in found if store.saved(t.path(out), {**spec.key, "variant": t.variant})]


def train_student(run: Run, spec: Student, together=()):
    """Train one student into its file (draw it, for the Performer), or copy a finished twin; a
    layerwise one is assembled from the bank's units (bank.assemble; `together`: the run's
    students whose units may train in the same pass); an interrupted training resumes from its
    progress file."""
    path, out = spec.path(run.cfg.out), run.cfg.out
    record = {"loss": spec.loss, "variant": spec.variant, "key": spec.key}
    if found := twins(run, spec):
        tensors, meta = read_tensors(found[0].path(out))
        info = {**meta["info"], "same_training_as": found[0].name}
        save_tensors(
            tensors, path, {**meta, "variant": spec.variant, "key": spec.key, "info": info}
        )
        log(f"{spec.name}: the same training as {found[0].name} (same dims, loss and seed): copied")
    elif spec.loss in LAYERWISE:
        log(f"{spec.name}: dims {list(spec.dims)}, from units")
        bank.assemble(run, spec, path, record, together)
    else:
        log(f"{spec.name}: dims {list(spec.dims)}")
        tokens = run.texts["train"]
        store.train_into(path, record, spec.settings, tokens, fitting(run, spec), log)


def load(run: Run, spec: Student):
    """A trained student, from its file (checked against its key)."""
    return load_student(run.teacher, spec.path(run.cfg.out), {"key": spec.key})[0]


def loader(run: Run, spec: Student):
    """load(run, spec) on its first call, the same student after."""
    return functools.cache(functools.partial(load, run, spec))


def fitting(run: Run, spec: Student):
    """train(log=, resume=, on_step=) -> (student, record): a whole student's training, the
    direct baseline's (PRF or DiJiang) or the Performer's draw, untrained."""
    if spec.variant == "performer":  # the draw, untrained
        untrained = {"train_seconds": 0.0, "loss_curve": []}
        return lambda **_: (performer(run, spec), untrained)
    kind = "dijiang" if spec.variant == "dijiang" else "prf"
    start = make_student(run.teacher, kind, spec.dims, spec.seed)
    tokens = run.texts["train"]
    return functools.partial(train_direct, start, tokens, spec.settings, share=devices.shared)


def performer(run: Run, spec: Student):  # the untrained draw where training starts
    return make_student(run.teacher, "prf", spec.dims, spec.seed)


def layer_errors(run: Run, student, role: str = "errors") -> dict:
    """`student`'s layer errors on `role`'s held-out windows (Run.windows)."""
    count = len(run.windows[role])
    return evaluate.layer_errors(run.teacher, student, run.window_ids(role), run.ctx, count)


def valid_errors(run: Run, result) -> bool:
    """evaluate.layer_errors': per layer, numbers (None for a layer without PRF features)."""
    n_layer, n_head = run.teacher.config.n_layer, run.teacher.config.n_head
    layers = lambda v: is_list_of(v, n_layer, lambda x: x is None or is_number(x))  # noqa: E731
    heads = lambda v: v is None or is_list_of(v, n_head, is_number)  # noqa: E731
    lists = has_fields(result, ("kernel_l2", "kl", "output_rel"), layers)
    return lists and is_list_of(result.get("kl_heads"), n_layer, heads)
