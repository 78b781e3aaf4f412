"""Layerwise distillation of PRF features (paper §4), the direct baseline, and their training loop.

Each layer's features learn from the frozen teacher's own q, k of that layer: one teacher pass feeds
every layer, and no student layer feeds another. With s_ij = q_i·k_j/√d, m_i = max_{j≤i} s_ij and
K̂ = Φ(q)·Φ(k):
- "l2": mean over causal pairs (j ≤ i) of (exp(s_ij − m_i) − K̂_ij·exp(−m_i))². Both kernels are
  divided by the teacher's row max, a per-query scale they share: large-norm heads then neither
  overflow nor dominate, and no normalising sum is needed.
- "softmax": mean over queries of the cross-entropy −Σ_j p_ij log p̂_ij, p_i = softmax_{j≤i}(s_ij),
  p̂_ij = K̂_ij / Σ_{j'≤i} K̂_ij'. Per-query scales cancel in p̂, so it is computed from the shifted
  features PRFFeatures.queries/keys return.
- "direct" (baseline): next-token cross-entropy of the whole student, end to end.
The loss arithmetic runs in float64 (a key far from every z has features below fp32's range, which
would make log p̂ −inf). Only the student's row sum is clamped, against a row whose every value
underflowed; a non-finite loss stops training with an error. Memory: one layer and one chunk of
queries at a time, each chunk back-propagated at once.
"""

import hashlib
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .students import make_student, read_tensors, save_student, save_tensors, trainable

LOSSES = ("l2", "softmax", "direct")


@torch.no_grad()
def capture(teacher, ids):
    """Every layer's (q, k, v) [B, H, T, d]; no logits are computed (the head is most of a small
    model's cost)."""
    layers = []
    teacher(ids, capture=layers, keep=torch.zeros_like(ids, dtype=torch.bool))
    return layers


def chunk_terms(features, q, k, v, phi_k, lo: int, hi: int, want: set) -> dict:
    """Sums over queries lo:hi (keys ≤ each query), per [B, H], of the terms in `want`: "l2" squared
    scaled kernel error, "ce" cross-entropy, "kl" KL(p‖p̂), "err"/"norm" squared output error and
    output norm (needs v)."""
    causal = torch.ones(hi - lo, hi, dtype=torch.bool, device=q.device).tril(lo)  # [c, hi]
    scores = q[:, :, lo:hi] @ k[:, :, :hi].mT / math.sqrt(q.shape[-1])  # [B, H, c, hi]
    s = torch.where(causal, scores, -math.inf)  # [B, H, c, hi]
    m = s.amax(-1, keepdim=True)  # [B, H, c, 1]
    kern = torch.exp(s - m)  # [B, H, c, hi] teacher kernel over its row max, 0 above the diagonal
    phi_q, log_scale = features.queries(q[:, :, lo:hi])  # [B, H, c, M], [B, H, c, 1]
    dot = torch.where(causal, phi_q @ phi_k[:, :, :hi].mT, 0)  # [B, H, c, hi] K̂ / exp(log_scale)
    out = {}
    if "l2" in want:
        out["l2"] = (dot * torch.exp(log_scale - m) - kern).square().sum((-2, -1))
    if want & {"ce", "kl", "err"}:
        p = kern / kern.sum(-1, keepdim=True)  # [B, H, c, hi]
        row = dot.sum(-1, keepdim=True).clamp_min(torch.finfo(dot.dtype).tiny)  # [B, H, c, 1]
        # where p is 0 (above the diagonal, or underflowed) the student's value is not looked at:
        # 0·log 0 would make the gradient NaN
        log_dot = torch.where(p > 0, dot, 1).log()  # [B, H, c, hi]
        out["ce"] = (row.log()[..., 0] - (p * log_dot).sum(-1)).sum(-1)
        if "kl" in want:
            out["kl"] = out["ce"] + torch.xlogy(p, p).sum((-2, -1))
        if "err" in want:
            y = p @ v[:, :, :hi]  # [B, H, c, dv]
            y_hat = (dot / row) @ v[:, :, :hi]  # [B, H, c, dv]
            out["err"] = (y_hat - y).square().sum((-2, -1))
            out["norm"] = y.square().sum((-2, -1))
    return out


def layer_pass(features, q, k, v, want: set, chunk: int, train: bool = False) -> dict:
    """Per-head means [H] of the terms in `want` over one layer's batch.

    l2 is a mean per causal pair, the rest per query. train=True back-propagates each chunk's share
    of the head-mean of the one term in `want`; the keys' features are then a detached leaf whose
    gradient is passed on once, at the end.
    """
    q, k = q.double(), k.double()  # [B, H, T, d]
    B, H, T, _ = q.shape
    phi_k = features.keys(k)  # [B, H, T, M]
    keys = phi_k.detach().requires_grad_() if train else phi_k
    sums = {}
    for lo in range(0, T, chunk):
        terms = chunk_terms(features, q, k, v, keys, lo, min(lo + chunk, T), want)
        for name, t in terms.items():
            count = B * T * (T + 1) / 2 if name == "l2" else B * T
            if train:
                (t.sum() / (count * H)).backward()
            sums[name] = sums.get(name, 0) + t.detach().sum(0) / count  # [H]
    if train:
        phi_k.backward(keys.grad)
    return sums


def as_token_ids(token_ids, need: int, what: str) -> torch.Tensor:
    """token_ids as a 1-D CPU LongTensor of at least `need` tokens, or a named error."""
    token_ids = torch.as_tensor(token_ids)
    if token_ids.dim() != 1 or len(token_ids) < need:
        raise ValueError(
            f"{what}: token_ids must be 1-D with >= {need} tokens; "
            f"got shape {tuple(token_ids.shape)}"
        )
    return token_ids.long().cpu().contiguous()


def _train(
    student,
    step_fn,
    token_ids,
    what,
    steps,
    batch,
    ctx,
    data_seed,
    lr,
    lr_a,
    out_path,
    save_every,
    log,
    log_every,
    meta,
):
    """The loop distill and train_direct share (their docstrings give the arguments).

    Adam over the student's trainable tensors (names ending in `.a` at lr_a, the rest at lr) on
    `batch` windows of ctx tokens per step, drawn by a generator seeded with data_seed; step_fn(ids)
    back-propagates and returns per-layer losses.
    """
    if not 2 <= ctx <= student.config.n_ctx or min(steps, batch, save_every) < 1:
        raise ValueError(
            f"{what}: need 2 <= ctx <= {student.config.n_ctx} and steps, batch, save_every >= 1; "
            f"got ctx={ctx}, steps={steps}, batch={batch}, save_every={save_every}"
        )
    token_ids = as_token_ids(token_ids, ctx, what)
    params = trainable(student)
    groups = []
    for is_a, rate in ((False, lr), (True, lr_a)):
        group = [p for n, p in params.items() if n.endswith(".a") == is_a]
        if group:
            groups.append({"params": group, "lr": rate})
    opt = torch.optim.Adam(groups)
    tokens_hash = hashlib.sha256(token_ids.numpy().tobytes()).hexdigest()[:16]
    settings = {
        **student.meta,
        **(meta or {}),
        "loss": what,
        "teacher": student.identity,
        "steps": steps,
        "batch": batch,
        "ctx": ctx,
        "data_seed": data_seed,
        "lr": lr,
        "lr_a": lr_a,
        "tokens": tokens_hash,
    }
    gen = torch.Generator().manual_seed(data_seed)
    device = next(student.parameters()).device
    progress = Path(f"{out_path}.progress") if out_path else None
    start, seconds, curve = 0, 0.0, []
    if progress and progress.exists():
        start, seconds, curve = _resume(progress, settings, params, opt, gen, log)
        if start:
            log(f"{what}: resuming from {progress} at step {start}/{steps}")
    log_every = log_every or max(1, steps // 10)
    t0, window = time.time(), []
    for step in range(start, steps):
        first = torch.randint(0, len(token_ids) - ctx + 1, (batch, 1), generator=gen)  # [batch, 1]
        losses = step_fn(token_ids[first + torch.arange(ctx)].to(device))  # ids [batch, ctx]
        bad = [i for i, x in enumerate(losses) if not math.isfinite(x)]
        if bad:
            raise FloatingPointError(
                f"{what}: loss {losses[bad[0]]} at step {step + 1}, layer {bad[0]}"
            )
        opt.step()
        opt.zero_grad(set_to_none=True)
        window.append(losses)
        done = step + 1
        report = done % log_every == 0 or done == steps
        if report:
            mean = [sum(col) / len(window) for col in zip(*window)]  # per layer
            curve.append([done, sum(mean) / len(mean)])
            window = []
        elapsed = time.time() - t0
        if progress and done % save_every == 0 and done < steps:
            _save_progress(progress, settings, params, opt, gen, done, seconds + elapsed, curve)
        if report:
            left = elapsed / (done - start) * (steps - done)
            losses_text = " ".join(f"{x:.4g}" for x in mean)
            log(f"{what} {done}/{steps}: loss {losses_text} ({elapsed:.0f}s, ~{left:.0f}s left)")
    student.meta = {**student.meta, **(meta or {}), "loss": what}
    student.train_seconds = seconds + time.time() - t0
    student.loss_curve = curve
    if out_path:
        # no times in the file: the same settings always give the same bytes
        save_student(student, out_path, {"settings": settings, "loss_curve": curve})
        progress.unlink(missing_ok=True)
    return student


def _save_progress(path, settings, params, opt, gen, done, seconds, curve):
    tensors = {f"param.{n}": p for n, p in params.items()}
    for index, state in opt.state_dict()["state"].items():
        tensors.update({f"adam.{index}.{key}": t for key, t in state.items()})
    tensors["rng"] = gen.get_state()
    meta = {"settings": settings, "step": done, "seconds": seconds, "loss_curve": curve}
    save_tensors(tensors, path, meta)


def _resume(path: Path, settings, params, opt, gen, log):
    """Features, Adam state and the data generator from a progress file of the same settings.

    Returns (step reached, seconds spent, loss curve). A progress file of other settings is set
    aside.
    """
    stored, meta = read_tensors(path)
    saved = meta.get("settings", {})
    if saved != settings:
        changed = sorted(
            k for k in saved.keys() | settings.keys() if saved.get(k) != settings.get(k)
        )
        log(f"{path}: progress of other settings ({', '.join(changed)} changed); starting over")
        path.unlink()
        return 0, 0.0, []
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(stored[f"param.{n}"])
    state = {"state": {}, "param_groups": opt.state_dict()["param_groups"]}
    for name, t in stored.items():
        if name.startswith("adam."):  # adam.{index in the optimiser}.{exp_avg, exp_avg_sq, step}
            _, index, key = name.split(".")
            state["state"].setdefault(int(index), {})[key] = t
    opt.load_state_dict(state)
    gen.set_state(stored["rng"])
    return int(meta["step"]), float(meta["seconds"]), meta["loss_curve"]


def distill(
    teacher,
    dims,
    token_ids,
    *,
    loss: str = "softmax",
    feature_seed: int = 0,
    data_seed: int = 0,
    steps: int = 200,
    batch: int = 8,
    ctx: int = 256,
    lr: float = 0.02,
    lr_a: float = 0.2,
    chunk: int = 256,
    out_path=None,
    save_every: int = 50,
    log=print,
    log_every=None,
    meta=None,
):
    """A PRF student (dims[i] features in layer i, drawn with feature_seed + i), each layer trained
    with the "l2" or "softmax" loss on the teacher's q, k for windows of token_ids (1-D).

    Adam, lr for z and lr_a for a = log α (the paper's 0.02 and 0.2), `steps` steps of `batch`
    random windows of ctx tokens drawn with data_seed; `chunk` queries per piece of the attention
    matrices. With out_path, progress goes atomically to `<out_path>.progress` every save_every
    steps, a run with the same settings resumes from it (train_seconds adds up), and the student is
    saved to out_path with `meta`. A line per log_every steps (default a tenth). The teacher stays
    untouched.
    """
    if loss not in ("l2", "softmax"):
        raise ValueError(f"distill: loss {loss!r}; expected 'l2' or 'softmax'")
    student = make_student(teacher, "prf", dims, feature_seed)
    term = "l2" if loss == "l2" else "ce"

    def step(ids):
        layers = zip(student.blocks, capture(teacher, ids))
        return [
            layer_pass(block.attn.features, q, k, None, {term}, chunk, train=True)[term]
            .mean()
            .item()
            for block, (q, k, _) in layers
        ]

    return _train(
        student,
        step,
        token_ids,
        loss,
        steps,
        batch,
        ctx,
        data_seed,
        lr,
        lr_a,
        out_path,
        save_every,
        log,
        log_every,
        meta,
    )


def train_direct(
    student,
    token_ids,
    *,
    data_seed: int = 0,
    steps: int = 200,
    batch: int = 8,
    ctx: int = 256,
    lr: float = 0.02,
    lr_a: float = 0.2,
    out_path=None,
    save_every: int = 50,
    log=print,
    log_every=None,
    meta=None,
):
    """The direct baseline, in place: next-token cross-entropy of the whole student, end to end.

    Scored on positions 1..ctx-1 of each window, training only the student's own tensors.
    Arguments as for distill.
    """

    def step(ids):
        logits = student(ids[:, :-1])  # [B, T-1, V]
        nll = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        nll.backward()
        return [nll.item()]

    return _train(
        student,
        step,
        token_ids,
        "direct",
        steps,
        batch,
        ctx,
        data_seed,
        lr,
        lr_a,
        out_path,
        save_every,
        log,
        log_every,
        meta,
    )
