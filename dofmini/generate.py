"""Autoregressive generation through each layer's own cache (`new_cache`): a KV cache for softmax
layers, a fixed-size LinearState for linear ones. The prompt is read in one call (chunked form for
linear layers), then each new token costs one call: O(M·d) per linear layer at any context."""

import math

import torch


@torch.no_grad()
def generate(model, prompt_ids, n: int, temperature=0.0, top_k=None, seed=None):
    """The prompt followed by n new tokens, in the prompt's form and device: LongTensor [B, T] ->
    [B, T + n], [T] -> [T + n]; a list of ints (or of B equal-length lists) -> a list alike.
    temperature 0 is greedy (argmax; seed and top_k unused); above 0 it samples from
    softmax(logits / temperature), over the top_k most likely tokens when top_k is given, and needs
    an explicit seed so that every run can be repeated exactly."""
    if not (isinstance(n, int) and n >= 0):
        raise ValueError(f"generate: n={n!r}; expected an integer >= 0")
    if not 0 <= float(temperature) < math.inf:
        raise ValueError(f"generate: temperature={temperature!r}; expected a finite number >= 0")
    as_list = isinstance(prompt_ids, (list, tuple))
    ids = torch.as_tensor(prompt_ids)
    home, flat = ids.device, ids.dim() == 1
    ids = ids[None] if flat else ids  # [B, T]
    if ids.dim() != 2 or ids.shape[1] < 1:
        got = f"shape {tuple(ids.shape)}"
        raise ValueError(f"generate: need prompt_ids [B, T] or [T], T >= 1; got {got}")
    (B, T), cfg = ids.shape, model.config
    ids = model.token_ids(ids.flatten(), 1, "generate").view(B, T)  # [B, T]
    if T + n > cfg.n_ctx:
        got = f"prompt of {T} tokens + {n} new = {T + n} positions"
        raise ValueError(f"generate: {got}; {cfg.name or 'the model'} has n_ctx={cfg.n_ctx}")
    if (temperature > 0 and seed is None) or (top_k is not None and top_k < 1):
        got = f"temperature={temperature}, seed={seed}, top_k={top_k}"
        need = "temperature >= 0, an explicit seed when sampling, top_k >= 1"
        raise ValueError(f"generate: need {need}; got {got}")
    ids = ids.to(next(model.parameters()).device)
    gen = torch.Generator(ids.device).manual_seed(seed) if temperature > 0 else None
    caches = [block.attn.new_cache(B, T + n) for block in model.blocks]
    out = [ids]
    logits = model(ids, 0, caches)[:, -1]  # [B, V]
    for t in range(T, T + n):
        if gen is None:
            nxt = logits.argmax(-1, keepdim=True)  # [B, 1]
        else:
            scores = logits.float() / temperature  # [B, V]
            if top_k is not None and top_k < scores.shape[-1]:
                kth = scores.topk(top_k, -1).values[:, -1:]  # [B, 1]
                scores = scores.masked_fill(scores < kth, -torch.inf)
            nxt = torch.multinomial(scores.softmax(-1), 1, generator=gen)  # [B, 1]
        out.append(nxt)
        if t + 1 < T + n:  # the last token needs no forward pass
            logits = model(nxt, t, caches)[:, -1]  # [B, V]
    ids = torch.cat(out, 1).to(home)  # [B, T + n]
    ids = ids[0] if flat else ids
    return ids.tolist() if as_list else ids
