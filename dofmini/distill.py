"""Layerwise distillation of PRF features (paper §4), the direct baseline, and their training loop.
Each layer's features learn from the frozen teacher's q, k of that layer alone: distill trains a
whole student in one pass, distill_layers any (layer, M) pairs (the same tensors, bit for bit)."""

import dataclasses
import math
import time

import torch
import torch.nn.functional as F

from .checks import need_integers, need_one_of, need_positive
from .linear_attention import LinearAttention
from .log_space import unit_features
from .students import make_student, trainable

DTYPES = {"float32": torch.float32, "float64": torch.float64}
TERMS = {"l2": "l2", "softmax": "ce"}  # each layerwise loss's term in chunk_terms


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """`steps` Adam steps on `batch` windows of ctx tokens (data_seed); lr for z (and DiJiang's),
    lr_a for a = log α (paper: 0.02, 0.2); `chunk`: queries a piece, `dtype`: layerwise losses'; a
    log line every log_every (None: 1/10); `part`: windows a backward (fit's `share`; None: all)."""

    steps: int = 200
    batch: int = 8
    ctx: int = 256
    lr: float = 0.02
    lr_a: float = 0.2
    data_seed: int = 0
    part: int | None = None
    chunk: int = 256
    dtype: str = "float32"
    log_every: int | None = None

    def __post_init__(self):
        what = "TrainSettings"
        need_integers(what, steps=self.steps, batch=self.batch, chunk=self.chunk)
        need_integers(what, 2, ctx=self.ctx)  # a token to predict the next of
        need_positive(what, lr=self.lr, lr_a=self.lr_a)
        need_one_of(what, DTYPES, dtype=self.dtype)
        counts = {"part": self.part, "log_every": self.log_every}  # each None or a count
        need_integers(what, **{n: x for n, x in counts.items() if x is not None})


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
    # below float's least normal number dot has lost digits, and 1/dot (log's gradient) overflows
    seen = causal & (dot > torch.finfo(dot.dtype).tiny)  # [B, H, c, hi]
    # log K̂ − top_q, −inf above the diagonal and where dot underflowed (log 1 keeps grads finite)
    log_dot = torch.where(seen, dot, 1).log()  # [B, H, c, hi]
    log_k = torch.where(seen, log_dot + top_k[:, :, :hi].mT, -math.inf)
    lost = causal & ~seen & (kern > 0)  # [B, H, c, hi] the teacher attends, K̂ underflowed
    log_k = exact_where_lost(features, log_q, top_q, k[:, :, :hi], log_k, lost)
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
            out["err"] = (y_hat - y).square().sum((-2, -1))
            out["norm"] = y.square().sum((-2, -1))
    return out


def exact_where_lost(features, log_q, top_q, k, log_k, lost):
    """log_k with its `lost` pairs [B, H, c, hi] in log space, log Σ_m Φ_im Φ_jm − top_q: large
    q·k (issue 45) leaves unit features no shared m, so a pair the teacher attends to lost."""
    if not lost.any():  # the common case: no pair lost, nothing recomputed
        return log_k
    b, h, i, j = lost.nonzero(as_tuple=True)  # [n] each
    log_keys = features.log_features(k, "k")  # [B, H, hi, M]
    pairs = log_q[b, h, i] + log_keys[b, h, j]  # [n, M]
    exact = pairs.logsumexp(-1) - top_q[b, h, i, 0]  # [n]
    return log_k.index_put((b, h, i, j), exact)


def layer_chunks(features, q, k, v, unit_k, top_k, want: set, chunk: int):
    """Per chunk of queries, {term: (its sums [B, H], its mean's count)} (l2 per causal pair)."""
    B, _, T, _ = q.shape
    pairs = B * T * (T + 1) / 2
    for lo in range(0, T, chunk):
        hi = min(lo + chunk, T)
        terms = chunk_terms(features, q, k, v, unit_k, top_k, lo, hi, want)
        yield {n: (t, pairs if n == "l2" else B * T) for n, t in terms.items()}


def add_means(sums: dict, terms: dict):
    """Adds each chunk term's share of its per-head mean [H] to sums[term]."""
    for name, (t, count) in terms.items():
        sums[name] = sums.get(name, 0) + t.detach().sum(0) / count


def layer_backward(features, q, k, term: str, chunk: int) -> torch.Tensor:
    """Back-propagates one layer's head-mean `term` chunk by chunk, one chunk's graph in memory
    at a time: the keys' unit features enter each chunk's graph as a detached leaf, whose summed
    gradient goes through the features once, last. Returns the per-head means [H]."""
    unit_k, top_k = unit_features(features.log_features(k, "k"))  # [B, H, T, M], [.., 1]
    leaf = unit_k.detach().requires_grad_()  # [B, H, T, M]
    sums = {}
    for terms in layer_chunks(features, q, k, None, leaf, top_k, {term}, chunk):
        t, count = terms[term]
        (t.sum() / (count * q.shape[1])).backward()
        add_means(sums, terms)
    unit_k.backward(leaf.grad)
    return sums[term]


@dataclasses.dataclass
class TrainState:
    """A training's state, for a harness that saves and resumes it; curve: [[step, the mean
    over layers, [each layer's mean]]] at each logged step."""

    params: dict
    opt: torch.optim.Adam
    gen: torch.Generator
    step: int = 0
    curve: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def adam(params: dict, s: TrainSettings) -> torch.optim.Adam:
    """Adam over `params`: each `*.a` (a = log α) at s.lr_a, the rest at s.lr."""
    z_rate = [p for n, p in params.items() if not n.endswith(".a")]
    a_rate = [p for n, p in params.items() if n.endswith(".a")]
    groups = [{"params": z_rate, "lr": s.lr}, {"params": a_rate, "lr": s.lr_a}]
    return torch.optim.Adam([g for g in groups if g["params"]])


def fit(model, params, backward, tokens, what, s, share=None, log=print, resume=None, on_step=None):
    """The loop: draw a batch of windows of `model`'s token ids (s.data_seed), back-propagate it
    (backward(ids) on the whole batch, or by parts share(backward, params, s.part) makes, e.g.
    devices.shared's; an inf or NaN loss stops it), Adam steps `params`, logs each loss (past 8:
    mean, range). resume(state) may restore a saved TrainState first; on_step(state) sees it after
    each step, before the log. Returns {"train_seconds" (all runs), "loss_curve", "layer_curves"}"""
    n_ctx = model.config.n_ctx
    if s.ctx > n_ctx:
        raise ValueError(f"{what}: need ctx <= {n_ctx}; got ctx={s.ctx}")
    if share is None and s.part is not None:
        raise ValueError(f"{what}: part={s.part} needs a `share` to split the batch")
    token_ids = model.token_ids(tokens, s.ctx, what)
    step = backward if share is None else share(backward, list(params.values()), s.part)
    gen = torch.Generator().manual_seed(s.data_seed)
    state = TrainState(params, adam(params, s), gen)
    if resume:
        resume(state)
    start = state.step
    before = state.seconds
    t0 = time.time()
    window = []
    every = s.log_every or max(1, s.steps // 10)
    device = next(iter(params.values())).device
    offsets = torch.arange(s.ctx)  # [ctx]
    last_first = len(token_ids) - s.ctx
    for done in range(start + 1, s.steps + 1):
        first = torch.randint(0, last_first + 1, (s.batch, 1), generator=gen)  # [B, 1]
        ids = token_ids[first + offsets].to(device)  # [B, ctx]
        losses = step(ids)  # per layer
        if not all(map(math.isfinite, losses)):
            raise FloatingPointError(f"{what}: per-layer losses {losses} at step {done}")
        state.opt.step()
        state.opt.zero_grad(set_to_none=True)
        window.append(losses)
        state.step = done
        state.seconds = before + time.time() - t0
        report = done % every == 0 or done == s.steps
        if report:
            mean = [sum(col) / len(col) for col in zip(*window)]  # per layer
            overall = sum(mean) / len(mean)
            state.curve.append([done, overall, mean])
            window = []
        if on_step:
            on_step(state)
        if report:
            elapsed = state.seconds - before
            left = elapsed / (done - start) * (s.steps - done)
            many = f"{overall:.4g} (mean of {len(mean)}: {min(mean):.4g}-{max(mean):.4g})"
            text = " ".join(f"{x:.4g}" for x in mean) if len(mean) <= 8 else many
            log(f"{what} {done}/{s.steps}: loss {text} ({elapsed:.0f}s, ~{left:.0f}s left)")
    curve = [[step, mean] for step, mean, _ in state.curve]
    layers = [[step, means] for step, _, means in state.curve]
    return {"train_seconds": state.seconds, "loss_curve": curve, "layer_curves": layers}


def distill(teacher, dims, token_ids, settings=TrainSettings(), *, loss="softmax", **loop):
    """(A PRF student, its record): dims[i] features in layer i, seed feature_seed + i (default
    0), each trained by `loss` ("l2" or "softmax") on the teacher's q, k of layer i, all from one
    teacher pass; the rest of `loop`: fit's keywords (share, log, resume, on_step)."""
    seed = loop.get("feature_seed", 0)
    student = make_student(teacher, "prf", dims, seed)  # bad dims refused before training
    pairs = list(enumerate(dims))
    trained, record = distill_layers(teacher, pairs, token_ids, settings, loss=loss, **loop)
    for (i, _), features in trained.items():
        student.blocks[i].attn.features.load_state_dict(features.state_dict())
    record.pop("layer_curves")
    return student, record


def distill_layers(teacher, pairs: list, token_ids, settings, *, loss, **loop):
    """({(layer, M): its PRF features}, their record) for (layer, M) `pairs`: the tensors distill
    gives layer `layer` with M features in any student (seed feature_seed + layer, the same
    windows, Adam per tensor, each pair's `loss` on its layer's q, k alone), all from one teacher
    pass run up to the deepest."""
    n_layer = teacher.config.n_layer
    for layer, _ in pairs:
        if not 0 <= layer < n_layer:
            raise ValueError(f"distill_layers: layer {layer}; the teacher has 0..{n_layer - 1}")
    need_one_of("layerwise distillation", TERMS, loss=loss)
    seed = loop.pop("feature_seed", 0)
    make = lambda i, m: LinearAttention(teacher.blocks[i].attn, m, seed + i).features
    layers = {(i, m): make(i, m) for i, m in pairs}
    named = torch.nn.ModuleDict({f"layer{i}_m{m}": f for (i, m), f in layers.items()})
    params = dict(named.named_parameters())  # layer{i}_m{M}.{z, a}
    dtype = DTYPES[settings.dtype]
    upto = max(i for i, _ in pairs) + 1  # the teacher runs up to the deepest layer

    def backward(ids):
        captured = teacher.capture(ids, upto=upto)
        losses = []
        for (index, _), features in layers.items():
            q, k = (t.to(dtype) for t in captured[index][:2])  # [B, H, T, d] each
            means = layer_backward(features, q, k, TERMS[loss], settings.chunk)  # [H]
            losses.append(means.mean())
        return torch.stack(losses).tolist()  # one read from the device per step

    what = f"{loss}, {len(layers)} (layer, M)"
    return layers, fit(teacher, params, backward, token_ids, what, settings, **loop)


def train_direct(student, token_ids, settings=TrainSettings(), **loop):
    """(The student, its record), trained in place by the direct baseline (arguments as distill's):
    its next-token cross-entropy on positions 1..ctx-1 of each window, its own tensors only."""

    def backward(ids):
        logits = student(ids[:, :-1]).flatten(0, 1).float()  # [B * (T-1), V]
        nll = F.cross_entropy(logits, ids[:, 1:].flatten())
        nll.backward()
        return [nll.item()]

    params = trainable(student)
    record = fit(student, params, backward, token_ids, "direct", settings, **loop)
    record.pop("layer_curves")
    return student, record
