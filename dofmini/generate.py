"""Autoregressive generation through each layer's own cache (`new_cache`): a KV cache for softmax
layers, a fixed-size LinearState for linear ones. The prompt is read in one call (chunked form for
linear layers), then each new token costs one call: O(M·d) per linear layer at any context."""

import torch


@torch.no_grad()
def generate(model, prompt_ids, n: int, temperature=0.0, top_k=None, seed=None):
    """The prompt followed by n new tokens, in the prompt's form and device: LongTensor [B, T] ->
    [B, T + n], [T] -> [T + n]; a list of ints (or of B equal-length lists) -> a list alike.
    temperature 0 is greedy (argmax); above 0 it samples from softmax(logits / temperature), over
    the top_k most likely tokens if given, with an explicit seed: every run can be repeated."""
    if not (isinstance(n, int) and n >= 0):
        raise ValueError(f"generate: n={n!r}; expected an integer >= 0")
    if not 0 <= float(temperature) < torch.inf:
        raise ValueError(f"generate: temperature={temperature!r}; expected a finite number >= 0")
    if (temperature > 0 and seed is None) or (top_k is not None and top_k < 1):
        got = f"temperature={temperature}, seed={seed}, top_k={top_k}"
        raise ValueError(f"generate: need an explicit seed when sampling, top_k >= 1; got {got}")
    ids = torch.as_tensor(prompt_ids)
    home = ids.device
    flat = ids.dim() == 1
    as_list = isinstance(prompt_ids, (list, tuple))
    ids = ids[None] if flat else ids  # [B, T]
    if ids.dim() != 2 or ids.shape[1] < 1:
        raise ValueError(f"generate: prompt shape {tuple(ids.shape)}; need [B, T] or [T], T >= 1")
    B, T = ids.shape
    cfg = model.config
    ids = model.token_ids(ids.flatten(), 1, "generate").view(B, T)  # [B, T]
    if T + n > cfg.n_ctx:
        got = f"prompt of {T} tokens + {n} new = {T + n} positions"
        raise ValueError(f"generate: {got}; {cfg.name or 'the model'} has n_ctx={cfg.n_ctx}")
    ids = ids.to(next(model.parameters()).device)
    gen = torch.Generator(ids.device).manual_seed(seed) if temperature > 0 else None
    caches = [block.attn.new_cache(B, T + n) for block in model.blocks]
    out, start = [ids], 0
    for _ in range(n):  # feeds the prompt, then each new token but the last
        logits = model(out[-1], start, caches)[:, -1]  # [B, V]
        start += out[-1].shape[1]
        if gen is None:
            nxt = logits.argmax(-1, keepdim=True)  # [B, 1]
        else:
            scores = logits.float() / temperature  # [B, V]
            if top_k is not None and top_k < scores.shape[-1]:
                kth = scores.topk(top_k, -1).values[:, -1:]  # [B, 1]
                scores = scores.masked_fill(scores < kth, -torch.inf)
            nxt = torch.multinomial(scores.softmax(-1), 1, generator=gen)  # [B, 1]
        out.append(nxt)
    ids = torch.cat(out, 1).to(home)  # [B, T + n]
    ids = ids[0] if flat else ids
    return ids.tolist() if as_list else ids
