"""Fine-tuning's stages, the pipeline's last (finetune.py trains): the teacher's zero-shot accuracy
on each task's evaluation split, the learning-rate grid on the teacher (the paper's grids;
--finetune-lr skips a task's), then the teacher at each seed and each student at its own, one
stage per model x seed, a file per task, each saved under finetune/ with everything it depends
on. The sizes come from the profile (reproduce.py's PROFILES: finetune_train_limit,
finetune_epochs and finetune_batch; `default` about an hour for the GPT-2 stand-in on 2 CPU
cores, measured)."""

from pathlib import Path

import torch

from . import compute, data, store, task_train
from .finetune import Settings, accuracy, encode, fine_tune
from .run import is_list_of, is_number, valid_score
from .runner import PENDING

GRIDS = {  # the paper's grids, by teacher family
    "gpt2": (1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 5e-4),
    "neox": (1e-7, 5e-7, 1e-6, 5e-6, 1e-5, 5e-5),
}
PAPER_BATCH = {"gpt2": 128, "neox": 64}  # the paper's first sizes; see README "Fine-tuning"
LAST_EPOCH = ("mmlu",)  # one epoch, its accuracy reported
PREFIX = "fine-tuning "  # of each fine-tuning stage's name in the plan
GRID_STAGE = f"{PREFIX}teacher: grid"  # every grid point of every task, one stage
ZERO_STAGE = f"{PREFIX}teacher: zero-shot"  # the teacher on each evaluation split, before


def data_groups() -> list:
    """The data groups fine-tuning reads (downloaded only when a run fine-tunes)."""
    return [g for task in task_train.trainable_tasks() for g in task_train.groups(task)]


def unpinned() -> list:
    """The rows --finetune reads that the data registry lacks (task_train.unpinned of each)."""
    return [row for task in task_train.trainable_tasks() for row in task_train.unpinned(task)]


def settings_for(run, task: str, lr: float, seed: int) -> Settings:
    """The profile's sizes, MMLU's one epoch, --limit evaluation examples."""
    cfg = run.cfg
    batch = cfg.finetune_batch or PAPER_BATCH[run.teacher.config.family]
    epochs = 1 if task in LAST_EPOCH else cfg.finetune_epochs
    limits = dict(train_limit=cfg.finetune_train_limit, eval_limit=cfg.limit)
    return Settings(lr, epochs, batch, max(1, batch // 4), seed, **limits)


def stage_file(run, name: str, model_key, task: str, lr: float, seed: int) -> tuple:
    """(file, key) of one model's fine-tuning on one task, saved under finetune/ with everything
    it depends on: the model's own key, the task's data files, the settings, the tokenizer and
    the device; (None, None) while the model's key or the rate is pending."""
    if model_key is None or lr is None:
        return None, None
    s = settings_for(run, task, lr, seed)
    key = dict(model=model_key, task=task, settings=s.record(), **inputs_of(run, task))
    path = run.cfg.out / "finetune" / f"{name.replace('/', '-')}-{task}-lr{lr:g}-s{seed}.json"
    return path, key


def inputs_of(run, task: str) -> dict:
    """What every fine-tuning stage on `task` reads: its data files, the tokenizer, the device."""
    files = {f.path: run.inputs[f.path] for g in task_train.groups(task) for f in data.files(g)}
    return dict(data=files, tokenizer=run.inputs["tokenizer"], device=run.inputs["device"])


def encoded_split(run, task: str, split: str, limit) -> list:
    """The first `limit` examples of `task`'s "train" or "eval" split, encoded as scored."""
    examples = task_train.load_split(task, split, run.cfg.data, limit)
    return encode(run.tokenizer, examples)


def zero_shot(run, runner, task: str) -> dict:
    """{"acc", "n"} of the teacher on `task`'s fine-tuning evaluation split before any
    fine-tuning: what a fine-tuned teacher is read against (the same examples and scorer; WSC's
    split is SuperGLUE's, not the zero-shot table's WSC273)."""
    limit = run.cfg.limit
    key = dict(model=run.inputs["teacher"], task=task, eval_limit=limit, **inputs_of(run, task))
    path = run.cfg.out / "finetune" / f"teacher-{task}-zero-shot.json"

    def score():
        encoded = encoded_split(run, task, "eval", limit)
        with torch.no_grad():
            return dict(acc=accuracy(run.teacher, encoded), n=len(encoded))

    return runner.stage(ZERO_STAGE, path, key, score, {("zero-shot", task): 1}, valid_score)


def tuned(run, runner, stage: str, model, name: str, model_key, task: str, lr, seed: int):
    """One model's fine-tuning on one task (model() loads it), in its stage_file."""
    path, key = stage_file(run, name, model_key, task, lr, seed)

    def tune():
        s = settings_for(run, task, lr, seed)
        train = encoded_split(run, task, "train", s.train_limit)
        test = encoded_split(run, task, "eval", s.eval_limit)
        store.log(f"fine-tuning {name} on {task}: {len(train)} examples, lr {lr:g}, seed {seed}")
        what = f"fine-tuning {name} on {task}"
        return fine_tune(model(), train, test, s, Path(f"{path}.progress"), store.log, what=what)

    kind = "teacher" if name == "teacher" else "student"
    return runner.stage(stage, path, key, tune, {("fine-tune", task, kind): 1}, valid_tuning)


def valid_tuning(result) -> bool:
    """fine_tune's record: each epoch's accuracy, the reported one among them, each step's loss."""
    if not isinstance(result, dict) or not isinstance(result.get("epoch_acc"), list):
        return False
    accuracies, steps = result["epoch_acc"], result.get("steps")
    scores = bool(accuracies) and all(is_number(acc) and 0 <= acc <= 1 for acc in accuracies)
    losses = type(steps) is int and is_list_of(result.get("loss_curve"), steps, is_number)
    reported = result.get("acc") in accuracies and is_number(result.get("train_seconds"))
    return scores and losses and reported


def learning_rates(run, runner) -> dict:
    """{task: {"lr", "source", "grid"}}: --finetune-lr's rate, else the grid's best on the
    teacher (the grid seed; the smaller rate on a tie), each grid point's accuracy recorded;
    PENDING while a grid point is."""
    chosen, given = {}, dict(run.cfg.finetune_lr)
    teacher = lambda: run.teacher  # noqa: E731
    for task in task_train.trainable_tasks():
        if task in given:
            chosen[task] = dict(lr=given[task], source="--finetune-lr", grid=None)
            continue
        lrs, seed, key = GRIDS[run.teacher.config.family], run.grid_seed, run.inputs["teacher"]
        grid = [(GRID_STAGE, teacher, "teacher", key, task, lr, seed) for lr in lrs]
        found = {where[5]: tuned(run, runner, *where) for where in grid}
        if PENDING in found.values():
            chosen[task] = PENDING
            continue
        best = max(found, key=lambda lr: found[lr]["acc"])
        recorded = {f"{lr:g}": result["acc"] for lr, result in found.items()}
        chosen[task] = dict(lr=best, source="grid on the teacher", grid=recorded)
    return chosen


def models_to_tune(run, specs) -> list:
    """(plan stage, file name, label, seed, model(), model key) of each model fine-tuned after
    the grid, in run order: the teacher at each seed, then each student at its own; a student's
    label is its variant, loss and budget."""
    teacher = lambda: run.teacher  # noqa: E731
    key = run.inputs["teacher"]
    found = [
        (f"{PREFIX}teacher/s{s}", "teacher", "teacher", s, teacher, key) for s in run.cfg.seeds
    ]
    for spec in specs:
        label = f"{spec.variant}/{spec.loss}/b{spec.budget}"
        model = compute.loader(run, spec)
        found.append((PREFIX + spec.name, spec.name, label, spec.seed, model, spec.key))
    return found


def run_all(run, runner, specs) -> dict:
    """Every model fine-tuned on every task with a training split, at every seed, after the
    teacher's zero-shot accuracy on each evaluation split and the grid: {"lr": learning_rates,
    "models": {label: {seed: {task: fine_tune's record}}}, "zero_shot": {task: zero_shot's}};
    PENDING while any part is."""
    tasks = task_train.trainable_tasks()
    before = {task: zero_shot(run, runner, task) for task in tasks}
    rates, models = learning_rates(run, runner), {}
    lr = {t: None if rates[t] is PENDING else rates[t]["lr"] for t in tasks}
    found = [*before.values(), *rates.values()]
    for stage, name, label, seed, model, key in models_to_tune(run, specs):
        by_task = {t: tuned(run, runner, stage, model, name, key, t, lr[t], seed) for t in tasks}
        models.setdefault(label, {})[str(seed)] = by_task
        found += by_task.values()
    return PENDING if PENDING in found else dict(lr=rates, models=models, zero_shot=before)
