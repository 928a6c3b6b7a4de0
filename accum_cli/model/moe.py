"""Mixture-of-experts: the router's load-balancing loss, honoured under accumulation.

A model whose config sets `output_router_logits` adds `router_aux_loss_coef x aux` to its
loss (transformers' `load_balancing_loss_func`, the same in Mixtral, Qwen2/3-MoE and OLMoE):

    aux = E * sum_i (C_i / R) * (S_i / R)

over the unpadded tokens of the batch and all MoE layers: `C_i` counts the top-k choices of
expert `i`, `S_i` sums its router probabilities, `R` counts (token, layer) rows, `E` experts.
accum-train computes its own cross-entropy, so it adds this term itself, in one of two ways:

- exact (default): only `S` carries gradient and `aux` is linear in `S` once `C` is fixed, so
  with the step's global `C` and `R` known, each microbatch's `E * sum_i C_i * S_i / R**2` sums
  to the one-big-batch value and gradient exactly. `C` depends on the routing of every
  microbatch, so it is counted first, in a forward pass without gradient over the step's
  microbatches, all-reduced over ranks ("global-batch load balancing", made exact). Cost: one
  extra forward per microbatch; none when the whole step is one microbatch.
- microbatch: each microbatch's own `aux`, weighted by its share of the global unpadded tokens.
  No extra work, but not exact: a product of two batch averages is not a sum over microbatches.
"""

from __future__ import annotations

import inspect
import sys

import torch

from accum_cli.config.settings import MOE_AUX_LOSSES
from accum_cli.errors import UserError
from accum_cli.parallel.runtime import all_reduce_sum

EXACT, MICROBATCH = MOE_AUX_LOSSES


def aux_loss_coef(config) -> float:
    """The weight of the router's balancing loss in the training loss; 0 when the model has none."""
    if config is None or not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def describe(config, mode: str) -> str | None:
    """The header's line about the balancing loss, for models that have a router."""
    if not hasattr(config, "router_aux_loss_coef"):
        return None
    coef = aux_loss_coef(config)
    if coef == 0:
        return "off (the model config's output_router_logits is false or its coefficient 0)"
    if mode == EXACT:
        how = "exact: expert choices counted over the whole step first (one extra forward without gradient)"
    else:
        how = "each microbatch's own, weighted by its token share (approximate under accumulation, see docs/MODELS.md)"
    return f"{coef:g} x load balancing, {how}"


def _experts(config) -> tuple[int, int]:
    n_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not (isinstance(n_experts, int) and isinstance(top_k, int)):
        raise unsupported(config)
    return n_experts, top_k


def unsupported(config) -> UserError:
    return UserError(
        f"{config.model_type}: the model's router loss is not transformers' load_balancing_loss_func, "
        "so its exact share cannot be computed here; pass --moe-aux-loss microbatch"
    )


# transformers' load_balancing_loss_func (Mixtral and the models that copy it): the formula above.
STANDARD_SIGNATURE = ["gate_logits", "num_experts", "top_k", "attention_mask"]


def check_exact(config, mode: str, model_class: type | None) -> None:
    """Before any work: exact mode computes transformers' load_balancing_loss_func itself, so a model
    class whose module balances with another function (Doge's product-key router takes num_keys)
    is refused here. One that keeps the signature but not the formula is still caught on the first
    microbatch, where our value is checked against the model's own (loop.balancing_term); so is a
    model that ships its own code (model_class None)."""
    if mode != EXACT or aux_loss_coef(config) == 0 or model_class is None:
        return
    _experts(config)
    func = getattr(sys.modules[model_class.__module__], "load_balancing_loss_func", None)
    if func is None or list(inspect.signature(func).parameters) != STANDARD_SIGNATURE:
        raise unsupported(config)


def router_stats(
    config, router_logits, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(C, S, R) of one microbatch: expert choices, router probability sums, rows; padding excluded."""
    n_experts, top_k = _experts(config)
    if not (
        isinstance(router_logits, tuple) and all(t.shape == (attention_mask.numel(), n_experts) for t in router_logits)
    ):
        raise unsupported(config)  # not one (rows, experts) tensor per layer, as load_balancing_loss_func reads them
    mask = attention_mask.reshape(-1).float()
    choices = torch.zeros(n_experts, device=mask.device)
    prob_sums = torch.zeros(n_experts, device=mask.device)
    for logits in router_logits:
        probs = torch.softmax(logits, dim=-1)  # in the logits' dtype, as transformers does (bf16 ties alike)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        choices = choices.scatter_add(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
        prob_sums = prob_sums + (probs.float() * mask[:, None]).sum(0)
    return choices, prob_sums, mask.sum() * len(router_logits)


def balancing_loss(choices: torch.Tensor, prob_sums: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """E * sum_i C_i * S_i / R**2: with one microbatch's C and R its own aux; with the step's, its exact share."""
    return len(choices) * (choices.to(prob_sums.dtype) * prob_sums).sum() / rows.to(prob_sums.dtype) ** 2


@torch.no_grad()
def step_choices(model, config, microbatches, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective. The global (C, R) of the step: one forward without gradient per microbatch."""
    n_experts, _ = _experts(config)
    totals = torch.zeros(n_experts + 1, dtype=torch.float64, device=device)  # counts past 2**24 stay exact
    for mb in microbatches:  # every rank runs the same number, placeholders too: FSDP's all-gathers match
        mb = mb.to(device)
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
        if not mb.empty:
            choices, _, rows = router_stats(config, out.router_logits, mb.attention_mask)
            totals += torch.cat([choices, rows.reshape(1)]).double()
    totals = all_reduce_sum(totals)
    return totals[:-1], totals[-1]
