"""defaults < recipe < CLI flags, each layer tested; recipes shipped in recipes/ all load."""

import subprocess
from pathlib import Path

import pytest
import yaml

from accum_cli.config import TrainConfig, build_config, load_recipe
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
    ],
)
def test_bad_recipes(tmp_path, text, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    with pytest.raises(UserError, match=message):
        load_recipe(recipe)


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
