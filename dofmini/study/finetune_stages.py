"""Fine-tuning's stages (finetune.py trains): the teacher's zero-shot accuracy on each task's
evaluation split, the learning-rate grid on the teacher (the paper's grids; --finetune-lr skips a
task's), then the teacher at each seed and each student at its own, one stage per model x task x
seed, each saved under finetune/ with everything it depends on. The sizes come from the profile
(PROFILES: `default` about an hour for the GPT-2 stand-in on 2 CPU cores, measured)."""

from pathlib import Path

import torch

from . import data, runs, stages, task_train
from .finetune import Settings, accuracy, encode, fine_tune

GRIDS = {  # the paper's grids, by teacher family
    "gpt2": (1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 5e-4),
    "neox": (1e-7, 5e-7, 1e-6, 5e-6, 1e-5, 5e-5),
}
PAPER_BATCH = {"gpt2": 128, "neox": 64}  # the paper's first sizes; see README "Fine-tuning"
# per reproduce.py profile: training examples per task (None: all), epochs, examples a step
PROFILES = {
    "quick": dict(train_limit=8, epochs=1, batch=4),
    "default": dict(train_limit=64, epochs=3, batch=16),  # the stand-in's in about an hour
    "study": dict(train_limit=256, epochs=3, batch=16),
    "paper": dict(train_limit=None, epochs=3, batch=None),
}
LAST_EPOCH = ("mmlu",)  # one epoch, its accuracy reported
PREFIX = "fine-tuning "  # of each fine-tuning stage's name in the plan
GRID_STAGE = f"{PREFIX}teacher: grid"  # every grid point of every task, one stage
ZERO_STAGE = f"{PREFIX}teacher: zero-shot"  # the teacher on each evaluation split, before


def data_groups() -> list:
    """The data groups fine-tuning reads (downloaded only when a run fine-tunes)."""
    return [g for task in task_train.trainable_tasks() for g in task_train.groups(task)]


def settings_for(run, task: str, lr: float, seed: int) -> Settings:
    """The run's profile's sizes (PROFILES), MMLU's one epoch, --limit evaluation examples."""
    sizes = dict(PROFILES[run.cfg.profile])
    batch = sizes.pop("batch") or PAPER_BATCH[run.teacher.config.family]
    epochs = 1 if task in LAST_EPOCH else sizes.pop("epochs")
    limits = dict(train_limit=sizes["train_limit"], eval_limit=run.cfg.limit)
    return Settings(lr, epochs, batch, max(1, batch // 4), seed, **limits)


def stage_file(run, name: str, model_key, task: str, lr: float, seed: int) -> tuple:
    """(file, key) of one model's fine-tuning on one task, saved under finetune/ with everything
    it depends on: the model's own key, the task's data files, the settings, the tokenizer and
    the device."""
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


def zero_shot_file(run, task: str) -> tuple:
    """(file, key) of the teacher's accuracy on `task`'s fine-tuning evaluation split before any
    fine-tuning: what a fine-tuned teacher is read against (the same examples and scorer; WSC's
    split is SuperGLUE's, not the zero-shot table's WSC273)."""
    limit = run.cfg.limit
    key = dict(model=run.inputs["teacher"], task=task, eval_limit=limit, **inputs_of(run, task))
    return run.cfg.out / "finetune" / f"teacher-{task}-zero-shot.json", key


def zero_shot(run, task: str) -> dict:
    """{"acc", "n"} of the teacher on `task`'s evaluation split, in its zero_shot_file."""

    def compute():
        encoded = encoded_split(run, task, "eval", run.cfg.limit)
        with torch.no_grad():
            return dict(acc=accuracy(run.teacher, encoded), n=len(encoded))

    return runs.stage(*zero_shot_file(run, task), compute)


def stage(run, model, name: str, model_key, task: str, lr: float, seed: int) -> dict:
    """One model's fine-tuning on one task, in its stage_file."""
    s = settings_for(run, task, lr, seed)
    path, key = stage_file(run, name, model_key, task, lr, seed)

    def compute():
        train = encoded_split(run, task, "train", s.train_limit)
        test = encoded_split(run, task, "eval", s.eval_limit)
        runs.log(f"fine-tuning {name} on {task}: {len(train)} examples, lr {lr:g}, seed {seed}")
        what = f"fine-tuning {name} on {task}"
        return fine_tune(model, train, test, s, Path(f"{path}.progress"), runs.log, what=what)

    return runs.stage(path, key, compute)


def grid(run, task: str) -> list:
    """stage_file's (name, model key, task, lr, seed) of each of the teacher's grid points on
    `task` (first seed); none where --finetune-lr gives its rate."""
    if task in dict(run.cfg.finetune_lr):
        return []
    lrs, seed = GRIDS[run.teacher.config.family], run.cfg.seeds[0]
    return [("teacher", run.inputs["teacher"], task, lr, seed) for lr in lrs]


def learning_rates(run, saved_only: bool = False) -> dict:
    """{task: {"lr", "source", "grid"}}: --finetune-lr's rate, else the grid's best on the
    teacher (first seed; the smaller rate on a tie), each grid point's accuracy recorded. With
    `saved_only`, from the saved grid points without fine-tuning, a task None while one is
    missing."""
    chosen = {}
    for task in task_train.trainable_tasks():
        points = grid(run, task)
        if not points:
            given = dict(run.cfg.finetune_lr)[task]
            chosen[task] = dict(lr=given, source="--finetune-lr", grid=None)
            continue
        if saved_only:
            found = {where[3]: runs.saved(*stage_file(run, *where)) for where in points}
        else:
            run.clock.begin(GRID_STAGE)
            found = {where[3]: stage(run, run.teacher, *where) for where in points}
        if None in found.values():
            chosen[task] = None
            continue
        best = max(found, key=lambda lr: found[lr]["acc"])
        recorded = {f"{lr:g}": result["acc"] for lr, result in found.items()}
        chosen[task] = dict(lr=best, source="grid on the teacher", grid=recorded)
    return chosen


def models_of(run, specs) -> list:
    """(plan stage name, stage_file's name, seed, stages.Student or None: the teacher) of each
    model fine-tuned after the grid, in run order: the teacher at each seed, then each student."""
    teacher = [(f"{PREFIX}teacher/s{seed}", "teacher", seed, None) for seed in run.cfg.seeds]
    return teacher + [(PREFIX + spec.name, spec.name, spec.seed, spec) for spec in specs]


def model_key(run, spec):
    """The key of the model fine-tuned: the teacher's (spec None), a student's; None while the
    student's dims are unknown."""
    if spec is None:
        return run.inputs["teacher"]
    return stages.train_key(run, spec) if spec.dims else None


def run_all(run, specs) -> dict:
    """Every model fine-tuned on every task with a training split, at every seed: the teacher
    once per seed, each student (stages.Student) at its own seed, after the teacher's zero-shot
    accuracy on each evaluation split. {"lr": learning_rates, "models": {label: {seed: {task:
    fine_tune's record}}}, "zero_shot": {task: zero_shot's}}, a student's label its name less
    seed."""
    tasks = task_train.trainable_tasks()
    run.clock.begin(ZERO_STAGE)
    before = {task: zero_shot(run, task) for task in tasks}
    rates, models = learning_rates(run), {}
    for stage_name, name, seed, spec in models_of(run, specs):
        model = run.teacher if spec is None else stages.train_student(run, spec)[0]
        key = model_key(run, spec)
        run.clock.begin(stage_name)
        by_task = {t: stage(run, model, name, key, t, rates[t]["lr"], seed) for t in tasks}
        models.setdefault(name.rsplit("/s", 1)[0], {})[str(seed)] = by_task
    return dict(lr=rates, models=models, zero_shot=before)
