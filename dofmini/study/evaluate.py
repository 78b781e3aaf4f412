"""Evaluation: perplexity by the stand-ins' reference protocol, zero-shot task accuracy scored as
lm-evaluation-harness scores it, and the students' per-layer attention errors. Context and
continuation are encoded separately and concatenated, so the scored tokens are exactly the
continuation's own encoding; over-long inputs lose tokens from the left."""

import functools
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..checks import need_integers, not_integers
from ..distill import add_means, layer_chunks
from ..log_space import unit_features
from . import data, devices
from .progress import Progress, duration
from .tasks import TASKS, load_task

# the perplexity texts, relative to the data folder; each name is also its dofmini.data group
PPL_TEXTS = {"wikitext2": "wikitext-2-raw/wiki.test.raw", "heldout": "corpus/wikipedia-heldout.txt"}


@torch.no_grad()
def perplexity(model, token_ids, ctx: int, batch: int = 8, what: str = "perplexity"):
    """(ppl, total NLL, scored tokens): non-overlapping windows of `ctx` tokens from the start, the
    last partial one dropped, positions 1..ctx-1 of each scored from their in-window prefix;
    `what` names it in the progress lines."""
    n_pos = model.config.n_ctx
    if not 2 <= ctx <= n_pos:
        raise ValueError(f"ctx={ctx}: expected 2..{n_pos} (the positions of {model.config.name})")
    token_ids = model.token_ids(torch.as_tensor(token_ids).flatten(), 0, "perplexity")
    token_ids = token_ids.to(next(model.parameters()).device)
    if len(token_ids) < ctx:
        raise ValueError(f"{len(token_ids)} tokens do not fill one window of ctx={ctx}")
    windows, nll, scored = devices.share(token_ids.unfold(0, ctx, ctx)), 0.0, 0  # [W, ctx]
    with Progress(what, len(windows), "windows") as progress:
        for chunk in windows.split(batch):  # [b, ctx]
            logits = model(chunk[:, :-1])  # [b, ctx-1, V]
            targets = chunk[:, 1:].flatten()
            token_nll = F.cross_entropy(logits.flatten(0, 1).float(), targets, reduction="none")
            nll += token_nll.sum().item()  # one read from the device per batch
            scored += len(targets)
            progress.update(len(chunk))
    nll, scored = devices.all_sum(torch.tensor([nll, scored], dtype=torch.float64)).tolist()
    return math.exp(nll / scored), nll, int(scored)


def not_requests(requests, config, name: str = "requests") -> str:
    """Why `requests` cannot be scored by a model of `config` (its n_ctx and vocab_size): none,
    or the first without a context, with a continuation not of 1..n_ctx tokens or with a token id
    that is no int in [0, vocab_size); or ""."""
    if not requests:
        return f"{name} is empty; expected (context ids, continuation ids) pairs"
    max_len, vocab = config.n_ctx, config.vocab_size
    for i, (context, continuation) in enumerate(requests):
        if not context or not 1 <= len(continuation) <= max_len:
            got = f"context of {len(context)} tokens, continuation of {len(continuation)}"
            return f"{name}[{i}]: {got}; expected a context and 1..{max_len} continuation tokens"
        ids = [*context, *continuation]
        if {type(t) for t in ids} != {int} or not 0 <= min(ids) <= max(ids) < vocab:
            bad = next(t for t in ids if type(t) is not int or not 0 <= t < vocab)
            return f"{name}[{i}]: token id {bad!r}; expected an int in [0, {vocab})"
    return ""


def not_label(label, choices: int) -> str:
    """Why `label` names none of `choices` choices (a bool is no index), or ""."""
    if type(label) is not int or not 0 <= label < choices:
        return f"label {label!r} for {choices} choice(s); expected an int in [0, {choices})"
    return ""


@torch.no_grad()
def score_requests(model, requests, batch_tokens: int = 4096, what: str = "scoring"):
    """(summed log-likelihood, greedy) of each (context ids, continuation ids) request, greedy when
    every continuation token is the argmax. Requests with equal model inputs share one forward pass
    (MMLU's four letters); inputs are sorted by length and right-padded, which a causal model never
    sees. Under torchrun each rank scores its share of the inputs and the scores are summed."""
    why = not_requests(requests, model.config)
    why = not_integers("score_requests", batch_tokens=batch_tokens) or (
        why and f"score_requests ({what}): {why}"
    )
    if why:
        raise ValueError(why)
    max_len = model.config.n_ctx
    rows = {}  # model input -> indices of the requests it serves
    for i, (context, continuation) in enumerate(requests):
        rows.setdefault(tuple((list(context) + list(continuation))[:-1][-max_len:]), []).append(i)
    inputs = devices.share(sorted(rows, key=len, reverse=True))
    found = torch.zeros(len(requests), 2, dtype=torch.float64)  # [n, 2] log-likelihood, greedy
    device = next(model.parameters()).device
    start = 0
    with Progress(what, len(inputs), "inputs") as progress:
        while start < len(inputs):
            batch = inputs[start : start + max(1, batch_tokens // len(inputs[start]))]
            ids, keep, where, targets, owner, served = _gather(batch, rows, requests, device)
            logprobs = model(ids, keep=keep).float().log_softmax(-1)  # [N, V], rows in `keep` order
            token_ll = logprobs[where, targets]  # [n]
            misses = (logprobs[where].argmax(-1) != targets).float()  # [n]
            sums = torch.zeros(2, len(served), device=device)  # [2, requests]
            sums[0].index_add_(0, owner, token_ll)
            sums[1].index_add_(0, owner, misses)
            found[served] = torch.stack((sums[0], sums[1] == 0), 1).double().cpu()  # [b, 2]
            start += len(batch)
            progress.update(len(batch))
    return [(ll, greedy == 1) for ll, greedy in devices.all_sum(found).tolist()]


def _gather(batch: list, rows: dict, requests, device) -> tuple:
    """Every request of a batch of model inputs gathered at once, for one read from the device
    per batch: on `device`, ids [b, T] right-padded with 0, keep [b, T] the scored positions, and
    per scored token its row in `keep` order, its target and its request's place in `served`;
    then `served`, the requests served in order."""
    ids = torch.zeros(len(batch), len(batch[0]), dtype=torch.long)  # [b, T]
    keep = torch.zeros(len(batch), len(batch[0]), dtype=torch.bool)  # [b, T]
    where = []
    targets = []
    owner = []
    served = []
    end = 0
    for b, row in enumerate(batch):
        n = max(len(requests[i][1]) for i in rows[row])
        ids[b, : len(row)] = torch.tensor(row)
        keep[b, len(row) - n : len(row)] = True
        end += n
        for i in rows[row]:
            k = len(requests[i][1])
            where += range(end - k, end)
            targets += requests[i][1]
            owner += [len(served)] * k
            served.append(i)
    tokens = (torch.tensor(x, device=device) for x in (where, targets, owner))
    return ids.to(device), keep.to(device), *tokens, served


def not_examples(examples) -> str:
    """Why `examples` cannot be scored: none, or the first whose contexts and continuations
    differ in number (zip would drop choices) or whose label names none of its choices; or ""."""
    if not examples:
        return "examples is empty; expected Examples"
    for i, e in enumerate(examples):
        count = len(e.continuations)
        unpaired = f"{len(e.contexts)} contexts for {count} continuations; expected one each"
        why = not_label(e.label, count) if len(e.contexts) == count >= 1 else unpaired
        if why:
            return f"examples[{i}]: {why}"
    return ""


def score_examples(model, tokenizer, examples, what: str = "scoring") -> dict:
    """{"acc", "acc_norm", "n"} over multiple-choice `Example`s: acc takes the best summed
    log-likelihood, acc_norm the best per character of the continuation (without its separating
    space). Plus "acc_macro", "acc_norm_macro" over groups when they have groups (MMLU; "acc" is
    then the micro average). Single-choice examples are cloze items (LAMBADA): "acc" is greedy
    match of the whole continuation, "ppl" exp(-mean log-likelihood)."""
    why = not_examples(examples)
    if why:
        raise ValueError(f"score_examples ({what}): {why}")
    pairs = [(c, x) for e in examples for c, x in zip(e.contexts, e.continuations)]
    texts = sorted({s for pair in pairs for s in pair})
    ids = dict(zip(texts, (e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False))))
    longest = max((len(ids[x]) for _, x in pairs), default=0)
    n_ctx = model.config.n_ctx
    if longest > n_ctx:  # a choice is scored whole or not at all
        need = f"a choice of {longest} tokens does not fit the model's context of {n_ctx}"
        raise data.DataError(f"{what}: {need}; run with --limit 0 (no tasks) or a longer context")
    scores = score_requests(model, [(ids[c], ids[x]) for c, x in pairs], what=what)
    if all(len(e.continuations) == 1 for e in examples):
        ll, greedy = np.array(scores, dtype=float).T  # [2, examples]
        return {"acc": float(greedy.mean()), "ppl": float(np.exp(-ll.mean())), "n": len(examples)}
    hits = []
    hits_norm = []
    start = 0
    for e in examples:
        ll = np.array([s[0] for s in scores[start : start + len(e.continuations)]])
        chars = np.array([max(1, len(c.lstrip(" "))) for c in e.continuations])
        hits.append(ll.argmax() == e.label)
        hits_norm.append((ll / chars).argmax() == e.label)
        start += len(e.continuations)
    out = {"acc": float(np.mean(hits)), "acc_norm": float(np.mean(hits_norm)), "n": len(examples)}
    groups = sorted({e.group for e in examples})
    if groups != [""]:
        for key, h in (("acc_macro", hits), ("acc_norm_macro", hits_norm)):
            by_group = [np.mean([x for x, e in zip(h, examples) if e.group == g]) for g in groups]
            out[key] = float(np.mean(by_group))
    return out


def held_out(teacher, token_ids, ctx: int, windows: int, offset: int, what: str) -> torch.Tensor:
    """`windows` disjoint windows [W, ctx] of token_ids from window `offset` on, on the teacher's
    device; `what` names the caller in errors."""
    token_ids = teacher.token_ids(token_ids, (offset + windows) * ctx, what)[offset * ctx :]
    return token_ids[: windows * ctx].view(windows, ctx).to(next(teacher.parameters()).device)


def layer_pass(features, q, k, v, want: set, chunk: int, dtype=torch.float32) -> dict:
    """Per-head means [H] of the terms in `want` over one layer's batch, in `dtype`."""
    q = q.to(dtype)  # [B, H, T, d]
    k = k.to(dtype)
    v = None if v is None else v.to(dtype)  # [B, H, T, dv]
    unit_k, top_k = unit_features(features.log_features(k, "k"))  # [B, H, T, M], [.., 1]
    sums = {}
    for terms in layer_chunks(features, q, k, v, unit_k, top_k, want, chunk):
        add_means(sums, terms)
    return sums


@torch.no_grad()
def layer_errors(teacher, student, token_ids, ctx, windows, offset=0, batch=4, chunk=256) -> dict:
    """Per-layer approximation error of a student's attention, with the teacher's own inputs, on
    `windows` disjoint windows of ctx tokens from window `offset` on, `batch` at a time. Lists over
    layers of the mean over heads of "kernel_l2" (the l2 loss), "kl" (KL(p‖p̂) per query) and
    "output_rel" (‖ŷ − y‖/‖y‖ of the per-head attention outputs before the output projection); and
    "kl_heads", each layer's KL per head. None for a layer without PRF `features` (DiJiang: its
    gate reads the block input, so it has no per-head output either)."""
    sizes = dict(ctx=ctx, windows=windows, batch=batch, chunk=chunk)
    need_integers("layer_errors", **sizes)
    all_windows = held_out(teacher, token_ids, ctx, windows, offset, "layer_errors")  # [W, ctx]
    sums = [{} for _ in student.blocks]
    with Progress("layer errors", windows, "windows") as progress:
        for ids in all_windows.split(batch):
            for acc, block, (q, k, v) in zip(sums, student.blocks, teacher.capture(ids)):
                if not hasattr(block.attn, "features"):
                    continue
                terms = layer_pass(block.attn.features, q, k, v, {"l2", "kl", "err"}, chunk)
                for name, t in terms.items():
                    acc[name] = acc.get(name, 0) + t * len(ids)  # [H] weighted by windows
            progress.update(len(ids))
    errors = {"kernel_l2": [], "kl": [], "output_rel": [], "kl_heads": []}
    for acc in sums:
        if not acc:
            for values in errors.values():
                values.append(None)
            continue
        kl_heads = (acc["kl"] / windows).tolist()  # [H]
        errors["kl_heads"].append(kl_heads)
        errors["kl"].append(sum(kl_heads) / len(kl_heads))
        errors["kernel_l2"].append(acc["l2"].mean().item() / windows)
        errors["output_rel"].append((acc["err"] / acc["norm"]).sqrt().mean().item())
    return errors


def evaluate_model(
    model,
    tokenizer,
    texts: dict,
    ctx: int,
    data_dir,
    windows=None,
    limit=None,
    tasks=tuple(TASKS),
    part=None,
) -> dict:
    """Perplexity of each {name: token ids} text on its first `windows` windows of ctx tokens (all
    when None), then each of `tasks` on its first `limit` examples: {"<name>_ppl", "<name>_tokens"
    per text, "tasks": {task: score_examples(...)}, "ppl_seconds", "eval_seconds"}. Each text and
    each task is a part, {"result", "seconds"} from part(name, compute): compute() by default;
    stages.saved_parts saves each as it finishes and gives back those saved before."""
    part = part or (lambda name, compute: compute())
    result = {"tasks": {}}
    ppl_seconds = 0.0
    seconds = 0.0
    for name, ids in texts.items():
        scored = ids if windows is None else ids[: windows * ctx]
        compute = functools.partial(perplexity, model, scored, ctx, what=f"perplexity {name}")
        found = part(name, _timed(name, compute, _says_perplexity))
        result[f"{name}_ppl"], _, result[f"{name}_tokens"] = found["result"]
        ppl_seconds += found["seconds"]
    for name in tasks:
        compute = functools.partial(_task, model, tokenizer, name, data_dir, limit)
        found = part(name, _timed(name, compute, str))
        result["tasks"][name] = found["result"]
        seconds += found["seconds"]
    return dict(result, ppl_seconds=ppl_seconds, eval_seconds=ppl_seconds + seconds)


def _task(model, tokenizer, name: str, data_dir, limit) -> dict:
    pinned = {Path(f.path).name for f in data.files(name)}  # no other file in its folder
    return score_examples(model, tokenizer, load_task(name, data_dir, limit, pinned), what=name)


def _says_perplexity(found) -> str:
    ppl, _, scored = found
    return f"perplexity {ppl:.4f} over {scored} tokens"


def _timed(name: str, compute, says):
    """Part `name`'s compute: {"result": compute(), "seconds"}, with a line of what it found,
    says(result), and its time."""

    def timed() -> dict:
        start = time.time()
        found = compute()
        seconds = time.time() - start
        print(f"{name}: {says(found)} in {duration(seconds)}", flush=True)
        return {"result": found, "seconds": seconds}

    return timed
