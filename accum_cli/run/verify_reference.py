"""The one-process reference of `accum-train verify`, deliberately simple and apart from the code it
checks: the plain Hugging Face model (no FSDP, no fused loss, no CPU kernels, no sync flags), built
from the same initial weights, the step's samples in a few forwards on one process, each
forward's summed token loss divided by the step's loss-token count, backward, clipping, AdamW and
the run's schedule. bf16 as tests/test_equivalence_bf16.py's reference: autocast over fp32 weights."""

from __future__ import annotations

import contextlib
import re

import torch
import torch.nn.functional as F

from accum_cli.config.settings import TrainConfig
from accum_cli.data.batches import MicrobatchReader, SampleOrder
from accum_cli.data.store import IGNORE_INDEX
from accum_cli.model import lora, moe
from accum_cli.model.load import load_model
from accum_cli.run.data_setup import pad_id_of
from accum_cli.run.setup import Setup
from accum_cli.step import optim

# Wrappers that compile and activation checkpointing put into a parameter's name.
_WRAPPER_PARTS = re.compile(r"(^|\.)(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)(?=\.)")


def plain_name(name: str) -> str:
    """A parameter's name as the plain Hugging Face model has it."""
    return _WRAPPER_PARTS.sub("", name).lstrip(".")


def forwards(first: int, global_batch: int, per_forward: int) -> list[range]:
    """The step's global sample indices, `per_forward` at a time."""
    end = first + global_batch
    return [range(start, min(start + per_forward, end)) for start in range(first, end, per_forward)]


def one_process(s: Setup, cfg: TrainConfig, per_forward: int, bf16: bool):
    """The reference built: its initial parameters, and `take_step(step)`, which runs optimizer step
    `step` (from 0) and returns (loss, grad norm, {name: fp32 CPU copy of the parameter after the step},
    {name: its gradient's norm as AdamW received it})."""
    device = s.rt.device
    model = lora.apply(load_model(s.source, s.model_config, cfg.trust_remote_code, cfg.seed), cfg).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        foreach=False,
    )
    scheduler = optim.schedule(optimizer, cfg, s.total_steps)
    reader = MicrobatchReader(s.dataset, SampleOrder(len(s.dataset), cfg.seed), pad_id_of(s.tokenizer, s.model_config))
    coef = moe.aux_loss_coef(s.model_config)
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    G = s.plan.global_batch

    def take_step(step: int) -> tuple[float, float, dict[str, torch.Tensor], dict[str, float]]:
        batches = [reader.read(indices).to(device) for indices in forwards(step * G, G, per_forward)]
        loss_tokens = sum(mb.loss_tokens for mb in batches)
        total = 0.0
        for mb in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
            logits = out.logits[:, :-1].float()
            ce = F.cross_entropy(
                logits.reshape(-1, logits.size(-1)),
                mb.labels[:, 1:].reshape(-1),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
            loss = ce / loss_tokens
            if coef:  # the model's own balancing loss over the whole batch (one forward: see verify.py)
                loss = loss + coef * out.aux_loss.float()
            loss.backward()
            total += float(loss.detach())
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        gradients = {plain_name(n): float(p.grad.norm()) for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return total, norm, copies(model), gradients

    return copies(model), take_step


def copies(model) -> dict[str, torch.Tensor]:
    return {plain_name(n): p.detach().float().cpu().clone() for n, p in model.named_parameters()}
