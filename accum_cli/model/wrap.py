"""The model made parallel: sharded with FSDP2 `fully_shard` (each decoder layer, the vocabulary
matrices as units of their own where they can be, then the root) or built whole on every rank
(the replicated layout), with the loss's and the gradients' machinery installed."""

from __future__ import annotations

import re
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from accum_cli.cpu import kernels
from accum_cli.cpu import linear as cpu_linear
from accum_cli.cpu.gloo import InPlaceReduceScatter
from accum_cli.loss import fused_loss, vocab_parallel
from accum_cli.model import lora
from accum_cli.model.compiling import compile_layers, prepare_compile
from accum_cli.model.load import ModelSource, build_fp32, decoder_layers, load_model
from accum_cli.parallel import grad_use
from accum_cli.parallel.sharding import ShardSettings


def _copy_view_outputs(module: nn.Module, args, output):
    """Forward hook: a layer output that is a view (OPT returns `(residual + h).view(shape)`)
    becomes a tensor of its own. FSDP2 registers its pre-backward hook (which all-gathers the
    layer's parameters for backward) on the outputs, and an in-place op on a view would drop
    that hook silently; FSDP2 warns about it on every step. A copy of the activations of one
    layer removes the hazard for every consumer and layout, and the warning with it."""
    if isinstance(output, torch.Tensor):
        return output.clone() if output._base is not None else output
    if isinstance(output, tuple):
        return tuple(t.clone() if isinstance(t, torch.Tensor) and t._base is not None else t for t in output)
    return output


def _eager_kernels_and_fused_loss(model: nn.Module, settings: ShardSettings, device: torch.device) -> bool:
    """The CPU's eager kernels (cpu/: an fp32 CPU run whose layers stay eager; compiled, they fuse the
    norm's ops and choose their GEMMs themselves; on CUDA the model's own modules run), then the
    fused loss (fused_loss.py, fp32 and bf16 alike), whose probe runs the model once: before any layer is
    compiled, so that the probe is not the compiled layers' first call. Returns whether the loss is fused."""
    if device.type == "cpu" and not settings.compile and not settings.bf16:
        kernels.fuse_rms_norms(model)
        cpu_linear.use_onednn(model)
    return fused_loss.install(model, device)


def compute_in_bf16(model: nn.Module, device: torch.device) -> None:
    """The replicated layout's bf16 mixed precision, as DDP with AMP does it: the parameters stay
    fp32 (the master weights), their gradients accumulate and are summed over ranks in fp32, and the
    forward runs under autocast, which computes the matmuls in bf16 from bf16 copies of the weights
    (made once per forward). The sharded layout gets the same from FSDP2's MixedPrecisionPolicy."""
    model.forward = torch.autocast(device.type, dtype=torch.bfloat16)(model.forward)


def prepare_replicated(model: nn.Module, settings: ShardSettings, device: torch.device) -> nn.Module:
    """What the replicated layout adds to a whole model (the run's and the memory estimate's)."""
    _eager_kernels_and_fused_loss(model, settings, device)
    if settings.bf16:
        compute_in_bf16(model, device)
    if settings.compile:
        compile_layers(model)
    elif settings.compile_auto:
        prepare_compile(model)
    if settings.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def shard(model: nn.Module, mesh, settings: ShardSettings) -> nn.Module:
    """fully_shard each decoder layer, then the root; gradients are summed, never averaged.

    On a 2-D mesh (replicate, shard) fully_shard gives HSDP."""
    fused = _eager_kernels_and_fused_loss(model, settings, torch.device(mesh.device_type))
    if settings.compile:  # before fully_shard: its hooks then wrap the compiled forward, eager
        compile_layers(model)
    elif settings.compile_auto:
        prepare_compile(model)
    if settings.activation_checkpointing:
        # Inside each layer's forward, so FSDP's hooks re-gather the layer for the recompute.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kwargs = {"mesh": mesh, "reshard_after_forward": settings.reshard_after_forward}
    if settings.bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if settings.offload_params:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        layer.register_forward_hook(_copy_view_outputs)  # before fully_shard: runs before FSDP's own hook
        fully_shard(layer, **kwargs)
    embedding, head = edge_units(model)
    if embedding is not None:
        lookup_only = type(embedding).forward is nn.Embedding.forward
        fully_shard(embedding, **kwargs)
        if lookup_only:  # its backward scatters the output's gradient into rows, never reading the weight,
            embedding.set_unshard_in_backward(False)  # so gathering it there would only add to the step's peak
    if head is not None:  # its backward follows its forward at once: resharding between them only re-gathers
        fully_shard(head, **(kwargs | {"reshard_after_forward": False}))
    # The fused loss reads the output projection's weight after the forward; where the root holds
    # it (tied), the root keeps its parameters until its backward, which gathers them first anyway.
    fully_shard(model, **(kwargs | {"reshard_after_forward": False} if fused else kwargs))
    # FSDP2 leaves a parameter without a gradient on this rank (an expert no token of this rank
    # reached) out of its reduce-scatter, so the ranks' collectives would differ in size: gloo
    # aborts, NCCL hangs. Zeros in its place keep them alike and add nothing to the sum; one that
    # no rank had a gradient for gets none back at the step's end (grad_use.py).
    if hasattr(model, "set_reduce_scatter_unused_params"):  # torch >= 2.9
        model.set_reduce_scatter_unused_params(True)
    # One shard dimension: the vocabulary matrices are used where they lie (vocab_parallel.py), the
    # head where the loss is fused.
    # Not under LoRA: the vocabulary matrices are frozen there, and the plain path is the one tested.
    if vocab_parallel.qualifies(mesh, settings.offload_params, settings.bf16) and not lora.adapted(model):
        plain = embedding if embedding is not None and vocab_parallel.plain_lookup(embedding) else None
        vocab_parallel.install(model, mesh.get_group(), plain, head if fused else None, fused_loss.recording_sharded)
    grad_use.track(model, vocab_parallel.born_sharded(model))
    # The root's outputs (logits, router loss) are read only by our loss code, which never changes
    # them in place, so a view among them (Doge's) cannot drop FSDP2's pre-backward hook.
    root_view_warning = f"FSDP2-wrapped module ({type(model).__name__}) returned a view tensor"
    warnings.filterwarnings("ignore", message=re.escape(root_view_warning))
    # The loss is already divided by the global loss-token count, so FSDP must sum across
    # ranks instead of averaging. The divide factor is per module (not recursive). Gloo has
    # no PREMUL_SUM, so there the factor 1.0 also needs forced SUM reductions (docs/ARCHITECTURE.md).
    gloo = dist.get_backend() == "gloo"
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if gloo:
                module.set_force_sum_reduction_for_comms(True)
                module.set_custom_reduce_scatter(InPlaceReduceScatter())
    return model


def edge_units(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """The input embedding and the output projection, each where it can be an FSDP unit of its own:
    parameters of its own (a tied weight is one parameter, which only one unit can hold), held by
    no other module. Left in the root, they stay gathered for the whole forward and backward, with
    their whole gradients, which for a large vocabulary is most of the model (32K x 512 untied:
    73% of a 45M model); as units of their own they are gathered only around their own use."""
    try:
        pair = (model.get_input_embeddings(), model.get_output_embeddings())
    except (AttributeError, NotImplementedError):
        return None, None
    held_by: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            held_by.setdefault(id(param), []).append(module)

    def own(module) -> nn.Module | None:
        if not isinstance(module, nn.Module) or list(module.children()):
            return None
        params = list(module.parameters(recurse=False))
        alone = all(held_by[id(p)] == [module] for p in params)
        return module if params and alone else None

    return own(pair[0]), own(pair[1])


def vocabulary_gathers(model: nn.Module, min_bytes: int) -> list[nn.Module]:
    """The sharded modules whose forward gathers a vocabulary matrix of at least min_bytes: the input
    embedding and the output projection where each is a unit of its own (edge_units), else the root
    that holds it. Where one is used in place (vocab_parallel.py), its own forward runs only when
    it is gathered after all: a microbatch of more rows than the vocabulary, an evaluation."""

    def matrix_bytes(module) -> int:
        weight = getattr(module, "weight", None)
        return weight.numel() * weight.element_size() if isinstance(weight, torch.Tensor) else 0

    own_embedding, head = edge_units(model)
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embedding = None
    gathers = [(own_embedding or model, embedding), (head, head)]
    return [module for module, matrix in gathers if module is not None and matrix_bytes(matrix) >= min_bytes]


def describe_sharding(model: nn.Module) -> str:
    """The header's line on what was wrapped: layer class, FSDP units, the root's parameters."""
    units = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule) and m is not model]
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])

    def base(module: nn.Module) -> str:  # fully_shard renames a module's class FSDP<class>
        return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__

    classes = sorted({base(m) for _, m in units if base(m) in layer_classes})
    n_layers = sum(base(m) in layer_classes for _, m in units)
    edges = "".join(f", {name}" for name, m in units if base(m) not in layer_classes)
    prefixes = tuple(f"{name}." for name, _ in units)
    names_by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if not name.startswith(prefixes):
            names_by_param.setdefault(id(param), []).append(name)
    root = [" = ".join(names) + (" (tied)" if len(names) > 1 else "") for names in names_by_param.values()]
    layers = f"{n_layers} x {', '.join(classes)}" if classes else "no decoder-layer class found"
    return f"{len(units) + 1} FSDP units: {layers}{edges} + root holding {', '.join(root) or 'no parameters'}"


def build_replicated(source: ModelSource, config, cfg, settings: ShardSettings, rt) -> nn.Module:
    """The whole model on every rank (layout.py): every rank reads the same weights, or draws
    the same ones from the seed, so the replicas start equal and stay equal."""
    model = lora.apply(load_model(source, config, cfg.trust_remote_code, cfg.seed), cfg).to(rt.device)
    return prepare_replicated(model, settings, rt.device)


def describe_replicated(model: nn.Module) -> str:
    n_params = sum(p.numel() for p in model.parameters())
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trained = "" if n_trained == n_params else f" ({n_trained:,} with gradients)"
    return f"replicated: all {n_params:,} parameters on every rank{trained}, gradients summed once per step"


def build_sharded(source: ModelSource, config, cfg, settings: ShardSettings, rt, mesh) -> nn.Module:
    """The sharded model on every rank, its weights read once per rank or once in all."""
    if not (settings.rank0_loading and rt.world_size > 1):
        return shard(lora.apply(load_model(source, config, cfg.trust_remote_code, cfg.seed), cfg), mesh, settings)

    # Only rank 0 holds the full weights in CPU memory; the others shard an empty (meta)
    # model and receive their shards by broadcast.
    if rt.is_main:
        model = lora.apply(load_model(source, config, cfg.trust_remote_code, cfg.seed), cfg)
        full_state = model.state_dict()
    else:  # fp32 as rank 0's, whatever the config declares: the broadcast copies into these
        with torch.device("meta"):
            model = build_fp32(config, cfg.trust_remote_code)
        model = lora.apply(model, cfg)
        model.train()
        full_state = {}
    shard(model, mesh, settings)
    if not rt.is_main:
        model.to_empty(device="cpu" if settings.offload_params else rt.device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state, options=options)
    # Buffers that are not in the state dict (rotary inv_freq) come from rank 0 as well.
    for _, buffer in model.named_buffers():
        dist.broadcast(buffer, src=0)
    return model
