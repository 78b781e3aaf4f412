"""End-to-end error: how far a student's next-token distribution is from the teacher's, KL(teacher
‖ student) per token on held-out windows, and what each layer alone costs end to end (the teacher
with one layer's attention swapped for a Fix student's). The layerwise errors feed each layer the
teacher's own inputs, so they cannot weigh how a layer's error grows through the layers after it.

Which held-out windows each measures: run.Run.windows."""

import copy
import math

import torch
from torch import nn

from .evaluate import held_out
from .progress import Progress
from .run import has_fields, is_list_of, is_number


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


def student_kl(run, student) -> dict:
    """A trained student's end-to-end KL on its role's windows (Run.windows["e2e"]): {"e2e_kl":
    mean, "windows": [W] each window's}."""
    count = len(run.windows["e2e"])
    found = window_kl(run.teacher, [student], run.window_ids("e2e"), run.ctx, count)
    return {"e2e_kl": math.fsum(found[0]) / count, "windows": found[0]}


def valid_student_kl(run, result) -> bool:
    """student_kl's shape, checked before a saved one is reused: the mean and each window's KL."""
    windows = lambda v: is_list_of(v, len(run.windows["e2e"]), is_number)  # noqa: E731
    return has_fields(result, ("e2e_kl",), is_number) and has_fields(result, ("windows",), windows)


def swap_kl(run, student) -> list:
    """The teacher's end-to-end KL with each one of its layers swapped for `student`'s: a mean a
    layer, on the swap curves' windows (Run.windows["swaps"])."""
    models = [swapped(run.teacher, student, i) for i in range(run.teacher.config.n_layer)]
    count = len(run.windows["swaps"])
    return e2e_kl(run.teacher, models, run.window_ids("swaps"), run.ctx, count)


def valid_swap_kl(run, result) -> bool:
    """swap_kl's shape, checked before a saved one is reused: one mean a layer."""
    return is_list_of(result, run.teacher.config.n_layer, is_number)
