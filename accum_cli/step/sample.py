"""Greedy completions of a fixed length (--sample-prompts): what the model writes as it trains.

Collective. Under the sharded layout FSDP2 all-gathers each unit's parameters in its forward, so
every rank runs the same forwards: the same prompts, in the same order, the same number of tokens
each (a fixed length, never cut at EOS, so no rank can stop early and leave the others waiting in
a gather). Every rank computes the same argmax from the same gathered weights; nothing has to be
sent, and rank 0 records its own. The replicated layout does the same: its ranks would only wait
for rank 0 at the next collective otherwise. One prompt at a time (no padding, so a completion
does not depend on the other prompts) with the model's KV cache, where it hands one back.

Nothing the training depends on changes: evaluation mode (no dropout) and no gradients while it
decodes, the CPU's and the device's random states as they were (fork_rng), training mode given back.
The forward is the run's own, so its precision too: bf16 matmuls under --precision bf16 (autocast in
the replicated layout, FSDP2's MixedPrecisionPolicy in the sharded one); the fused loss's head
(fused_loss.py) records only inside a training step and returns real logits here.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn


@torch.no_grad()
def greedy(model: nn.Module, prompts: list[list[int]], tokens: int, device: torch.device) -> list[list[int]]:
    """Collective: the `tokens` most likely next tokens of each prompt, one after the other (ties: the lowest id)."""
    was_training = model.training
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model.eval()
        try:
            return [_complete(model, ids, tokens, device) for ids in prompts]
        finally:
            model.train(was_training)


def _complete(model: nn.Module, prompt: list[int], tokens: int, device: torch.device) -> list[int]:
    sequence = torch.tensor([prompt], dtype=torch.long, device=device)
    keyword, cache, out = cache_keyword(model), None, []
    for _ in range(tokens):
        if cache is None:  # the first token, or a model that hands back no cache: the whole sequence
            output = model(input_ids=sequence, use_cache=True)
        else:
            output = model(input_ids=sequence[:, -1:], use_cache=True, **{keyword: cache})
        cache = output.get(keyword) if hasattr(output, "get") else None
        following = output.logits[:, -1].argmax(dim=-1, keepdim=True)
        sequence = torch.cat([sequence, following], dim=1)
        out.append(following)
    return torch.cat(out, dim=1)[0].tolist() if out else []  # one device-to-host copy per prompt


def cache_keyword(model: nn.Module) -> str:
    """What the model's forward calls its KV cache: `cache` in recent transformers, `past_key_values` before."""
    try:
        names = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in names else "past_key_values"
