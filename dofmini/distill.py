"""Layerwise distillation of PRF features (SPEC §4), the direct baseline, student files and per-layer errors.

Each layer's features learn from the frozen teacher's own q, k of that layer (one teacher pass feeds every
layer; no student layer feeds another). With s_ij = q_i·k_j/√d, m_i = max_{j≤i} s_ij and K̂ = Φ(q)·Φ(k):
- "l2": mean over causal pairs (j ≤ i) of (exp(s_ij − m_i) − K̂_ij·exp(−m_i))². Dividing both kernels by the
  teacher's row max, a per-query scale they share, keeps large-norm heads from overflowing or dominating,
  and needs no normalising sum.
- "softmax": mean over queries of the cross-entropy −Σ_j p_ij log p̂_ij, with p_i = softmax_{j≤i}(s_ij) and
  p̂_ij = K̂_ij / Σ_{j'≤i} K̂_ij'. Per-query scales cancel in p̂, so it is computed from the features as
  PRFFeatures.queries/keys shift them: log p̂_ij = log(φ̂_q,i·φ̂_k,j) − log Σ_j'(φ̂_q,i·φ̂_k,j').
The loss arithmetic runs in float64: a key far from every z has features below fp32's range (e^−87), which
would make log p̂ −inf. Only the student's row sum is clamped (against a row with every value underflowed);
a non-finite loss stops training with an error. Memory: one layer and one chunk of queries (× keys ≤ query)
at a time, each chunk back-propagated at once.
"""

import copy
import hashlib
import importlib
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .checkpoint import CheckpointError
from .linear_attention import replace_attention

BUILDERS = {}  # student kind -> builder(teacher, meta) -> untrained student with .meta, for load_student
LAZY_KINDS = {"dijiang": ".dijiang"}  # modules that register their kind in BUILDERS when imported


def sharing_copy(teacher):
    """A copy of the teacher's modules that shares every tensor: swapping its attention leaves the teacher intact."""
    return copy.deepcopy(teacher, {id(t): t for t in (*teacher.parameters(), *teacher.buffers())})


def make_student(teacher, dims, seed: int, orthogonal: bool = True):
    """The teacher with every attention layer swapped for PRF linear attention (dims[i] features, seed + i),
    sharing the teacher's frozen tensors (none is copied)."""
    student = replace_attention(sharing_copy(teacher), dims, seed, orthogonal)
    student.meta = {
        "kind": "prf",
        "dims": [int(m) for m in dims],
        "seed": seed,
        "orthogonal": orthogonal,
    }
    return student.to(next(teacher.parameters()).device)


BUILDERS["prf"] = lambda teacher, meta: make_student(
    teacher, meta["dims"], meta["seed"], meta["orthogonal"]
)


@torch.no_grad()
def _capture(teacher, ids):
    """Every layer's (q, k, v) [B, H, T, d]; the output head, most of a small model's cost, gets no positions."""
    capture = []
    hook = teacher.ln_f.register_forward_hook(lambda module, inputs, out: out[:, :0])
    try:
        teacher(ids, capture=capture)
    finally:
        hook.remove()
    return capture


def _chunk_terms(features, q, k, v, phi_k, lo, hi, want):
    """Sums over queries lo:hi (keys ≤ each query), per [B, H], of the terms in `want`: "l2" squared scaled
    kernel error, "ce" cross-entropy, "kl" KL(p‖p̂), "err"/"norm" squared output error / output norm."""
    causal = torch.ones(hi - lo, hi, dtype=torch.bool, device=q.device).tril(lo)  # [c, hi]
    s = torch.where(
        causal, q[:, :, lo:hi] @ k[:, :, :hi].mT / math.sqrt(q.shape[-1]), -math.inf
    )  # [B, H, c, hi]
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
        # where p is 0 (above the diagonal, or underflowed) the student's value is not looked at: 0·log 0 would
        # make the gradient NaN
        out["ce"] = (row.log()[..., 0] - (p * torch.where(p > 0, dot, 1).log()).sum(-1)).sum(-1)
        if "kl" in want:
            out["kl"] = out["ce"] + torch.xlogy(p, p).sum((-2, -1))
        if "err" in want:
            y = p @ v[:, :, :hi]  # [B, H, c, dv]
            out["err"], out["norm"] = (
                ((dot / row) @ v[:, :, :hi] - y).square().sum((-2, -1)),
                y.square().sum((-2, -1)),
            )
    return out


def _layer_pass(features, q, k, v, want, chunk: int, train: bool = False):
    """Per-head means [H] of the terms in `want` over one layer's batch (l2 per causal pair, the rest per
    query). train=True back-propagates each chunk's share of the head-mean of the one term in `want`; the
    keys' features are then a detached leaf whose gradient is passed on once, after the last chunk."""
    q, k = q.double(), k.double()  # [B, H, T, d]
    B, H, T, _ = q.shape
    phi_k = features.keys(k)  # [B, H, T, M]
    keys = phi_k.detach().requires_grad_() if train else phi_k
    sums = {}
    for lo in range(0, T, chunk):
        terms = _chunk_terms(features, q, k, v, keys, lo, min(lo + chunk, T), want)
        for name, t in terms.items():
            count = B * T * (T + 1) / 2 if name == "l2" else B * T
            if train:
                (t.sum() / (count * H)).backward()
            sums[name] = sums.get(name, 0) + t.detach().sum(0) / count  # [H]
    if train:
        phi_k.backward(keys.grad)
    return sums


def _tokens(token_ids, need: int, what: str) -> torch.Tensor:
    token_ids = torch.as_tensor(token_ids)
    if token_ids.dim() != 1 or len(token_ids) < need:
        raise ValueError(
            f"{what}: token_ids must be 1-D with >= {need} tokens; got shape {tuple(token_ids.shape)}"
        )
    return token_ids.long().cpu().contiguous()


def _train(
    student,
    step_fn,
    token_ids,
    loss: str,
    steps: int = 200,
    batch: int = 8,
    ctx: int = 256,
    seed: int = 0,
    lr: float = 0.02,
    lr_a: float = 0.2,
    out_path=None,
    save_every: int = 50,
    log=print,
    log_every=None,
    meta=None,
):
    """The loop distill and train_direct share. Adam over the student's trainable tensors (names ending in `.a`
    at lr_a, the rest at lr) on `batch` windows of ctx tokens per step, drawn by a generator seeded with `seed`;
    step_fn(ids) back-propagates and returns per-layer losses. A line per log_every steps (default a tenth).
    With out_path, progress goes atomically to `<out_path>.progress` every save_every steps, a run with the same
    settings resumes from it, and the finished student is saved to out_path (with `meta`, e.g. {"lam": ...})."""
    what = "direct" if loss == "direct" else f"distill {loss}"
    if not 2 <= ctx <= student.config.n_ctx or min(steps, batch, save_every) < 1:
        raise ValueError(
            f"{what}: need 2 <= ctx <= {student.config.n_ctx} and steps, batch, save_every >= 1; "
            f"got ctx={ctx}, steps={steps}, batch={batch}, save_every={save_every}"
        )
    token_ids = _tokens(token_ids, ctx, what)
    params = {n: p for n, p in student.named_parameters() if p.requires_grad}
    groups = [
        ([n for n in params if n.endswith(".a") == is_a], rate)
        for is_a, rate in ((False, lr), (True, lr_a))
    ]
    opt = torch.optim.Adam(
        [{"params": [params[n] for n in names], "lr": rate} for names, rate in groups if names]
    )
    settings = json.loads(
        json.dumps(
            {
                **student.meta,
                **(meta or {}),
                "loss": loss,
                "teacher": student.identity,
                "steps": steps,
                "batch": batch,
                "ctx": ctx,
                "data_seed": seed,
                "lr": lr,
                "lr_a": lr_a,
                "tokens": hashlib.sha256(token_ids.numpy()).hexdigest()[:16],
            }
        )
    )
    gen, device = torch.Generator().manual_seed(seed), next(student.parameters()).device
    progress, start = (Path(f"{out_path}.progress") if out_path else None), 0
    if progress and progress.exists():
        start = _resume(progress, settings, params, opt, gen)
        log(f"{what}: resuming from {progress} at step {start}/{steps}")
    t0, totals, seen, log_every = time.time(), None, 0, log_every or max(1, steps // 10)
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
        totals, seen, done = (
            [x + (totals[i] if seen else 0) for i, x in enumerate(losses)],
            seen + 1,
            step + 1,
        )
        if progress and done % save_every == 0 and done < steps:
            state = opt.state_dict()["state"]
            tensors = {f"adam.{i}.{key}": t for i, st in state.items() for key, t in st.items()}
            tensors.update({f"param.{n}": p for n, p in params.items()}, rng=gen.get_state())
            _atomic_save(tensors, progress, {"settings": json.dumps(settings), "step": str(done)})
        if done % log_every == 0 or done == steps:
            elapsed = time.time() - t0
            log(
                f"{what} {done}/{steps}: loss {' '.join(f'{x / seen:.4g}' for x in totals)} "
                f"({elapsed:.0f}s elapsed, ~{elapsed / (done - start) * (steps - done):.0f}s left)"
            )
            seen = 0
    if out_path:
        save_student(student, out_path, {k: v for k, v in settings.items() if k != "teacher"})
        progress.unlink(missing_ok=True)
    return student


def _resume(path: Path, settings, params, opt, gen) -> int:
    """Load features, Adam state and the data generator from a progress file; returns the step reached."""
    stored, meta = _read(path)
    saved = json.loads(meta["settings"])
    if saved != settings:
        diff = {
            k: (saved.get(k), settings.get(k))
            for k in saved | settings
            if saved.get(k) != settings.get(k)
        }
        raise CheckpointError(
            f"{path} is the progress of a run with other settings {{name: (saved, now)}}: {diff}; "
            f"delete it to start over"
        )
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(stored[f"param.{n}"])
    state = {"state": {}, "param_groups": opt.state_dict()["param_groups"]}
    for name, t in stored.items():
        if name.startswith("adam."):  # adam.{index in the optimiser}.{exp_avg, exp_avg_sq, step}
            state["state"].setdefault(int(name.split(".")[1]), {})[name.split(".")[2]] = t
    opt.load_state_dict(state)
    gen.set_state(stored["rng"])
    return int(meta["step"])


def distill(teacher, dims, token_ids, loss: str = "softmax", chunk: int = 256, **settings):
    """A PRF student (dims[i] features in layer i, drawn with settings' `seed`) whose layers are each trained
    with the "l2" or "softmax" loss (module docstring) on the teacher's q, k for windows of token_ids (1-D).
    `chunk`: queries per piece of the attention matrices. settings: steps, batch, ctx, seed, lr (z), lr_a,
    out_path, save_every, log, log_every, meta, as `_train` takes them. The teacher stays untouched."""
    if loss not in ("l2", "softmax"):
        raise ValueError(f"distill: loss {loss!r}; expected 'l2' or 'softmax'")
    student, term = (
        make_student(teacher, dims, settings.get("seed", 0)),
        "l2" if loss == "l2" else "ce",
    )

    def step(ids):
        return [
            _layer_pass(block.attn.features, q, k, None, {term}, chunk, train=True)[term]
            .mean()
            .item()
            for block, (q, k, _) in zip(student.blocks, _capture(teacher, ids))
        ]

    return _train(student, step, token_ids, loss, **settings)


def train_direct(student, token_ids, **settings):
    """The direct baseline, in place: next-token cross-entropy of the whole student (positions 1..ctx-1 of each
    window), end to end, training only its own tensors (requires_grad). settings as for distill."""

    def step(ids):
        nll = F.cross_entropy(
            student(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten()
        )  # logits [B·(T-1), V]
        nll.backward()
        return [nll.item()]

    return _train(student, step, token_ids, "direct", **settings)


def _atomic_save(tensors: dict, path, metadata: dict):
    tmp = Path(f"{path}.tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, str(tmp), metadata)
    os.replace(tmp, path)


def _read(path):
    try:
        with safe_open(str(path), "pt") as f:
            return {n: f.get_tensor(n) for n in f.keys()}, f.metadata() or {}
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from None


def save_student(student, path, meta=None):
    """A small safetensors file with only the student's trainable tensors; metadata: its kind, dims and seed,
    `meta` (loss, lam, ...) and the teacher's identity, each JSON-encoded."""
    meta = {**student.meta, **(meta or {}), "teacher": student.identity}
    tensors = {n: p for n, p in student.named_parameters() if p.requires_grad}
    _atomic_save(tensors, path, {k: json.dumps(v) for k, v in meta.items()})


def load_student(teacher, path):
    """Rebuild a saved student on `teacher`; refuses a file made for another teacher or with other tensors."""
    stored, raw = _read(path)
    meta = {k: json.loads(v) for k, v in raw.items()}
    if meta.get("teacher") != teacher.identity:
        raise CheckpointError(
            f"{path} holds a student of teacher {meta.get('teacher')!r}; this teacher is "
            f"{teacher.identity!r}"
        )
    kind = meta.get("kind")
    if kind in LAZY_KINDS and kind not in BUILDERS:
        importlib.import_module(LAZY_KINDS[kind], __package__)
    if kind not in BUILDERS:
        raise CheckpointError(
            f"{path}: student kind {kind!r} unknown; known kinds: {sorted(BUILDERS)}"
        )
    student = BUILDERS[kind](teacher, meta)
    params = {n: p for n, p in student.named_parameters() if p.requires_grad}
    for n in params.keys() | stored.keys():
        want, got = (
            tuple(params[n].shape) if n in params else None,
            tuple(stored[n].shape) if n in stored else None,
        )
        if want != got:
            raise CheckpointError(
                f"{path}: tensor {n!r} has shape {got}, the {kind} student expects {want}"
            )
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(stored[n])
    student.meta = {k: v for k, v in meta.items() if k != "teacher"}
    return student


@torch.no_grad()
def layer_errors(
    teacher, student, token_ids, ctx: int = 256, batches: int = 2, batch: int = 4, chunk: int = 256
):
    """Per-layer approximation error on the first batches·batch disjoint windows of ctx tokens of token_ids,
    from the teacher's q, k, v, each a list over layers of the mean over heads: "kernel_l2" (the l2 loss),
    "kl" (KL(p‖p̂) per query) and "output_rel" (‖ŷ − y‖/‖y‖ of the per-head attention outputs before the
    output projection). None where a layer's module has no PRF `features` (kernel metrics) or neither
    `features` nor a `mix(q, k, v) -> [B, H, T, d]` method (output_rel)."""
    token_ids = _tokens(token_ids, batches * batch * ctx, "layer_errors")
    windows = (
        token_ids[: batches * batch * ctx]
        .view(batches, batch, ctx)
        .to(next(teacher.parameters()).device)
    )
    sums = [{} for _ in student.blocks]
    for ids in windows:
        for acc, block, (q, k, v) in zip(sums, student.blocks, _capture(teacher, ids)):
            attn = block.attn
            terms = {}
            if hasattr(attn, "features"):
                terms = _layer_pass(attn.features, q, k, v.double(), {"l2", "kl", "err"}, chunk)
            elif hasattr(attn, "mix"):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True).double()  # [B, H, T, d]
                terms = {
                    "err": (attn.mix(q, k, v).double() - y).square().sum((0, 2, 3)),
                    "norm": y.square().sum((0, 2, 3)),
                }
            for name, t in terms.items():
                acc[name] = acc.get(name, 0) + t  # [H]
    mean = lambda acc, name: acc[name].mean().item() / batches if name in acc else None  # noqa: E731
    return {
        "kernel_l2": [mean(acc, "l2") for acc in sums],
        "kl": [mean(acc, "kl") for acc in sums],
        "output_rel": [
            (acc["err"] / acc["norm"]).sqrt().mean().item() if "err" in acc else None
            for acc in sums
        ],
    }
