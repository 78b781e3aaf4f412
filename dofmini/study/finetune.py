"""Fine-tuning, as the paper's Tables 3 and 6 score its models: every parameter of a model (the
teacher's own copy, or a student: its PRF features and every weight it shares with the teacher)
trained on a task's training examples (task_train.py); after each epoch the accuracy on a
selection split held out of the training examples and each evaluation example's correctness; the
epoch the selection split scores best is chosen (MMLU: its one epoch), and the evaluation split's
correctness at it reported, never used to choose. Objective: cross-entropy over the
choices' summed continuation log-likelihoods, the zero-shot scorer's framing, so acc scores
exactly what is trained. AdamW (β 0.9, 0.999, weight decay 0.01), the rate falling linearly from
its value to 0 over all steps, no warm-up. Learning rates: a grid searched on the teacher, the
best on the selection split reused for every student (the paper's procedure), or --finetune-lr
TASK=LR,... ("paper": its Table 8 rates for GPT-2); finetune_stages.py runs them. Resumable
mid-epoch."""

import copy
import dataclasses
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checks import not_integers, not_positive
from . import evaluate, store, task_train
from .progress import Progress

TASKS = task_train.TASKS  # Table 3's columns
PAPER_LR = {  # Table 8, GPT-2: each task's rate chosen on the original model
    "piqa": 1e-4, "logiqa": 5e-5, "arc_easy": 1e-4, "arc_challenge": 1e-5,
    "winogrande": 5e-4, "mmlu": 1e-6, "wsc": 1e-6,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Settings:
    """One fine-tuning: `epochs` passes over the first `train_limit` training examples outside
    the selection split in a seeded order, `batch` a step, back-propagated `part` at a time
    (gradient accumulation: the same step for any part); progress saved every `save_every` steps
    and at each epoch's end. The stages draw the selection split, `select_size` training examples,
    by random.Random(select_seed) (finetune_stages.splits); fine_tune is given the examples."""

    lr: float
    epochs: int = 3
    batch: int = 16
    part: int = 4
    seed: int = 0
    train_limit: int | None = None
    eval_limit: int | None = None
    select_size: int | None = None
    select_seed: int | None = None
    save_every: int = 20

    def record(self) -> dict:
        return {
            k: v for k, v in dataclasses.asdict(self).items() if k not in ("part", "save_every")
        }


def parse_lr(text: str) -> tuple:
    """((task, rate), ...) of "TASK=LR,..." or of "paper" (PAPER_LR); a ValueError names the bad
    part: an unknown task, a task twice, a rate that is not a positive finite number."""
    if text == "paper":
        return tuple(PAPER_LR.items())
    found = {}
    for item in text.split(","):
        task, _, rate = item.partition("=")
        if task not in TASKS or task in found:
            seen = "given twice" if task in found else f"expected a task of {', '.join(TASKS)}"
            raise ValueError(f"{item!r}: {seen}, as TASK=LR (or 'paper')")
        try:
            found[task] = float(rate)
        except ValueError:
            found[task] = math.nan
        if not (found[task] > 0 and math.isfinite(found[task])):
            raise ValueError(f"{item!r}: expected a positive finite learning rate after '='")
    return tuple(found.items())


def encode(tokenizer, examples) -> list:
    """[(choices [(context ids, continuation ids)], label)] as the zero-shot scorer encodes."""
    texts = sorted({s for e in examples for s in (*e.contexts, *e.continuations)})
    found = tokenizer.encode_batch(texts, add_special_tokens=False)
    ids = dict(zip(texts, (e.ids for e in found)))
    pairs = [list(zip(e.contexts, e.continuations)) for e in examples]
    return [([(ids[c], ids[x]) for c, x in p], e.label) for p, e in zip(pairs, examples)]


def choice_scores(model, pairs) -> torch.Tensor:
    """Summed log-likelihood [len(pairs)] of each (context, continuation) pair, with gradients;
    inputs cut from the left to the model's context as evaluate.score_requests cuts them."""
    n_ctx, device = model.config.n_ctx, next(model.parameters()).device
    rows = [(list(c) + list(x))[:-1][-n_ctx:] for c, x in pairs]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)  # [n, T] right-padded
    keep = torch.zeros_like(ids, dtype=torch.bool)  # [n, T] the positions that predict a target
    for i, (row, (_, x)) in enumerate(zip(rows, pairs)):
        ids[i, : len(row)] = torch.tensor(row)
        keep[i, len(row) - len(x) : len(row)] = True
    logprobs = model(ids.to(device), keep=keep.to(device)).float().log_softmax(-1)  # [N, V]
    targets = torch.tensor([t for _, x in pairs for t in x], device=device)  # [N] row-major
    lengths = torch.tensor([len(x) for _, x in pairs])
    owner = torch.repeat_interleave(torch.arange(len(pairs)), lengths).to(device)  # [N]
    token_ll = logprobs.gather(1, targets[:, None])[:, 0]  # [N]
    return torch.zeros(len(pairs), device=device).index_add(0, owner, token_ll)


def loss(model, batch) -> torch.Tensor:
    """Summed cross-entropy over each example's choices (their counts may differ)."""
    scores = choice_scores(model, [pair for choices, _ in batch for pair in choices])
    total, start = scores.new_zeros(()), 0
    for choices, label in batch:
        logits = scores[start : start + len(choices)]
        total = total + F.cross_entropy(logits[None], torch.tensor([label], device=logits.device))
        start += len(choices)
    return total


def not_encoded(encoded, name: str, config) -> str:
    """Why the encoded examples `encoded` (named `name`) cannot be scored or trained on by a model
    of `config`: none, or the first whose label names none of its choices or whose choices
    evaluate.score_requests refuses; or ""."""
    if not encoded:
        return f"{name} is empty; expected encoded examples"
    for i, (choices, label) in enumerate(encoded):
        unscored = evaluate.not_requests(choices, config, "choices")
        why = evaluate.not_label(label, len(choices)) or unscored
        if why:
            return f"{name}[{i}]: {why}"
    return ""


def correct(model, encoded) -> list:
    """Per example, 1 where its gold choice has the highest summed log-likelihood, else 0."""
    if why := not_encoded(encoded, "encoded", model.config):  # raised here, the frame called
        raise ValueError(f"correct: {why}")
    pairs = [pair for choices, _ in encoded for pair in choices]
    scores = evaluate.score_requests(model, pairs, what="fine-tuned")
    start = 0
    hits = []
    for choices, label in encoded:
        ll = [s for s, _ in scores[start : start + len(choices)]]
        hits.append(int(max(range(len(ll)), key=ll.__getitem__) == label))
        start += len(choices)
    return hits


def accuracy(model, encoded) -> float:
    """Share of examples whose gold choice has the highest summed log-likelihood (acc)."""
    if why := not_encoded(encoded, "encoded", model.config):
        raise ValueError(f"accuracy: {why}")
    hits = correct(model, encoded)
    return sum(hits) / len(hits)


def trainable(model, lr: float) -> tuple:
    """(a copy of `model` whose every tensor trains, its AdamW at `lr`)."""
    model = copy.deepcopy(model).requires_grad_(True)  # its own tensors: every one trains
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    return model, opt


def train_step(model, opt, chosen: list, part: int) -> float:
    """One optimiser step on the encoded examples `chosen`, back-propagated `part` at a time
    (gradient accumulation); its loss."""
    opt.zero_grad()
    step_loss = 0.0
    for start in range(0, len(chosen), part):
        part_loss = loss(model, chosen[start : start + part]) / len(chosen)
        part_loss.backward()
        step_loss += part_loss.item()
    opt.step()
    return step_loss


def fine_tune(
    model, train, select, test, settings: Settings, progress: Path, log, on_step=None,
    what="fine-tuning",
) -> dict:  # fmt: skip
    """Fine-tune a copy of `model` on the encoded `train` examples, scoring `select` and `test`
    after each epoch; {"select_acc" (each epoch's on `select`), "epoch" (from 1: the first whose
    select_acc is the highest), "select" (its select_acc), "correct" (its 0/1 on each `test`
    example), "acc" (their mean), "examples" (how many trained, select, test), "steps",
    "train_seconds", "loss_curve"}: `test` chooses nothing. Progress goes to `progress` and a
    run of the same settings resumes from it exactly (tensors, AdamW, the step, the curves);
    on_step(step) after each; a progress line (progress.Progress) names it `what`."""
    s, n = settings, len(train)
    sizes = {f"settings.{k}": getattr(s, k) for k in ("epochs", "batch", "part", "save_every")}
    data = (
        not_encoded(train, "train", model.config)
        or not_encoded(select, "select", model.config)
        or not_encoded(test, "test", model.config)
    )
    why = (
        not_integers("fine_tune", **sizes)
        or not_integers("fine_tune", 0, **{"settings.seed": s.seed})
        or not_positive("fine_tune", **{"settings.lr": s.lr})
        or (data and f"fine_tune: {data}")
    )
    if why:
        raise ValueError(why)
    model, opt = trainable(model, s.lr)
    params = dict(model.named_parameters())
    per_epoch = -(-n // s.batch)
    total = per_epoch * s.epochs
    counts = dict(train=n, select=len(select), test=len(test))
    keep = {**s.record(), "examples": counts}
    state = dict(step=0, seconds=0.0, loss_curve=[], select_acc=[], epoch_correct=[])
    if meta := store.load_progress(progress, keep, params, opt, log):
        state.update({k: meta[k] for k in state})
        log(f"resuming from {progress} at step {state['step']}")
    resumed = f" (resumed at step {state['step']} of {total})" if state["step"] else ""
    with Progress(f"{what}{resumed}", total - state["step"], "steps") as shown:
        while state["step"] < total:
            started = time.time()
            epoch, index = divmod(state["step"], per_epoch)
            shuffle = torch.Generator().manual_seed(s.seed * 1000 + epoch)
            order = torch.randperm(n, generator=shuffle)
            for group in opt.param_groups:
                group["lr"] = s.lr * (1 - state["step"] / total)
            chosen = [train[i] for i in order[index * s.batch : (index + 1) * s.batch].tolist()]
            step_loss = train_step(model, opt, chosen, s.part)
            state["step"] += 1
            state["loss_curve"].append(step_loss)
            if state["step"] % per_epoch == 0:
                with torch.no_grad():
                    state["select_acc"].append(accuracy(model, select))
                    state["epoch_correct"].append(correct(model, test))
                log(f"  epoch {epoch + 1}/{s.epochs}: selection acc {state['select_acc'][-1]:.4f}")
            state["seconds"] += time.time() - started
            if state["step"] < total and (state["step"] % min(s.save_every, per_epoch) == 0):
                store.save_progress(progress, {"settings": keep, **state}, params, opt)
            shown.update(1)
            if on_step:
                on_step(state["step"])
    progress.unlink(missing_ok=True)
    chosen_by = state["select_acc"]
    best = max(range(len(chosen_by)), key=chosen_by.__getitem__)  # one epoch: it, the last
    hits = state["epoch_correct"][best]
    found = dict(select_acc=chosen_by, epoch=best + 1, select=chosen_by[best], correct=hits)
    found.update(acc=sum(hits) / len(hits), examples=counts, steps=total)
    return dict(found, train_seconds=state["seconds"], loss_curve=state["loss_curve"])
