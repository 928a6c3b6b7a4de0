"""defaults < recipe < CLI flags, each layer tested; recipes shipped in recipes/ all load."""

import subprocess
from pathlib import Path

import pytest
import yaml

from accum_cli.cli import options
from accum_cli.config.settings import TrainConfig, as_recipe, build_config, load_recipe
from accum_cli.errors import UserError

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_defaults():
    cfg = build_config(None, {})
    assert cfg == TrainConfig()
    assert (cfg.global_batch, cfg.micro_batch, cfg.sync) == (64, 8, "auto")


def test_recipe_overrides_defaults_and_flags_override_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("global-batch: 128\nmicro_batch: 2\nlr: 1\n")
    cfg = build_config(str(recipe), {"micro_batch": 4, "lr": None})
    assert cfg.global_batch == 128  # recipe over default
    assert cfg.micro_batch == 4  # flag over recipe
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)  # an int where a float is expected is fine


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1, 2]", "must be a mapping"),
        ("global_batch: [", "not valid YAML"),
        ("max_steps: true", "must be int"),
        ("sync: 3", "must be str"),
        ("seq_len: 1.5", "must be int"),
        # A key written twice: YAML and JSON readers would keep the last, unsaid.
        ("lr: 1e-3\nglobal_batch: 64\nlr: 5", r"key 'lr' appears twice \(lines 1 and 3\); keep one"),
        ("{lr: 1e-3, lr: 5}", r"key 'lr' appears twice \(lines 1 and 1\)"),
    ],
)
def test_bad_recipes(tmp_path, text, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    with pytest.raises(UserError, match=message):
        load_recipe(recipe)


def test_a_key_twice_in_a_json_recipe_is_refused_and_a_merge_may_override(tmp_path):
    (tmp_path / "config.json").write_text('{"lr": 0.001, "max_steps": 3, "lr": 5}')
    with pytest.raises(UserError, match=r"key 'lr' appears twice; keep one"):
        load_recipe(tmp_path / "config.json")
    (tmp_path / "merged.yaml").write_text("base: &b\n  lr: 1\nrun:\n  <<: *b\n  lr: 2\n")
    from accum_cli.config.recipe import read_mapping

    assert read_mapping(tmp_path / "merged.yaml")["run"] == {"lr": 2}  # what merging is for


def test_validation_collects_every_problem():
    with pytest.raises(UserError) as err:
        build_config(None, {"global_batch": 0, "lr": -1.0, "sync": "x"})
    message = str(err.value)
    assert "--global-batch" in message and "--lr" in message and "--sync" in message


RECIPE_FILES = sorted(p for p in RECIPES.rglob("*") if p.suffix in (".yaml", ".sbatch"))


def test_the_recipe_collection_is_complete():
    names = {p.relative_to(RECIPES).as_posix() for p in RECIPE_FILES}
    assert {"embedded.yaml", "accelerate/cpu-2proc.yaml", "slurm/train.sbatch"} <= names
    assert any(n.startswith("accelerate/gpu-8") for n in names) and any("multi-node" in n for n in names)


@pytest.mark.parametrize("recipe", RECIPE_FILES, ids=lambda p: p.relative_to(RECIPES).as_posix())
def test_every_recipe_loads_and_starts_with_its_command(recipe):
    lines = [line for line in recipe.read_text().splitlines() if not line.startswith("#!")]
    command = lines[0]
    assert command.startswith("# "), "the first comment is the command that runs the recipe"
    assert command.split()[1] in ("accum-train", "accelerate", "sbatch", "kubectl"), command
    assert str(recipe.relative_to(RECIPES.parent)) in command, "the command names this very file"
    if "kubernetes" in recipe.parts:
        assert yaml.safe_load(recipe.read_text())["kind"] == "PyTorchJob"  # checked in depth below
    elif recipe.suffix == ".sbatch":
        subprocess.run(["bash", "-n", str(recipe)], check=True)
    elif "accelerate" in recipe.parts:
        from accelerate.commands.config.config_args import load_config_from_file

        config = load_config_from_file(str(recipe))
        assert config.distributed_type in ("FSDP", "MULTI_GPU", "MULTI_CPU", "NO")
    else:
        cfg = build_config(str(recipe), {})
        assert cfg.global_batch >= 1


# The command-line flags that are not config fields, and why: they say how to run this one
# invocation (print, plan, tokenise only, continue from a checkpoint, start processes), not
# what the training is, so a saved config.json must not carry them.
COMMAND_FLAGS = {"--help", "--recipe", "--print-config", "--prepare-only", "--plan", "--world-size", "--resume",
                 "--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--accelerate-config"}  # fmt: skip


def test_every_config_field_is_a_flag_and_a_recipe_key_and_nothing_else_is():
    import typer

    from accum_cli.cli.main import app
    from accum_cli.config.settings import FIELDS, PANELS, default_text, flag

    params = [p for p in typer.main.get_command(app).params if p.param_type_name == "option"]
    by_name = {p.name: p for p in params}
    assert set(options.command_flags(params)) | {"--help"} == COMMAND_FLAGS
    for name, f in FIELDS.items():
        option = by_name[name]  # a flag for every field, named after it
        assert option.opts[0] == flag(name)
        assert option.default is None, "a flag not given must not override the recipe"
        assert f.metadata["panel"] in PANELS and f.metadata["help"]
        assert f.default is not None or f.metadata["none_means"], f"{name}: say what None means"
        assert f"[default: {default_text(name)}]" in option.help
    # and every field is a recipe key of its own type
    assert build_config(None, {}) == TrainConfig(**load_recipe_text(as_recipe(TrainConfig(), "x")))


def load_recipe_text(text: str) -> dict:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    try:
        return load_recipe(f.name)
    finally:
        Path(f.name).unlink()


def test_help_is_grouped_in_panels_with_defaults_from_the_config():
    from typer.testing import CliRunner

    from accum_cli.cli.main import app
    from accum_cli.config.settings import PANELS

    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    headings = [line[:-1] for line in result.output.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings == ["Options", *PANELS]
    for hidden_before in ("--min-lr-ratio", "--adam-beta1", "--adam-beta2", "--adam-eps", "--reshard-after-forward",
                          "--offload-params", "--rank0-loading", "--export-dtype"):  # fmt: skip
        assert hidden_before in result.output


def test_recipe_numbers_follow_yaml_1_2(tmp_path):
    values = load_recipe_text("lr: 3e-4\nweight_decay: 1E-2\nadam_eps: 1e-8\nmax_steps: 1e5\nepochs: 2\n")
    assert values == {"lr": 3e-4, "weight_decay": 0.01, "adam_eps": 1e-8, "max_steps": 100000, "epochs": 2.0}
    assert isinstance(values["max_steps"], int) and isinstance(values["epochs"], float)
    # YAML 1.1 would read 064 as octal (52) and 1:30 in base 60 (90), changing the value silently.
    assert load_recipe_text("global_batch: 064\nseed: 0o17\nmicro_batch: 0x10\n") == {
        "global_batch": 64, "seed": 15, "micro_batch": 16}  # fmt: skip
    for text, message in (("lr: fast", "key 'lr' must be float, got str 'fast'"),
                          ("lr: '3e-4'", "key 'lr' must be float, got str '3e-4'"),
                          ("max_steps: 1.5e0", "key 'max_steps' must be int"),
                          ("max_steps: 1:30", "key 'max_steps' must be int, got str '1:30'")):  # fmt: skip
        with pytest.raises(UserError, match=message):
            load_recipe_text(text)


def test_print_config_is_a_recipe_of_the_resolved_configuration(tmp_path):
    from typer.testing import CliRunner

    from accum_cli.cli.main import app

    recipe = tmp_path / "r.yaml"
    recipe.write_text("lr: 3e-4\nglobal_batch: 128\nmicro_batch: 2\n")
    # a string that YAML 1.2 would read as a number must come back a string
    flags = ["--recipe", str(recipe), "--micro-batch", "4", "--dataset-config", "1e5", "--no-packing"]
    result = CliRunner().invoke(app, [*flags, "--print-config"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("# accum-train --recipe")
    printed = tmp_path / "printed.yaml"
    printed.write_text(result.output)
    cfg = build_config(str(printed), {})
    assert cfg == build_config(str(recipe), {"micro_batch": 4, "dataset_config": "1e5", "packing": False})
    assert (cfg.lr, cfg.global_batch, cfg.micro_batch, cfg.dataset_config) == (3e-4, 128, 4, "1e5")
    # a value chosen at run time (null) says what it will be, as --help does
    assert "\nseq_len: null  # 128 on the embedded corpus, else min(2048, model maximum)\n" in result.output
    assert "\nlr: 0.0003\n" in result.output


@pytest.mark.parametrize("code, requeued", [(75, True), (0, False), (1, False)])
def test_the_slurm_recipe_requeues_itself_after_a_preemption_and_only_then(tmp_path, code, requeued):
    """The real sbatch script with srun, scontrol and accum-train replaced by recorders."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    stubs = {
        "srun": 'SLURM_NODEID=0 "$@"',
        "scontrol": f'[ "$1" = show ] && echo node0 || echo "scontrol $*" >> {log}',
        "accum-train": f'(IFS="|"; echo "accum-train|$*") >> {log}; exit {code}',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node0",
           "SLURM_NNODES": "1"}  # fmt: skip
    recipe = "it's my r.yaml"  # a quote and a space: passed whole
    result = subprocess.run(["bash", str(RECIPES / "slurm/train.sbatch"), recipe], env=env, capture_output=True,
                            text=True, timeout=30)  # fmt: skip
    assert result.returncode == code, result.stdout + result.stderr
    calls = log.read_text().splitlines()
    want = ["accum-train", "--recipe", recipe, "--resume", "auto", "--nproc", "8", "--nnodes", "1", "--node-rank", "0",
            "--master-addr", "node0", "--master-port", "29500"]  # fmt: skip
    assert calls[0].split("|") == want, calls[0]
    assert calls[1:] == (["scontrol requeue 4242"] if requeued else [])


def test_the_kubernetes_recipe_has_what_a_cluster_needs():
    job = yaml.safe_load((RECIPES / "kubernetes" / "pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] >= 1
    for role in specs.values():
        assert role["restartPolicy"] == "OnFailure", "a preempted pod (exit 75) is restarted"
        pod = role["template"]["spec"]
        container = pod["containers"][0]
        assert container["image"]
        argv = container["command"] + container["args"]
        assert argv[0] == "torchrun" and argv[argv.index("-m") + 1] == "accum_cli"
        flags = argv[argv.index("accum_cli") + 1 :]
        assert flags[flags.index("--resume") + 1] == "auto", "one command line for the first start and restarts"
        recipe = flags[flags.index("--recipe") + 1]
        assert build_config(str(RECIPES.parent / recipe), {}).global_batch >= 1
        output_dir = flags[flags.index("--output-dir") + 1]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        mount = next(path for path in mounts if output_dir.startswith(path + "/"))
        assert "persistentVolumeClaim" in volumes[mounts[mount]], "checkpoints need storage every pod sees"
        assert {e["name"] for e in container["env"]} >= {"OMP_NUM_THREADS"}
        assert container["resources"]["limits"]["nvidia.com/gpu"] == int(argv[1].split("=")[1])
        assert pod["terminationGracePeriodSeconds"] >= 60, "time to save a checkpoint on SIGTERM"
