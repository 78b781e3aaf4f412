"""Autoregressive generation with per-layer caches.

A KV cache for softmax layers, a fixed-size LinearState for linear-attention layers (whatever each
layer's `new_cache` returns). The prompt is read in one call (chunked form for linear layers), then
each new token costs one call; a linear layer's step is O(M·d) whatever the context.
"""

import torch


@torch.no_grad()
def generate(
    model,
    prompt_ids,
    n: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
):
    """The prompt followed by n new tokens, in the prompt's form and device.

    LongTensor [B, T] -> [B, T + n], [T] -> [T + n]; a list of ints (or of B equal-length lists) ->
    a list of the same nesting.

    temperature == 0 is greedy (argmax; seed and top_k unused). temperature > 0 samples from
    softmax(logits / temperature), restricted to the top_k most likely tokens when top_k is given;
    it needs an explicit seed, so that every run can be repeated exactly.
    """
    as_list = isinstance(prompt_ids, (list, tuple))
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    home, flat = ids.device, ids.dim() == 1
    ids = ids[None] if flat else ids  # [B, T]
    if ids.dim() != 2 or ids.shape[1] < 1 or n < 0:
        raise ValueError(
            f"generate: prompt_ids must be [B, T] or [T] with T >= 1 and n >= 0; "
            f"got shape {tuple(ids.shape)}, n={n}"
        )
    (B, T), limit = ids.shape, model.config.n_ctx
    if T + n > limit:
        raise ValueError(
            f"generate: prompt of {T} tokens + {n} new = {T + n} positions; "
            f"{model.config.name or 'the model'} has n_ctx={limit}"
        )
    if temperature < 0 or (temperature > 0 and seed is None) or (top_k is not None and top_k < 1):
        raise ValueError(
            f"generate: need temperature >= 0, an explicit seed when sampling, top_k >= 1; "
            f"got temperature={temperature}, seed={seed}, top_k={top_k}"
        )
    device = next(model.parameters()).device
    ids = ids.to(device)
    gen = torch.Generator(device).manual_seed(seed) if temperature > 0 else None
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
