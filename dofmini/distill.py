"""Layerwise distillation of PRF features (paper §4), the direct baseline, and their training loop.
Each layer's features learn from the frozen teacher's own q, k of that layer: one teacher pass feeds
every layer, and one layer and one chunk of queries are in memory at a time."""

import dataclasses
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .linear_attention import unit_features
from .model import check_args
from .students import make_student, trainable

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """`steps` Adam steps on `batch` windows of ctx tokens drawn with data_seed, back-propagated
    `part` windows at a time (shared_step); lr for z (and DiJiang's), lr_a for a = log α (the
    paper's 0.02, 0.2); `chunk` queries a piece and `dtype` for layerwise losses. Progress is saved
    every save_every steps, logged every log_every (None: a tenth); the other fields decide the
    result (.record())."""

    steps: int = 200
    batch: int = 8
    ctx: int = 256
    lr: float = 0.02
    lr_a: float = 0.2
    data_seed: int = 0
    part: int = 1
    chunk: int = 256
    dtype: str = "float32"
    save_every: int = 50
    log_every: int | None = None

    def __post_init__(self):
        check_args("TrainSettings", "a positive finite number", lr=self.lr, lr_a=self.lr_a)
        low = dict(steps=1, batch=1, part=1, ctx=2, chunk=1, save_every=1, log_every=1)
        bad = [f"{n}={v}" for n, m in low.items() if (v := getattr(self, n)) is not None and v < m]
        if bad or self.dtype not in DTYPES:
            need = f"ctx >= 2, the other counts >= 1, dtype in {list(DTYPES)}"
            got = f"{', '.join(bad)} dtype={self.dtype!r}"
            raise ValueError(f"TrainSettings: need {need}; got {got}")

    def record(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if not k.endswith("_every")}


def chunk_terms(features, q, k, v, unit_k, top_k, lo: int, hi: int, want: set) -> dict:
    """Sums over queries i in lo:hi and keys j ≤ i, per [B, H], of the terms in `want`. With
    s_ij = q_i·k_j/√d, m_i = max_{j≤i} s_ij, p_i = softmax_j(s_ij), p̂_ij = K̂_ij / Σ_j K̂_ij:
    "l2" (exp(s_ij − m_i) − K̂_ij·exp(−m_i))², both kernels over the teacher's row max (a shared
    per-query scale: large-norm heads neither overflow nor dominate); "ce" −Σ_j p_ij log p̂_ij
    (the softmax loss); "kl" KL(p‖p̂); "err"/"norm" the squared output error and norm (needs v)."""
    causal = torch.ones(hi - lo, hi, dtype=torch.bool, device=q.device).tril(lo)  # [c, hi]
    scores = q[:, :, lo:hi] @ k[:, :, :hi].mT / math.sqrt(q.shape[-1])  # [B, H, c, hi]
    s = torch.where(causal, scores, -math.inf)  # [B, H, c, hi]
    m = s.amax(-1, keepdim=True)  # [B, H, c, 1]
    kern = torch.exp(s - m)  # [B, H, c, hi] teacher kernel over its row max, 0 above the diagonal
    log_q = features.log_features(q[:, :, lo:hi], "q")  # [B, H, c, M]
    unit_q, top_q = unit_features(log_q)  # [B, H, c, M], [B, H, c, 1]
    dot = unit_q @ unit_k[:, :, :hi].mT  # [B, H, c, hi]
    seen = causal & (dot > 0)  # [B, H, c, hi]
    # log K̂ − top_q, −inf above the diagonal and where dot underflowed (log 1 keeps grads finite)
    log_k = torch.where(seen, torch.where(seen, dot, 1).log() + top_k[:, :, :hi].mT, -math.inf)
    out = {}
    if "l2" in want:
        out["l2"] = (torch.exp(log_k + (top_q - m)) - kern).square().sum((-2, -1))
    if want & {"ce", "kl", "err"}:
        p = kern / kern.sum(-1, keepdim=True)  # [B, H, c, hi]
        log_p_hat = log_k - log_k.logsumexp(-1, keepdim=True)  # [B, H, c, hi]
        # where p is 0 (above the diagonal, or underflowed) the student's value is not looked at
        out["ce"] = -(p * torch.where(p > 0, log_p_hat, 0)).sum((-2, -1))
        if "kl" in want:
            out["kl"] = out["ce"] + torch.xlogy(p, p).sum((-2, -1))
        if "err" in want:
            y = p @ v[:, :, :hi]  # [B, H, c, dv]
            y_hat = log_p_hat.exp() @ v[:, :, :hi]  # [B, H, c, dv]
            out["err"], out["norm"] = (y_hat - y).square().sum((-2, -1)), y.square().sum((-2, -1))
    return out


def layer_pass(features, q, k, v, want: set, chunk: int, train: bool = False, dtype=torch.float32):
    """Per-head means [H] of the terms in `want` over one layer's batch, in `dtype` (l2 per causal
    pair, the rest per query). train=True back-propagates each chunk's share of the head-mean of the
    one term in `want`, the keys' features a detached leaf whose gradient is passed on last."""
    q, k = q.to(dtype), k.to(dtype)  # [B, H, T, d]
    v = None if v is None else v.to(dtype)  # [B, H, T, dv]
    B, H, T, _ = q.shape
    unit_k, top_k = unit_features(features.log_features(k, "k"))  # [B, H, T, M], [B, H, T, 1]
    keys = unit_k.detach().requires_grad_() if train else unit_k
    sums = {}
    for lo in range(0, T, chunk):
        terms = chunk_terms(features, q, k, v, keys, top_k, lo, min(lo + chunk, T), want)
        for name, t in terms.items():
            count = B * T * (T + 1) / 2 if name == "l2" else B * T
            if train:
                (t.sum() / (count * H)).backward()
            sums[name] = sums.get(name, 0) + t.detach().sum(0) / count  # [H]
    if train:
        unit_k.backward(keys.grad)
    return sums


@dataclasses.dataclass
class TrainState:
    """A training's state, for a harness that saves and resumes it; curve: [[step, mean loss]]."""

    params: dict
    opt: torch.optim.Adam
    gen: torch.Generator
    step: int = 0
    curve: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def fit(student, step_fn, token_ids, what, s, log=print, resume=None, on_step=None):
    """distill's and train_direct's loop: Adam over the trainable tensors (`*.a` at s.lr_a, the rest
    at s.lr) on windows drawn with s.data_seed; step_fn(ids) back-propagates and returns per-layer
    losses (a non-finite one stops training). resume(state) may restore a saved TrainState first,
    on_step(state) sees it after each step.
    Returns {"train_seconds" (all runs), "loss_curve"}."""
    if s.ctx > (n_ctx := student.config.n_ctx):
        raise ValueError(f"{what}: need ctx <= {n_ctx}; got ctx={s.ctx}")
    token_ids = student.token_ids(token_ids, s.ctx, what)
    params = trainable(student)
    z_rate = [p for n, p in params.items() if not n.endswith(".a")]
    a_rate = [p for n, p in params.items() if n.endswith(".a")]
    groups = [{"params": z_rate, "lr": s.lr}, {"params": a_rate, "lr": s.lr_a}]
    opt = torch.optim.Adam([g for g in groups if g["params"]])
    gen = torch.Generator().manual_seed(s.data_seed)
    state = TrainState(params, opt, gen)
    if resume:
        resume(state)
    start, before, t0, window = state.step, state.seconds, time.time(), []
    every = s.log_every or max(1, s.steps // 10)
    device = next(student.parameters()).device
    for done in range(start + 1, s.steps + 1):
        first = torch.randint(0, len(token_ids) - s.ctx + 1, (s.batch, 1), generator=gen)  # [b, 1]
        ids = token_ids[first + torch.arange(s.ctx)]  # [batch, ctx]
        losses = shared_step(step_fn, ids.to(device), list(params.values()), s.part)
        if not all(map(math.isfinite, losses)):
            raise FloatingPointError(f"{what}: per-layer losses {losses} at step {done}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        window.append(losses)
        state.step, state.seconds = done, before + time.time() - t0
        report = done % every == 0 or done == s.steps
        if report:
            mean = [sum(col) / len(col) for col in zip(*window)]  # per layer
            state.curve.append([done, sum(mean) / len(mean)])
            window = []
        if on_step:
            on_step(state)
        if report:
            elapsed = state.seconds - before
            left = elapsed / (done - start) * (s.steps - done)
            text = " ".join(f"{x:.4g}" for x in mean)
            log(f"{what} {done}/{s.steps}: loss {text} ({elapsed:.0f}s, ~{left:.0f}s left)")
    return {"train_seconds": before + time.time() - t0, "loss_curve": state.curve}


def shared_step(step_fn, ids, params: list, part: int) -> list:
    """step_fn's per-layer losses, and gradients in `params`, of the batch ids [B, ctx]: its parts
    of `part` windows are back-propagated one at a time and their B-weighted gradients added in
    part order. Under torch.distributed rank r takes parts r, r + world, … (each rank at least
    one), and each round's gradients are gathered and added in that same order: any number of
    ranks gives the one-process student bit for bit."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    parts = ids.split(part)  # each [b, ctx]
    if len(parts) < world:
        raise ValueError(f"shared_step: {world} ranks share {len(parts)} parts of {part} windows")
    sizes = [p.numel() for p in params]
    total = torch.zeros(sum(sizes), dtype=params[0].dtype, device=ids.device)  # [n] all params
    losses = 0.0
    for first in range(0, len(parts), world):
        rows = [torch.zeros_like(total) for _ in range(world)]  # [n] each: the round's gradients
        if first + rank < len(parts):
            weight = len(parts[first + rank]) / len(ids)
            step = torch.tensor(step_fn(parts[first + rank]), dtype=torch.float64)  # [L]
            losses = losses + weight * step
            rows[rank] = torch.cat([p.grad.flatten() for p in params]) * weight
            for p in params:
                p.grad = None
        if world > 1:
            dist.all_gather(rows, rows[rank])
        for row in rows[: len(parts) - first]:  # in part order
            total += row
    if world > 1:
        dist.all_reduce(losses)
    for p, grad in zip(params, total.split(sizes)):
        p.grad = grad.view_as(p)
    return losses.tolist()


def distill(teacher, dims, token_ids, settings=TrainSettings(), *, loss="softmax", **loop):
    """(A PRF student, its record): dims[i] features in layer i, seed feature_seed + i (default 0),
    each trained by `loss` ("l2" or "softmax") on the teacher's q, k; `loop`: fit's keywords."""
    if loss not in ("l2", "softmax"):
        raise ValueError(f"distill: loss {loss!r}; expected 'l2' or 'softmax'")
    student = make_student(teacher, "prf", dims, loop.pop("feature_seed", 0))
    term = "l2" if loss == "l2" else "ce"
    dtype = DTYPES[settings.dtype]

    def step(ids):
        losses = []
        for block, (q, k, _) in zip(student.blocks, teacher.capture(ids)):
            terms = layer_pass(block.attn.features, q, k, None, {term}, settings.chunk, True, dtype)
            losses.append(terms[term].mean())
        return torch.stack(losses).tolist()  # one read from the device per step

    return student, fit(student, step, token_ids, loss, settings, **loop)


def train_direct(student, token_ids, settings=TrainSettings(), **loop):
    """(The student, its record), trained in place by the direct baseline (arguments as distill's):
    its next-token cross-entropy on positions 1..ctx-1 of each window, its own tensors only."""

    def step(ids):
        logits = student(ids[:, :-1]).flatten(0, 1).float()  # [B * (T-1), V]
        nll = F.cross_entropy(logits, ids[:, 1:].flatten())
        nll.backward()
        return [nll.item()]

    return student, fit(student, step, token_ids, "direct", settings, **loop)
