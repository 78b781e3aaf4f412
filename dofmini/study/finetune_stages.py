"""Fine-tuning's stages, the pipeline's last (finetune.py trains): the teacher's zero-shot accuracy
on each task's evaluation split, the learning-rate grid on the teacher (the paper's grids, each
rate scored on the selection split; --finetune-lr skips a task's), then the teacher at each seed
and each student at its own, one stage per model x seed, a file per task, each saved under
finetune/ with everything it depends on. The sizes come from the profile (reproduce.py's
PROFILES: finetune_train_limit, finetune_select, finetune_epochs and finetune_batch; `default`
about an hour for the GPT-2 stand-in on 2 CPU cores, measured before the selection split)."""

import random
from pathlib import Path

import torch

from . import compute, data, store, task_train
from .finetune import Settings, correct, encode, fine_tune
from .run import is_list_of, is_number, is_share, valid_score
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
SELECTION_SEED = 55  # random.Random's, drawing each task's selection split (issue 55) once


def data_groups() -> list:
    """The data groups fine-tuning reads (downloaded only when a run fine-tunes)."""
    return [g for task in task_train.trainable_tasks() for g in task_train.groups(task)]


def unpinned() -> list:
    """The rows --finetune reads that the data registry lacks (task_train.unpinned of each)."""
    return [row for task in task_train.trainable_tasks() for row in task_train.unpinned(task)]


def settings_for(run, task: str, lr: float, seed: int) -> Settings:
    """The profile's sizes, MMLU's one epoch, --limit evaluation examples, the selection split."""
    cfg = run.cfg
    batch = cfg.finetune_batch or PAPER_BATCH[run.teacher.config.family]
    epochs = 1 if task in LAST_EPOCH else cfg.finetune_epochs
    limits = dict(train_limit=cfg.finetune_train_limit, eval_limit=cfg.limit)
    selection = dict(select_size=cfg.finetune_select, select_seed=SELECTION_SEED)
    return Settings(lr, epochs, batch, max(1, batch // 4), seed, **limits, **selection)


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


def evaluation_split(run, task: str, limit) -> tuple:
    """(ids, examples): the first `limit` of `task`'s evaluation split, an id "eval:<position>"."""
    examples = task_train.load_split(task, "eval", run.cfg.data, limit)
    return [f"eval:{i}" for i in range(len(examples))], examples


def splits(run, task: str, s: Settings) -> dict:
    """{"train", "select", "eval"}: (ids, examples) of a fine-tuning on `task` with settings `s`.
    The selection split: s.select_size of the training examples drawn by
    random.Random(s.select_seed), the same for every model and seed; trained on: the first
    s.train_limit of the others; scored and reported: evaluation_split. A training example's id is
    "train:<position in the training split>". A RunError where no training example would be left."""
    pool = task_train.load_split(task, "train", run.cfg.data)
    if not 0 < s.select_size < len(pool):
        most = f"expected 1 to {len(pool) - 1}, leaving one or more to train on"
        raise store.RunError(f"--finetune-select {s.select_size}: {task} has {len(pool)} "
                             f"training examples; {most}")  # fmt: skip
    chosen = sorted(random.Random(s.select_seed).sample(range(len(pool)), s.select_size))
    others = sorted(set(range(len(pool))) - set(chosen))[: s.train_limit]
    drawn = {"train": others, "select": chosen}
    found = {
        name: ([f"train:{i}" for i in at], [pool[i] for i in at]) for name, at in drawn.items()
    }
    return dict(found, eval=evaluation_split(run, task, s.eval_limit))


def zero_shot(run, runner, task: str) -> dict:
    """{"acc", "n", "correct" (0/1 per example), "ids"} of the teacher on `task`'s fine-tuning
    evaluation split before any fine-tuning: what a fine-tuned model is read against, example by
    example (the same examples and scorer; WSC's split is SuperGLUE's, not the zero-shot table's
    WSC273). A saved result without "correct" (of an older version) is made again."""
    limit = run.cfg.limit
    key = dict(model=run.inputs["teacher"], task=task, eval_limit=limit, **inputs_of(run, task))
    path = run.cfg.out / "finetune" / f"teacher-{task}-zero-shot.json"

    def score():
        ids, examples = evaluation_split(run, task, limit)
        with torch.no_grad():
            hits = correct(run.teacher, encode(run.tokenizer, examples))
        return dict(acc=sum(hits) / len(hits), n=len(hits), correct=hits, ids=ids)

    work = {("zero-shot", task): 1}
    return runner.stage(ZERO_STAGE, path, key, score, work, valid_zero_shot)


def tuned(run, runner, stage: str, model, name: str, model_key, task: str, lr, seed: int):
    """One model's fine-tuning on one task (model() loads it), in its stage_file."""
    path, key = stage_file(run, name, model_key, task, lr, seed)

    def tune():
        s = settings_for(run, task, lr, seed)
        found = splits(run, task, s)
        train, select, test = (
            encode(run.tokenizer, found[k][1]) for k in ("train", "select", "eval")
        )
        counts = f"{len(train)} examples, {len(select)} to select by"
        store.log(f"fine-tuning {name} on {task}: {counts}, lr {lr:g}, seed {seed}")
        progress, what = Path(f"{path}.progress"), f"fine-tuning {name} on {task}"
        record = fine_tune(model(), train, select, test, s, progress, store.log, what=what)
        return dict(record, ids=found["eval"][0], select_ids=found["select"][0])

    kind = "teacher" if name == "teacher" else "student"
    return runner.stage(stage, path, key, tune, {("fine-tune", task, kind): 1}, valid_tuning)


def is_scored(result) -> bool:
    """Each reported example's 0/1 with its id, their mean the accuracy."""
    hits, ids = result.get("correct"), result.get("ids")
    each = isinstance(hits, list) and is_list_of(hits, len(ids or ()), lambda hit: hit in (0, 1))
    return each and bool(hits) and result.get("acc") == sum(hits) / len(hits)


def valid_zero_shot(result) -> bool:
    """zero_shot's record: valid_score's accuracy of n examples, each scored (is_scored)."""
    return valid_score(result) and is_scored(result) and result["n"] == len(result["correct"])


def valid_tuning(result) -> bool:
    """fine_tune's record: each epoch's selection accuracy, the chosen epoch's among them, its
    evaluation examples scored (is_scored), each step's loss."""
    if not isinstance(result, dict) or not isinstance(result.get("select_acc"), list):
        return False
    accuracies, steps, epoch = result["select_acc"], result.get("steps"), result.get("epoch")
    chosen = type(epoch) is int and 1 <= epoch <= len(accuracies)
    chosen = chosen and all(map(is_share, accuracies)) and result.get("select") in accuracies
    losses = type(steps) is int and is_list_of(result.get("loss_curve"), steps, is_number)
    return chosen and losses and is_scored(result) and is_number(result.get("train_seconds"))


def learning_rates(run, runner) -> dict:
    """{task: {"lr", "source", "grid", "train_seconds"}}: --finetune-lr's rate, else the grid's
    best on the teacher by the selection split's acc at its chosen epoch (the grid seed; the
    smaller rate on a tie), each grid point's selection acc recorded, and the grid's training
    seconds (0 for a rate given); PENDING while a grid point is."""
    chosen, given = {}, dict(run.cfg.finetune_lr)
    teacher = lambda: run.teacher  # noqa: E731
    for task in task_train.trainable_tasks():
        if task in given:
            chosen[task] = dict(
                lr=given[task], source="--finetune-lr", grid=None, train_seconds=0.0
            )
            continue
        lrs, seed, key = GRIDS[run.teacher.config.family], run.grid_seed, run.inputs["teacher"]
        grid = [(GRID_STAGE, teacher, "teacher", key, task, lr, seed) for lr in lrs]
        found = {where[5]: tuned(run, runner, *where) for where in grid}
        if PENDING in found.values():
            chosen[task] = PENDING
            continue
        best = max(found, key=lambda lr: found[lr]["select"])
        recorded = {f"{lr:g}": result["select"] for lr, result in found.items()}
        seconds = sum(result["train_seconds"] for result in found.values())
        chosen[task] = dict(
            lr=best, source="grid on the teacher", grid=recorded, train_seconds=seconds
        )
    return chosen


def train_seconds(tuned: dict) -> float:
    """What run_all's fine-tunings took to train, the grid's included."""
    grid = [rate["train_seconds"] for rate in tuned["lr"].values()]
    by_model = [record for seeds in tuned["models"].values() for tasks in seeds.values()
                for record in tasks.values()]  # fmt: skip
    return sum(grid) + sum(record["train_seconds"] for record in by_model)


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
    "models": {label: {seed: {task: fine_tune's record}}}, "zero_shot": {task: zero_shot's},
    "selection": its seed and size}; PENDING while any part is."""
    tasks = task_train.trainable_tasks()
    before = {task: zero_shot(run, runner, task) for task in tasks}
    rates, models = learning_rates(run, runner), {}
    lr = {t: None if rates[t] is PENDING else rates[t]["lr"] for t in tasks}
    found = [*before.values(), *rates.values()]
    for stage, name, label, seed, model, key in models_to_tune(run, specs):
        by_task = {t: tuned(run, runner, stage, model, name, key, t, lr[t], seed) for t in tasks}
        models.setdefault(label, {})[str(seed)] = by_task
        found += by_task.values()
    if PENDING in found:
        return PENDING
    selection = dict(seed=SELECTION_SEED, size=run.cfg.finetune_select)
    return dict(lr=rates, models=models, zero_shot=before, selection=selection)
