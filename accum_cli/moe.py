"""Mixture-of-experts: the router's load-balancing loss, honoured under accumulation.

A model whose config sets `output_router_logits` adds `router_aux_loss_coef x aux` to its
loss (transformers' `load_balancing_loss_func`): `aux = E * sum_i f_i * P_i`, where `f_i` is
the share of routed (token, layer) slots that chose expert `i` and `P_i` the mean router
probability of expert `i`, both averaged over the unpadded tokens of the batch. accum-train
computes its own cross-entropy, so it adds this term itself.

It cannot be exact under accumulation: `f` and `P` are batch averages and their product is
not a sum over microbatches. Each microbatch's own `aux` is weighted by its share of the
global unpadded tokens, which equals the one-big-batch value when every microbatch routes
alike and stays close otherwise (README gives the measured difference). The cross-entropy
part stays exact.
"""

from __future__ import annotations


def aux_loss_coef(config) -> float:
    """The weight of the router's balancing loss in the training loss; 0 when the model has none."""
    if config is None or not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def describe(config) -> str | None:
    """The header's line about the balancing loss, for models that have a router."""
    if not hasattr(config, "router_aux_loss_coef"):
        return None
    coef = aux_loss_coef(config)
    if coef == 0:
        return "off (the model config's output_router_logits is false or its coefficient 0)"
    return (
        f"{coef:g} x load balancing, each microbatch's own weighted by its share of the unpadded tokens "
        "(cross-entropy exact; the balancing term approximate under accumulation, see README)"
    )
