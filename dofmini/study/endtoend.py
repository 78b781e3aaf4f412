"""End-to-end error: how far a student's next-token distribution is from the teacher's, KL(teacher
‖ student) per token on held-out windows, and what each layer alone costs end to end (the teacher
with one layer's attention swapped for a Fix student's). The layerwise errors feed each layer the
teacher's own inputs, so they cannot weigh how a layer's error grows through the layers after it.

Held-out windows, in order: the layer errors' (error_windows), the error curves' (curve_windows),
the students' end-to-end KL (e2e_windows), then the swap curves' (e2e_windows), so the end-to-end
oracle chosen on the swap curves is scored on windows it never saw."""

import copy
import math
from functools import partial

import torch
from torch import nn

from ..students import load_student
from . import runs, stages
from .evaluate import held_out
from .keys import is_list_of, is_number
from .oracle import seed_mean_oracle
from .progress import Progress

SWAP_STAGE = "end-to-end swap curves"  # its name in the plan


@torch.no_grad()
def window_kl(teacher, models, token_ids, ctx, windows, offset=0, batch=4) -> list:
    """For each of `models`, [W] the mean over each window's tokens of KL(p_teacher ‖ p_model)
    of the next-token distributions, on `windows` windows of ctx tokens from window `offset` on;
    the teacher runs once per batch for all of them. Per window, so an interval can resample
    the text (stats.window_bootstrap)."""
    all_windows = held_out(teacher, token_ids, ctx, windows, offset, "e2e_kl")  # [W, ctx]
    found = [[] for _ in models]
    what = f"end-to-end KL of {len(models)} model(s)"
    with Progress(what, windows, "windows") as progress:
        for ids in all_windows.split(batch):  # [b, ctx]
            target = teacher(ids).float().log_softmax(-1)  # [b, ctx, V]
            p = target.exp()  # [b, ctx, V] once per batch, shared by every model
            for i, model in enumerate(models):
                log_q = model(ids).float().log_softmax(-1)  # [b, ctx, V]
                token_kl = (p * (target - log_q)).sum(-1)  # [b, ctx]
                found[i] += (token_kl.double().sum(-1) / ctx).tolist()
            progress.update(len(ids))
    return found


def e2e_kl(teacher, models, token_ids, ctx, windows, offset=0, batch=4) -> list:
    """For each of `models`, window_kl's mean over the windows: the mean token KL (every window
    has ctx tokens)."""
    per_window = window_kl(teacher, models, token_ids, ctx, windows, offset, batch)
    return [math.fsum(values) / len(values) for values in per_window]


def swapped(teacher, student, layer: int):
    """The teacher with only block `layer` taken from `student` (its attention the student's, its
    other tensors shared with the teacher): a shallow copy with its own block list, so the teacher
    itself is left as it was."""
    model = copy.copy(teacher)
    model._modules = dict(teacher._modules)  # the copy's own table, or setting blocks edits both
    blocks = list(teacher.blocks)
    blocks[layer] = student.blocks[layer]
    model.blocks = nn.ModuleList(blocks)
    return model


def offsets(run) -> tuple:
    """(first window, windows) of the students' end-to-end KL and of the swap curves."""
    start = run.cfg.error_windows + run.cfg.curve_windows
    count = run.cfg.e2e_windows
    return (start, count), (start + count, count)


def stage_file(run, spec, swap: bool = False) -> tuple:
    """(file, key, validator) of a student's end-to-end KL (its mean and each window's), or with
    `swap` of its one-layer swaps (one mean per layer)."""
    windows = offsets(run)[swap]
    key = {"student": stages.train_key(run, spec), **stages.eval_key(run), "e2e": windows}
    path = run.cfg.out / "eval" / f"{spec.stem}-{'swap' if swap else 'e2e'}.json"
    if swap:
        n_layer = run.teacher.config.n_layer
        return path, key, partial(is_list_of, count=n_layer, valid=is_number)
    key["per_window"] = True  # its result holds each window's KL; files made before are redone
    return path, key, partial(valid_windows, count=windows[1])


def valid_windows(result, count: int) -> bool:
    """student_kl's result: the mean and each of the `count` windows' KL."""
    windows = isinstance(result, dict) and result.get("windows")
    return is_number(result.get("e2e_kl")) and is_list_of(windows, count, is_number)


def student_kl(run, spec, swap: bool = False):
    """A trained student's end-to-end KL (eval/<student>-e2e.json: {"e2e_kl": mean, "windows":
    [W] each window's}), or with `swap` the teacher's with each one of its layers swapped for the
    student's (a list of means, eval/<student>-swap.json)."""
    offset, count = offsets(run)[swap]

    def compute():
        student, _ = load_student(run.teacher, spec.path(run.cfg.out))
        layers = range(run.teacher.config.n_layer)
        if swap:
            models = [swapped(run.teacher, student, i) for i in layers]
            return e2e_kl(run.teacher, models, run.texts["heldout"], run.ctx, count, offset)
        found = window_kl(run.teacher, [student], run.texts["heldout"], run.ctx, count, offset)
        return {"e2e_kl": math.fsum(found[0]) / count, "windows": found[0]}

    path, key, valid = stage_file(run, spec, swap)
    return runs.stage(path, key, compute, valid=valid)


def evaluate(run, spec, together=()) -> dict:
    """stages.train_and_evaluate (`together` its), with the student's end-to-end KL."""
    result = stages.train_and_evaluate(run, spec, together)
    found = student_kl(run, spec)
    result.update(e2e_kl=found["e2e_kl"], e2e_kl_windows=found["windows"])
    runs.log(f"{spec.name}: end-to-end KL {found['e2e_kl']:.4g}")
    return result


def swap_curves(run, saved_only: bool = False):
    """Each layer's end-to-end KL with only that layer swapped for the Fix curve student's at each
    of curve_dims, every seed; their seed means ("mean_kl" [L][M]) and the end-to-end oracle dims
    at each budget (the exact DP of oracle_allocate on those means). `saved_only`: from the saved
    swaps alone, None while one is missing (the plan's "done" marks)."""
    if not saved_only:
        run.clock.begin(SWAP_STAGE)
    kl = {}
    for spec in stages.curve_specs(run):
        file_and_key = stage_file(run, spec, swap=True)
        found = runs.saved(*file_and_key) if saved_only else student_kl(run, spec, swap=True)
        if found is None:
            return None
        kl.setdefault(str(spec.seed), []).append(found)  # [M][layer]
    found = seed_mean_oracle(kl, run.cfg.curve_dims, run.budgets)
    return dict(found, windows=list(offsets(run)[1]))


def evaluate_students(run, allocation: dict, curves) -> tuple:
    """(every student's result in plan order, the curves with the swap curves under "e2e").
    Evaluated cheapest and most telling first: the students already trained, then the swap
    curves, then the end-to-end oracle's students, then the rest variant by variant; returned in
    plan order, so a resumed run's report reads as an uninterrupted one's."""
    done = lambda spec: stages.trained(spec.path(run.cfg.out), stages.train_key(run, spec), False)
    ready = [spec for spec in stages.specs(run, allocation, curves) if spec.dims and done(spec)]
    results = {spec.name: evaluate(run, spec) for spec in ready}
    if "oracle_e2e" in run.cfg.variants:
        curves = {**curves, "e2e": swap_curves(run)}
    planned = stages.specs(run, allocation, curves)  # every student, the oracles' dims known
    rest = [spec for spec in planned if spec.name not in results]
    # one variant's seeds and budgets together, so a run cut short leaves whole variants
    order = {v: i for i, v in enumerate(dict.fromkeys(spec.variant for spec in rest))}
    rest.sort(key=lambda spec: (spec.variant != "oracle_e2e", order[spec.variant]))
    results.update({spec.name: evaluate(run, spec, rest) for spec in rest})
    return {spec.name: results[spec.name] for spec in planned}, curves
