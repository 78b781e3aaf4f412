"""Layerwise distillation of PRF features (paper §4), the direct baseline, and their training loop.
Each layer's features learn from the frozen teacher's own q, k of that layer: one teacher pass feeds
every layer, and one layer and one chunk of queries are in memory at a time."""

import dataclasses
import hashlib
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .checkpoint import CheckpointError
from .model import as_token_ids, capture
from .files import as_json, changed_settings
from .students import make_student, read_tensors, save_student, save_tensors, trainable

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """`steps` Adam steps on `batch` windows of ctx tokens drawn with data_seed; lr for z (and
    DiJiang's), lr_a for a = log α (the paper's 0.02, 0.2); `chunk` queries a piece and `dtype` for
    layerwise losses. Progress is saved every save_every steps, logged every log_every (None: a
    tenth); the other fields decide the result (.record())."""

    steps: int = 200
    batch: int = 8
    ctx: int = 256
    lr: float = 0.02
    lr_a: float = 0.2
    data_seed: int = 0
    chunk: int = 256
    dtype: str = "float32"
    save_every: int = 50
    log_every: int | None = None

    def __post_init__(self):
        low = {"steps": 1, "batch": 1, "ctx": 2, "chunk": 1, "save_every": 1, "log_every": 1}
        bad = [f"{n}={v}" for n, m in low.items() if (v := getattr(self, n)) is not None and v < m]
        if bad or self.dtype not in DTYPES:
            raise ValueError(
                f"TrainSettings: need ctx >= 2, the other counts >= 1, dtype in {list(DTYPES)}; "
                f"got {', '.join(bad)} dtype={self.dtype!r}"
            )

    def record(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if not k.endswith("_every")}


def unit_features(features, x, name: str):
    """(Φ(x) over its own largest entry [B, H, T, M], log of that entry [B, H, T, 1] detached), so
    that log K̂ = r_q + r_k + log(unit q · unit k): nothing overflows in float32 and a key far from
    every z keeps its share (a fixed shift per feature, as PRFFeatures.keys applies, loses every
    feature of a key with |k/d^¼ − z_m| ≳ 14 for all m). K̂ is 0 only where unit q · unit k
    underflows (features e^87 apart)."""
    log_phi = features.log_features(x, name)  # [B, H, T, M]
    top = log_phi.amax(-1, keepdim=True).detach()  # [B, H, T, 1]
    return torch.exp(log_phi - top), top


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
    unit_q, top_q = unit_features(features, q[:, :, lo:hi], "q")  # [B, H, c, M], [B, H, c, 1]
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
    q, k, v = (None if t is None else t.to(dtype) for t in (q, k, v))  # [B, H, T, d or dv]
    B, H, T, _ = q.shape
    unit_k, top_k = unit_features(features, k, "k")  # [B, H, T, M], [B, H, T, 1]
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


def _train(student, step_fn, token_ids, what: str, s: TrainSettings, out_path, log, meta):
    """distill's and train_direct's loop: Adam over the student's trainable tensors (`*.a` at
    s.lr_a, the rest at s.lr); step_fn(ids) back-propagates and returns per-layer losses, and a
    non-finite one stops training."""
    if s.ctx > student.config.n_ctx:
        raise ValueError(f"{what}: need ctx <= {student.config.n_ctx}; got ctx={s.ctx}")
    token_ids = as_token_ids(token_ids, s.ctx, what)
    params = trainable(student)
    groups = [{"params": [p for n, p in params.items() if n.endswith(".a") == a], "lr": lr}
              for a, lr in ((False, s.lr), (True, s.lr_a))]  # fmt: skip
    opt = torch.optim.Adam([g for g in groups if g["params"]])
    tokens_hash = hashlib.sha256(token_ids.numpy().tobytes()).hexdigest()[:16]
    student.meta = {**student.meta, **(meta or {}), "loss": what}
    settings = {**student.meta, "teacher": student.identity, **s.record(), "tokens": tokens_hash}
    settings = as_json(settings)  # as a progress file gives it back: no tuples
    gen = torch.Generator().manual_seed(s.data_seed)
    device = next(student.parameters()).device
    progress = Path(f"{out_path}.progress") if out_path else None
    start, seconds, curve = _resume(progress, settings, params, opt, gen, log)
    t0, window = time.time(), []
    for done in range(start + 1, s.steps + 1):
        first = torch.randint(0, len(token_ids) - s.ctx + 1, (s.batch, 1), generator=gen)  # [b, 1]
        losses = step_fn(token_ids[first + torch.arange(s.ctx)].to(device))  # ids [batch, ctx]
        if not all(map(math.isfinite, losses)):
            raise FloatingPointError(f"{what}: per-layer losses {losses} at step {done}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        window.append(losses)
        if report := (done % (s.log_every or max(1, s.steps // 10)) == 0 or done == s.steps):
            mean, window = [sum(col) / len(col) for col in zip(*window)], []  # per layer
            curve.append([done, sum(mean) / len(mean)])
        elapsed = time.time() - t0
        if progress and done % s.save_every == 0 and done < s.steps:
            _save_progress(progress, settings, params, opt, gen, done, seconds + elapsed, curve)
        if report:
            left = elapsed / (done - start) * (s.steps - done)
            losses_text = " ".join(f"{x:.4g}" for x in mean)
            log(f"{what} {done}/{s.steps}: loss {losses_text} ({elapsed:.0f}s, ~{left:.0f}s left)")
    student.train_seconds, student.loss_curve = seconds + time.time() - t0, curve
    if out_path:  # no times in the file: the same settings always give the same bytes
        save_student(student, out_path, {"settings": settings, "loss_curve": curve})
        progress.unlink(missing_ok=True)
    return student


def _save_progress(path, settings, params, opt, gen, done, seconds, curve):
    tensors = {f"param.{n}": p for n, p in params.items()} | {"rng": gen.get_state()}
    for index, state in opt.state_dict()["state"].items():
        tensors |= {f"adam.{index}.{key}": t for key, t in state.items()}
    meta = {"settings": settings, "step": done, "seconds": seconds, "loss_curve": curve}
    save_tensors(tensors, path, meta)


def _resume(path: Path, settings, params, opt, gen, log):
    """(step, seconds, loss curve) of a progress file of the same settings, restoring the tensors,
    Adam and the data generator; (0, 0.0, []) without one, setting aside one of other settings or
    one that cannot be read."""
    if not (path and path.exists()):
        return 0, 0.0, []
    try:
        stored, meta = read_tensors(path)
        changed = changed_settings(meta.get("settings", {}), settings)
        why = changed and f"progress of other settings ({changed} changed)"
    except CheckpointError as err:  # a damaged progress file costs its steps, not the run
        why = f"unreadable ({err})"
    if why:
        log(f"{path}: {why}; starting over")
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
    log(f"{settings['loss']}: resuming from {path} at step {meta['step']}/{settings['steps']}")
    return int(meta["step"]), float(meta["seconds"]), meta["loss_curve"]


def distill(teacher, dims, token_ids, settings: TrainSettings = TrainSettings(), *, loss="softmax",
            feature_seed=0, out_path=None, log=print, meta=None):  # fmt: skip
    """A PRF student (dims[i] features in layer i, seed feature_seed + i), each layer trained with
    `loss` ("l2" or "softmax") on the teacher's q, k for windows of token_ids (1-D). With out_path,
    progress goes atomically to `<out_path>.progress` every settings.save_every steps, a run of the
    same settings resumes from it exactly (train_seconds adds up), and the student is saved to
    out_path with `meta`."""
    if loss not in ("l2", "softmax"):
        raise ValueError(f"distill: loss {loss!r}; expected 'l2' or 'softmax'")
    student = make_student(teacher, "prf", dims, feature_seed)
    term, dtype = "l2" if loss == "l2" else "ce", DTYPES[settings.dtype]

    def step(ids):
        losses = []
        for block, (q, k, _) in zip(student.blocks, capture(teacher, ids)):
            terms = layer_pass(block.attn.features, q, k, None, {term}, settings.chunk, True, dtype)
            losses.append(terms[term].mean())
        return torch.stack(losses).tolist()  # one read from the device per step

    return _train(student, step, token_ids, loss, settings, out_path, log, meta)


def train_direct(student, token_ids, settings: TrainSettings = TrainSettings(), *, out_path=None,
                 log=print, meta=None):  # fmt: skip
    """The direct baseline, in place: the student's next-token cross-entropy on positions 1..ctx-1
    of each window, training its own tensors only. Arguments as for distill."""

    def step(ids):
        logits = student(ids[:, :-1])  # [B, T-1, V]
        nll = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        nll.backward()
        return [nll.item()]

    return _train(student, step, token_ids, "direct", settings, out_path, log, meta)
