"""Every command in README.md runs here, for real, on CPU with tiny inputs (issue 38).

What counts as a command (`readme_commands`):
- each command line of a ```bash block (comments dropped, `\\` continuations joined);
- each ```python block, as one script;
- each inline code span outside the blocks whose first word is a program: one in .venv/bin, one on
  PATH, or a cluster tool this machine lacks (CLUSTER_TOOLS). So the Launching table's cells count,
  and `--chat-eos` or `runs/my-chat` do not.

Each one is run, by its first word (`run`), or listed in EXEMPT with the reason it cannot run here.
`test_every_readme_command_runs_or_is_exempt` fails on a command that is neither, and on an exemption
or a substitution that no README command uses any more; `test_the_readme_commands_run` runs them.

How they run: in README order, in one work folder that holds what they name: `./my-model` (the tiny
Llama of helpers.save_tiny_model with helpers.CHAT_TEMPLATE, whose turns end with a newline, not the
EOS), `chat.jsonl` (16 rows shaped like the README's ```json example), `prompts.txt`, and the checkout's
`recipes/`; so later commands find what earlier ones wrote (`runs/my-chat`). The substitutions, all literal:
- SCALE shrinks the numbers (sequence length, batch, steps, intervals, the checkpoint's name);
- `...` (the Launching table's "your flags") becomes TINY_FLAGS with an output folder of its own;
- the `--nproc` wrapper gets a free port (parallel test workers must not meet on 29500).
accum-train, accum-report, accum-export and the python block run as processes forked from the warm
parent (helpers.launch, helpers.python: the same entry points, imports paid once); the fine-tune's
`--nproc 2` starts the real wrapper, the way a user's copy of it runs. The torchrun and accelerate
launch rows are parsed by those launchers' own argument parsers (their config file must exist and
name the processes), and what they would start, `-m accum_cli` with the row's flags, runs as that many
ranks forked warm with torchrun's worker environment: the launchers themselves are started for real
by tests/test_launchers.py and tests/test_end_to_end.py, and another ~40 s of imports here would buy
nothing more. Every command must exit 0; a few checks read what the README says they print or write.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers import BIN, CHAT_TEMPLATE, REPO, env, free_port, launch, python, save_tiny_model

README = REPO / "README.md"
CLUSTER_TOOLS = ("sbatch", "srun", "scontrol", "kubectl")

EXEMPT = {
    "make setup run": "installs from the package index, then trains the whole embedded default (about a "
    "minute); `make test` runs the same setup first",
    "make test": "the suite itself, which this test is part of: CI runs it (.ci/run)",
    "make setup": "installs from the package index; `make test` runs it first",
    "make run": "trains the whole embedded default (about a minute): `make setup run` above",
    "accum-train --model ./my-1b-config --dataset ./corpus --seq-len 2048 --batch-schedule "
    "0:512,20B:1024,40B:2048 --max-tokens 100B --batch-schedule-lr sqrt --nproc 8": "a 100B-token pretraining "
    "run on 8 GPUs; tests/test_batch_schedule_run.py runs schedules through the CLI, across stages and resumes",
    "make bench-packing": "a benchmark of about 8 minutes at seq 2048; tests/test_bench_packing.py checks its "
    "corpus, arguments and figures",
    "accum-train --nproc 8 --nnodes 4 --node-rank I --master-addr NODE0 ...": "four machines",
    "sbatch --nodes 4 recipes/slurm/train.sbatch recipes/llama-3.2-1b-fineweb-edu.yaml": "a Slurm cluster of "
    "GPU nodes and the hub's model and dataset (tests/test_config.py runs the script with srun, scontrol and "
    "accum-train recorded, and loads the recipe)",
    "kubectl apply -f recipes/kubernetes/pytorchjob.yaml": "a Kubernetes cluster with the Kubeflow training "
    "operator and GPUs (tests/test_config.py checks the job and loads the recipe it names)",
}
SCALE = {
    "--seq-len 2048": "--seq-len 128",
    "--global-batch 64": "--global-batch 8",
    "--epochs 3": "--max-steps 2",
    "--sample-every 50": "--sample-every 1",
    "--checkpoint-every 100": "--checkpoint-every 1",
    "step-000100": "step-000002",
}
TINY_FLAGS = "--model ./my-model --dataset chat.jsonl --seq-len 128 --global-batch 8 --micro-batch 2 --max-steps 1"
ENTRY = {  # the console scripts' own entry points, for the warm parent
    "accum-report": "from accum_cli.cli.report import entry; entry()",
    "accum-export": "from accum_cli.cli.main import export_entry; export_entry()",
}


def is_program(word: str) -> bool:
    return word in CLUSTER_TOOLS or (BIN / word).exists() or ("/" not in word and shutil.which(word) is not None)


def readme_commands(text: str) -> list[tuple[str, str]]:
    """(kind, command) in README order: kind "bash" (one command line, normalised), "inline" (a code
    span naming a program) or "python" (a whole block)."""
    found = []
    for i, part in enumerate(re.split(r"^```(\w*)\n(.*?)^```\n", text, flags=re.M | re.S)):
        if i % 3 == 0:  # outside the blocks: inline code spans
            for span in re.findall(r"`([^`\n]+)`", part):
                words = span.split()
                if len(words) > 1 and is_program(words[0]):
                    found.append(("inline", " ".join(words)))
        elif i % 3 == 1:
            language = part
        elif language == "bash":
            for line in part.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words:
                    found.append(("bash", shlex.join(words)))
        elif language == "python":
            found.append(("python", part))
    return found


def scaled(command: str, output: str) -> str:
    for big, small in SCALE.items():
        command = command.replace(big, small)
    return command.replace("...", f"{TINY_FLAGS} --output-dir {output}")


def test_every_readme_command_runs_or_is_exempt():
    commands = readme_commands(README.read_text())
    runnable = {"accum-train", "accum-report", "accum-export", "torchrun", "accelerate"}
    orphans = [c for kind, c in commands if kind != "python" and c not in EXEMPT and c.split()[0] not in runnable]
    assert not orphans, f"README commands neither run here nor exempt (add a runner or an EXEMPT reason): {orphans}"
    texts = [c for _, c in commands]
    assert not set(EXEMPT) - set(texts), f"exemptions no README command matches: {set(EXEMPT) - set(texts)}"
    unused = [big for big in SCALE if not any(big in c for c in texts)]
    assert not unused, f"substitutions no README command uses: {unused}"
    # the README's shape the brief and CI rely on: the two commands first, the README's test command
    assert commands[:2] == [("bash", "make setup run"), ("bash", "make test")], commands[:2]
    assert "make test" in (REPO / ".ci" / "run").read_text()
    assert len(README.read_text().splitlines()) <= 250


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The folder a user would be in: the model, the chat data and the prompts the README names."""
    work = tmp_path_factory.mktemp("readme")
    save_tiny_model(work / "my-model", chat_template=CHAT_TEMPLATE)
    example = json.loads(re.search(r"^```json\n(.*?)\n```", README.read_text(), re.M | re.S)[1])
    rows = []
    for i in range(16):
        row = json.loads(json.dumps(example))
        asked = {"user": f"What is {i} + {i}?", "assistant": f"{2 * i}."}
        for turn in row["messages"]:
            turn["content"] = asked.get(turn["role"], turn["content"])
        rows.append(json.dumps(row) + "\n")
    (work / "chat.jsonl").write_text("".join(rows))
    (work / "prompts.txt").write_text("What is 2 + 2?\nName a colour.\n")
    (work / "recipes").symlink_to(REPO / "recipes")  # the checkout's, which the launchers' commands name
    return work


def run(kind: str, command: str, work: Path, environment: dict[str, str]) -> subprocess.CompletedProcess:
    if kind == "python":
        return python(["-c", command], cwd=work, env=environment)
    program, *args = shlex.split(command)
    if program == "accum-train" and "--nproc" not in args:
        return launch("accum_cli", args, environment=environment, cwd=work)
    if program in ENTRY:
        return python(["-c", ENTRY[program], *args], cwd=work, env=environment)
    if program == "accum-train":  # the --nproc wrapper, for real
        argv = [str(BIN / program), *args, "--master-port", str(free_port())]
        return subprocess.run(argv, cwd=work, env=environment, capture_output=True, text=True, timeout=300)
    ranks, module, flags = launched(program, args, work)
    assert module == "accum_cli", command
    return launch(module, flags, ranks=ranks, environment=environment, cwd=work)


def launched(program: str, args: list[str], work: Path) -> tuple[int, str, list[str]]:
    """What `torchrun ARGS` or `accelerate ARGS` would start, read by the launcher's own parser:
    (processes, the -m module, its flags)."""
    if program == "torchrun":
        from torch.distributed.run import get_args_parser

        parsed = get_args_parser().parse_args(args)
        assert parsed.module, "torchrun ... -m accum_cli"
        return int(parsed.nproc_per_node), parsed.training_script, parsed.training_script_args
    assert program == "accelerate" and args[0] == "launch", f"no way to run {program} {args}"
    import yaml
    from accelerate.commands.launch import launch_command_parser

    parsed = launch_command_parser().parse_args(args[1:])
    assert parsed.module, "accelerate launch ... -m accum_cli"
    config = yaml.safe_load((work / parsed.config_file).read_text())
    return parsed.num_processes or config["num_processes"], parsed.training_script, parsed.training_script_args


@pytest.mark.distributed
def test_the_readme_commands_run(work):
    environment = env(ACCUM_TRAIN_CACHE=str(work / "cache"), ACCUM_TRAIN_REPORT="1")  # the README promises report.png
    done = []
    for n, (kind, command) in enumerate(readme_commands(README.read_text())):
        if command in EXEMPT:
            continue
        command = scaled(command, f"runs/readme-{n}")
        started = time.monotonic()
        result = run(kind, command, work, environment)
        print(f"{time.monotonic() - started:5.1f} s  {command[:100]!r}")  # pytest -s: where the time goes
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"README command failed ({result.returncode}): {command}\n{output[-3000:]}"
        done.append((command, output))

    def output_of(*words: str) -> str:
        (found,) = [out for command, out in done if all(w in command for w in words)]
        return found

    # what the README says these print and write
    assert "answers hold no EOS" in output_of("--prepare-only"), "the template's answers lack the EOS"
    trained = output_of("--sample-prompts")
    assert "answers hold no EOS" not in trained, "--chat-eos ends each answer with the EOS"
    run_dir = work / "runs" / "my-chat"
    for written in ("final/model.safetensors", "metrics.jsonl", "config.json", "report.png", "samples.jsonl",
                    "checkpoints/step-000002"):  # fmt: skip
        assert (run_dir / written).exists(), written
    assert list(run_dir.glob("trackers/**/events.out.tfevents.*")), "TensorBoard's events under trackers/"
    assert (work / "my-chat-step-100" / "model.safetensors").exists(), "accum-export wrote the model"
    # the same command again (its workers, forked warm): a finished run has nothing to do
    (again,) = [c for c, _ in done if "--sample-prompts" in c]
    args = shlex.split(again)[1:]
    nproc = args.index("--nproc")
    rerun = launch("accum_cli", args[:nproc] + args[nproc + 2 :], ranks=int(args[nproc + 1]),
                   environment=environment, cwd=work)  # fmt: skip
    assert rerun.returncode == 0 and "nothing to do" in rerun.stdout, rerun.stdout + rerun.stderr
