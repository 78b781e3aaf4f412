"""Evaluation: perplexity by the stand-ins' reference protocol, and zero-shot task accuracy.

Task scoring follows lm-evaluation-harness: a choice's score is the summed log-likelihood of its
continuation tokens given its context; acc takes the best score, acc_norm the best score per
character of the continuation (without its separating space). Context and continuation are encoded
separately and concatenated, so the scored tokens are exactly the continuation's own encoding;
over-long inputs lose tokens from the left.
"""

import math
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..distill import as_token_ids, layer_pass
from ..dof import capture
from .tasks import TASKS, load_task

# the perplexity texts, relative to the data folder; each name is also its dofmini.data group
PPL_TEXTS = {"wikitext2": "wikitext-2-raw/wiki.test.raw", "heldout": "corpus/wikipedia-heldout.txt"}


def _progress(what: str, total: int):
    """A progress bar on stdout for a loop of `total` steps; none for short loops."""
    return tqdm(total=total, desc=what, file=sys.stdout, disable=total < 500, mininterval=5)


@torch.no_grad()
def perplexity(model, token_ids, ctx: int, stride=None, batch: int = 8):
    """(ppl, total NLL, scored tokens).

    Without `stride`: non-overlapping windows of `ctx` tokens from the start, the last partial one
    dropped, positions 1..ctx-1 of each scored from their in-window prefix. With `stride` s < ctx:
    windows start every s tokens; the first scores positions 1..ctx-1 and each later one only its
    last s, so every token is scored once with at least ctx - s tokens of prefix.
    """
    n_pos = model.config.n_ctx
    if not 2 <= ctx <= n_pos:
        raise ValueError(f"ctx={ctx}: expected 2..{n_pos} (the positions of {model.config.name})")
    if stride is not None and not 1 <= stride < ctx:
        raise ValueError(
            f"stride={stride}: expected 1..{ctx - 1} (ctx={ctx}), or None for disjoint windows"
        )
    token_ids = torch.as_tensor(token_ids).flatten().to(next(model.parameters()).device)
    if len(token_ids) < ctx:
        raise ValueError(f"{len(token_ids)} tokens do not fill one window of ctx={ctx}")
    windows = token_ids.unfold(0, ctx, stride or ctx)  # [W, ctx]
    first_scored = torch.zeros(
        len(windows), dtype=torch.long, device=windows.device
    )  # [W] first target scored
    if stride is not None:
        first_scored[1:] = ctx - 1 - stride
    nll, scored = 0.0, 0
    progress = _progress(f"perplexity ctx={ctx}", len(windows))
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]  # [b, ctx]
        logits = model(chunk[:, :-1])  # [b, ctx-1, V]
        token_nll = F.cross_entropy(
            logits.flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="none"
        )
        keep = (
            torch.arange(ctx - 1, device=windows.device) >= first_scored[i : i + batch, None]
        )  # [b, ctx-1]
        # one read from the device per batch: the summed NLL and the count together
        batch_nll, batch_scored = torch.stack(
            [(token_nll.view_as(keep) * keep).sum(), keep.sum().float()]
        ).tolist()
        nll, scored = nll + batch_nll, scored + int(batch_scored)
        progress.update(len(chunk))
    progress.close()
    return math.exp(nll / scored), nll, scored


@torch.no_grad()
def score_requests(model, requests, ctx=None, batch_tokens: int = 4096, what: str = "scoring"):
    """(summed log-likelihood, greedy) of each (context ids, continuation ids) request.

    greedy: every continuation token is the argmax. Requests with equal model inputs share one
    forward pass (MMLU's four letters); inputs are sorted by length and right-padded, which a causal
    model never sees.
    """
    max_len = min(model.config.n_ctx, ctx or model.config.n_ctx)
    rows = {}  # model input -> indices of the requests it serves
    for i, (context, continuation) in enumerate(requests):
        if not context or not 1 <= len(continuation) <= max_len:
            raise ValueError(
                f"{what}: context of {len(context)} tokens, continuation of {len(continuation)}; "
                f"expected a context and 1..{max_len} continuation tokens"
            )
        rows.setdefault(tuple((list(context) + list(continuation))[:-1][-max_len:]), []).append(i)
    inputs = sorted(rows, key=len, reverse=True)
    results, start, progress = [None] * len(requests), 0, _progress(what, len(inputs))
    device = next(model.parameters()).device
    while start < len(inputs):
        batch = inputs[start : start + max(1, batch_tokens // len(inputs[start]))]
        # scored positions per row
        depth = [max(len(requests[i][1]) for i in rows[row]) for row in batch]
        # right-padded with token 0
        ids = torch.zeros(len(batch), len(batch[0]), dtype=torch.long)  # [b, T]
        keep = torch.zeros(len(batch), len(batch[0]), dtype=torch.bool)  # [b, T]
        for b, (row, n) in enumerate(zip(batch, depth)):
            ids[b, : len(row)] = torch.tensor(row)
            keep[b, len(row) - n : len(row)] = True
        ids, keep = ids.to(device), keep.to(device)
        logprobs = model(ids, keep=keep).float().log_softmax(-1)  # [N, V], rows in `keep` order
        # every request of the batch gathered at once, one read from the device per batch
        where, targets, owner, served, end = [], [], [], [], 0
        for row, n in zip(batch, depth):
            end += n
            for i in rows[row]:
                k = len(requests[i][1])
                where += range(end - k, end)
                targets += requests[i][1]
                owner += [len(served)] * k
                served.append(i)
        where, targets, owner = (torch.tensor(x, device=device) for x in (where, targets, owner))
        token_ll = logprobs[where, targets]  # [n] log-likelihood of each scored token
        misses = (logprobs[where].argmax(-1) != targets).float()  # [n]
        sums = torch.zeros(2, len(served), device=device)  # [2, requests]
        sums[0].index_add_(0, owner, token_ll)
        sums[1].index_add_(0, owner, misses)
        for i, ll, missed in zip(served, *sums.tolist()):
            results[i] = (ll, missed == 0)
        start += len(batch)
        progress.update(len(batch))
    progress.close()
    return results


def score_examples(
    model, tokenizer, examples, ctx=None, batch_tokens: int = 4096, what: str = "scoring"
) -> dict:
    """{"acc", "acc_norm", "n"} over multiple-choice `Example`s.

    Plus "acc_macro", "acc_norm_macro" over groups when they have groups (MMLU; "acc" is then the
    micro average). Single-choice examples are cloze items (LAMBADA): "acc" is greedy match of the
    whole continuation, "ppl" exp(-mean log-likelihood).
    """
    pairs = [(c, x) for e in examples for c, x in zip(e.contexts, e.continuations)]
    texts = sorted({s for pair in pairs for s in pair})
    ids = dict(zip(texts, (e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False))))
    scores = score_requests(model, [(ids[c], ids[x]) for c, x in pairs], ctx, batch_tokens, what)
    if all(len(e.continuations) == 1 for e in examples):
        ll = np.array([s[0] for s in scores])
        return {
            "acc": float(np.mean([s[1] for s in scores])),
            "ppl": float(np.exp(-ll.mean())),
            "n": len(examples),
        }
    hits, hits_norm, start = [], [], 0
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
            out[key] = float(
                np.mean([np.mean([x for x, e in zip(h, examples) if e.group == g]) for g in groups])
            )
    return out


def evaluate_tasks(
    model, tokenizer, names, data_dir, limit=None, batch_tokens: int = 4096, ctx=None
) -> dict:
    """{task: score_examples(...)} for names in `tasks.TASKS`, each on its first `limit` items."""
    results = {}
    for name in names:
        t0 = time.time()
        results[name] = score_examples(
            model, tokenizer, load_task(name, data_dir, limit), ctx, batch_tokens, name
        )
        print(f"{name}: {results[name]} ({time.time() - t0:.0f}s)", flush=True)
    return results


@torch.no_grad()
def layer_errors(
    teacher,
    student,
    token_ids,
    ctx: int,
    windows: int,
    offset: int = 0,
    batch: int = 4,
    chunk: int = 256,
) -> dict:
    """Per-layer approximation error of a student's attention, with the teacher's own inputs.

    On `windows` disjoint windows of ctx tokens of token_ids, starting at window `offset`, fed
    `batch` at a time: lists over layers of the mean over heads of "kernel_l2" (the l2 loss), "kl"
    (KL(p‖p̂) per query) and "output_rel" (‖ŷ − y‖/‖y‖ of the per-head attention outputs before the
    output projection); and "kl_heads", each layer's KL per head. None for a layer without PRF
    `features` (DiJiang: its gate reads the block input, so it has no per-head output either).
    """
    need = (offset + windows) * ctx
    token_ids = as_token_ids(token_ids, need, "layer_errors")
    device = next(teacher.parameters()).device
    all_windows = token_ids[offset * ctx : need].view(windows, ctx).to(device)  # [W, ctx]
    sums = [{} for _ in student.blocks]
    for ids in all_windows.split(batch):
        for acc, block, (q, k, v) in zip(sums, student.blocks, capture(teacher, ids)):
            if not hasattr(block.attn, "features"):
                continue
            terms = layer_pass(block.attn.features, q, k, v, {"l2", "kl", "err"}, chunk)
            for name, t in terms.items():
                acc[name] = acc.get(name, 0) + t * len(ids)  # [H] weighted by windows
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
) -> dict:
    """Perplexity of each {name: token ids} text, then the tasks.

    Perplexity on the first `windows` windows of ctx tokens (all when None), the tasks on their
    first `limit` examples: {"<name>_ppl", "<name>_tokens" per text, "tasks", "ppl_seconds",
    "eval_seconds"}.
    """
    t0, result = time.time(), {}
    for name, ids in texts.items():
        scored = ids if windows is None else ids[: windows * ctx]
        ppl, _, n = perplexity(model, scored, ctx)
        result[f"{name}_ppl"], result[f"{name}_tokens"] = ppl, n
        print(
            f"{name} perplexity {ppl:.4f} over {n} tokens ({time.time() - t0:.0f}s)",
            flush=True,
        )
    result["ppl_seconds"] = time.time() - t0
    result["tasks"] = evaluate_tasks(model, tokenizer, tasks, data_dir, limit)
    result["eval_seconds"] = time.time() - t0
    return result
