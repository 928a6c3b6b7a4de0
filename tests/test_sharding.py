"""Shard settings: our flags, else the launching Accelerate config (parsed by Accelerate), else defaults."""

import pytest
from helpers import REPO

from accum_cli.cli import launcher
from accum_cli.config.settings import TrainConfig
from accum_cli.errors import UserError
from accum_cli.model import compiling
from accum_cli.parallel import sharding

ACCELERATE_FSDP = {
    "ACCELERATE_MIXED_PRECISION": "no",
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_RESHARD_AFTER_FORWARD": "false",
    "FSDP_OFFLOAD_PARAMS": "true",
    "FSDP_ACTIVATION_CHECKPOINTING": "true",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
}


@pytest.fixture
def accelerate_env(monkeypatch):
    for key in [k for k in __import__("os").environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(key)

    def apply(values):
        for key, value in values.items():
            monkeypatch.setenv(key, value)

    return apply


def test_defaults_without_a_launcher(accelerate_env):
    defaults = sharding.ShardSettings(source="flags and defaults", compile_auto=True)
    assert sharding.resolve(TrainConfig(), "cpu") == defaults
    assert sharding.resolve(TrainConfig(), "cuda").bf16


def test_accelerate_fsdp_settings_are_honoured(accelerate_env):
    accelerate_env(ACCELERATE_FSDP)
    on_gpu = sharding.resolve(TrainConfig(), "cuda")
    assert (on_gpu.bf16, on_gpu.reshard_after_forward, on_gpu.offload_params) == (False, False, True)
    assert on_gpu.activation_checkpointing and on_gpu.rank0_loading and not on_gpu.notes
    on_cpu = sharding.resolve(TrainConfig(), "cpu")
    assert not on_cpu.offload_params
    assert on_cpu.notes == ("offload_params has no effect on CPU: the parameters already live there",)


def test_flags_override_the_accelerate_config(accelerate_env):
    accelerate_env(ACCELERATE_FSDP | {"ACCELERATE_MIXED_PRECISION": "bf16"})
    cfg = TrainConfig(precision="fp32", activation_checkpointing=False, reshard_after_forward=True, rank0_loading=False)
    settings = sharding.resolve(cfg, "cuda")
    assert not settings.bf16 and not settings.activation_checkpointing
    assert settings.reshard_after_forward and not settings.rank0_loading


@pytest.mark.parametrize(
    "precision, device, bf16, note",
    [
        ("bf16", "cuda", True, None),
        ("bf16", "cpu", True, None),  # bf16 mixed precision runs on CPU too: the path every GPU run takes
        ("fp16", "cuda", True, "mixed_precision fp16 is not supported"),
        ("no", "cuda", False, None),
    ],
)
def test_accelerate_mixed_precision(accelerate_env, precision, device, bf16, note):
    accelerate_env({"ACCELERATE_MIXED_PRECISION": precision})
    settings = sharding.resolve(TrainConfig(), device)
    assert settings.bf16 == bf16
    assert (note is None and not settings.notes) or note in settings.notes[0]


def test_what_cannot_be_honoured_is_said(accelerate_env):
    accelerate_env({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"})
    settings = sharding.resolve(TrainConfig(), "cpu")
    assert not settings.reshard_after_forward
    assert any("always shards with FSDP2" in n for n in settings.notes)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_precision_flags_hold_on_every_device(device):
    """--precision bf16 and fp32 mean the same on every device; auto is bf16 on CUDA and fp32 on a CPU,
    whose bf16 speed depends on the processor (docs/MEMORY.md, Precision)."""
    assert sharding.resolve(TrainConfig(precision="bf16"), device).bf16
    assert not sharding.resolve(TrainConfig(precision="fp32"), device).bf16
    assert sharding.resolve(TrainConfig(precision="auto"), device).bf16 == (device == "cuda")


def test_the_wrapper_forwards_everything_but_its_own_flags():
    raw = ["--nproc", "2", "--global-batch", "64", "--master-port=1234", "--nnodes", "1", "--sync", "last",
           "--accelerate-config", "x.yaml", "--node-rank", "0", "--master-addr", "10.0.0.1"]  # fmt: skip
    assert launcher.worker_args(raw) == ["--global-batch", "64", "--sync", "last"]


def test_the_wrapper_speaks_accelerate_launch():
    spec = launcher.Launch(nproc=4, nnodes=2, node_rank=1, master_addr="10.1.1.1", master_port=1234)
    args = launcher.accelerate_args(spec, "bf16", ["--global-batch", "64"])
    from accelerate.commands.launch import launch_command_parser

    parsed = launch_command_parser().parse_args(args)
    assert (parsed.num_processes, parsed.num_machines, parsed.machine_rank) == (8, 2, 1)
    assert (parsed.main_process_ip, parsed.main_process_port, parsed.mixed_precision) == ("10.1.1.1", 1234, "bf16")
    assert parsed.multi_gpu and parsed.module and parsed.training_script == "accum_cli"
    assert parsed.training_script_args == ["--global-batch", "64"]


def test_the_wrapper_leaves_the_accelerate_configs_address_alone():
    """A multi-node config names node 0 (`main_process_ip: node0`): the wrapper passes an address
    and port only when given them, so every node meets there, not on its own loopback."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    config = str(REPO / "recipes" / "accelerate" / "multi-node-4x8.yaml")
    for given, want in (({}, ("node0", 29500)), ({"master_addr": "10.0.0.7", "master_port": 4321}, ("10.0.0.7", 4321))):
        spec = launcher.Launch(nproc=None, nnodes=4, node_rank=2, accelerate_config=config, **given).validate()
        parsed = launch_command_parser().parse_args(launcher.accelerate_args(spec, None, []))
        _validate_launch_command(parsed)  # what launch_command does first: the config fills what flags left unset
        assert (parsed.main_process_ip, parsed.main_process_port, parsed.machine_rank) == (*want, 2)
    plain = launcher.accelerate_args(launcher.Launch(nproc=2), None, [])
    assert plain[plain.index("--main_process_ip") + 1] == "127.0.0.1"


@pytest.mark.parametrize(
    "flag, backend, compiled, note",
    [(None, None, "auto", None), (True, None, True, None), (None, "INDUCTOR", True, None), (False, "INDUCTOR", False, None),
     (None, "EAGER", True, "dynamo backend eager asked: accum-train compiles with inductor"), (None, "NO", "auto", None),
     (False, None, False, None)],
)  # fmt: skip
def test_compile_from_the_flag_else_the_accelerate_dynamo_config(accelerate_env, flag, backend, compiled, note):
    if backend:
        accelerate_env({"ACCELERATE_DYNAMO_BACKEND": backend})
    settings = sharding.resolve(TrainConfig(compile=flag), "cpu")
    assert (settings.compile, settings.compile_auto) == (compiled is True, compiled == "auto")
    assert (note in settings.notes) if note else not settings.notes
    said = {True: "decoder layers compiled (", "auto": "decoder layers compiled if it pays", False: None}[compiled]
    assert (said in settings.describe()) if said else "compiled" not in settings.describe()


@pytest.mark.parametrize("text, seconds", [(None, 1200.0), ("0", 0.0), ("90.5", 90.5), ("abc", None), ("-1", None),
                                           ("inf", None), ("nan", None)])  # fmt: skip
def test_the_compile_threshold_is_seconds_of_training_left(text, seconds):
    env = {} if text is None else {"ACCUM_TRAIN_COMPILE_AFTER_S": text}
    if seconds is None:
        with pytest.raises(UserError, match="ACCUM_TRAIN_COMPILE_AFTER_S must be a number of seconds >= 0"):
            sharding.compile_threshold(env)
    else:
        assert sharding.compile_threshold(env) == seconds
    assert sharding.compile_pays(100, 12.0, 1200.0) and not sharding.compile_pays(100, 11.99, 1200.0)


def test_compile_layers_compiles_every_decoder_layer_and_keeps_the_state_dict_names(tmp_path, monkeypatch):
    """Captured by dynamo for real (one graph shared by the layers) and a checkpoint's names unchanged, so
    checkpoints move between compiled and eager runs. The graph goes to dynamo's eager backend: inductor's
    code for it (~25 s of CPU on a cold cache) runs, and is held to the reference, in test_equivalence.py's
    compiled cases."""
    import functools

    import torch
    from helpers import save_tiny_model
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from accum_cli.model import load as modeling

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / "model"), dtype=torch.float32)
    names = list(model.state_dict())
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    compiling.compile_layers(model)
    model(input_ids=torch.randint(3, 300, (2, 8)), use_cache=False).logits.sum().backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    layers = modeling.decoder_layers(model)
    assert len(layers) > 1 and all(layer.forward.compiled is not None for layer in layers)
    assert list(model.state_dict()) == names
