"""Shared test helpers: tiny real models and datasets on disk, real launcher subprocesses."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range (net.ipv4.ip_local_port_range). A port the
    kernel hands out (bind to 0) is also what it hands to outgoing connections, and the suite's gloo ranks
    open many: one taken between this call and rank 0's bind explains a 2-rank run that failed at its start
    as a lost rank once (7 Dec 2026, test_samples.py, 3 workers). Below the range, only another listener can
    take it, and each picks at random (not from the `random` module's state, which a test may have seeded)."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(100 if low > 20000 else 0):
        port = random.SystemRandom().randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the range here: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_tiny_model(
    path: Path, tied: bool = False, seed: int = 1, chat_template: str | None = None, dtype: torch.dtype | None = None
) -> Path:
    """A 2-layer Llama with real weights and the byte-level tokenizer, as save_pretrained writes it
    (in `dtype`, which its config.json then declares)."""
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(path)
    tokenizer = ByT5Tokenizer()
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return path


class Payload:
    """Unpickling this runs a shell command that creates a sentinel file."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def write_pickled_payload(path: Path, marker: Path) -> None:
    """A file in torch.save's format whose pickle runs a command (creating `marker`) when loaded
    without weights_only, as a legacy `pytorch_model.bin` someone crafted would."""
    import pickle
    import zipfile

    torch.save({"weight": torch.zeros(1)}, path)
    with zipfile.ZipFile(path) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    (pickled,) = [name for name in entries if name.endswith("data.pkl")]
    entries[pickled] = pickle.dumps(Payload(marker), protocol=2)
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)


def write_ragged_tokens(path: Path, n_rows: int = 30, seed: int = 2) -> Path:
    """Pre-tokenised rows of different lengths whose labels mask a random prefix with -100,
    so microbatches hold very different numbers of loss tokens."""
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n_rows):
            length = int(torch.randint(4, 40, (1,), generator=g))
            ids = torch.randint(3, 384, (length,), generator=g).tolist()
            masked = int(torch.randint(0, length - 1, (1,), generator=g))
            labels = [-100] * masked + ids[masked:]
            f.write(json.dumps({"input_ids": ids, "labels": labels}) + "\n")
    return path


def write_first_step_without_loss_tokens(path: Path, n_rows: int, global_batch: int, seed: int) -> Path:
    """Pre-tokenised rows of 10 tokens where the samples the run's order draws for step 1 count
    nothing in the loss (every label -100: prompts whose completions were cut off) and the rest count
    every position."""
    from accum_cli.data.batches import SampleOrder

    first = set(SampleOrder(n_rows, seed).rows(range(0, global_batch)))
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for row in range(n_rows):
            ids = torch.randint(3, 300, (10,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * 10 if row in first else ids}) + "\n")
    return path


def env(threads: int = 1, **extra: str) -> dict[str, str]:
    e = dict(os.environ) | extra
    e.update(OMP_NUM_THREADS=str(threads), MASTER_ADDR="127.0.0.1", PYTHONUNBUFFERED="1")
    e.pop("RANK", None)
    e.pop("WORLD_SIZE", None)
    return e


# Variables that torch, transformers, huggingface_hub (its cache under HOME) or the OpenMP runtime read
# when imported: a launch that sets one differently from the warm parent (zygote.py) starts afresh.
IMPORT_TIME_ENV = (
    "TORCH", "PYTORCH", "HF_", "HUGGINGFACE", "TRANSFORMERS", "OMP_", "MKL_", "KMP_", "JE_ARROW", "HOME", "XDG_",
)  # fmt: skip
_zygote: dict = {}
_zygote_lock = threading.Lock()


def _zygote_socket() -> tuple[str, dict[str, str]]:
    """The warm parent of this test process (started once, on first use, by one thread): its socket and
    environment."""
    with _zygote_lock:
        return _started_zygote()


def _started_zygote() -> tuple[str, dict[str, str]]:
    if _zygote.get("proc") is not None and _zygote["proc"].poll() is None:
        return _zygote["socket"], _zygote["env"]
    import tempfile

    folder = tempfile.mkdtemp(prefix="accum-zygote-")
    path = os.path.join(folder, "socket")
    base = env(JE_ARROW_MALLOC_CONF="background_thread:false")  # no thread alive across its forks
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "zygote.py"), path], cwd=REPO, env=base,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "ready", "the warm parent did not start"
    _zygote.update(proc=proc, socket=path, env=base)
    import atexit
    import shutil

    atexit.register(lambda: (proc.kill(), proc.wait(), shutil.rmtree(folder, ignore_errors=True)))
    return path, base


def _warm_env_differs(environment: dict[str, str], base: dict[str, str]) -> bool:
    keys = {k for k in (*environment, *base) if k.startswith(IMPORT_TIME_ENV) and k != "JE_ARROW_MALLOC_CONF"}
    return any(environment.get(k) != base.get(k) for k in keys)


def launch(
    target: str,
    argv: list[str],
    ranks: int = 1,
    kind: str = "module",
    timeout: float = 300,
    environment: dict[str, str] | None = None,
    cwd: Path = REPO,
    nnodes: int = 1,
    node_rank: int = 0,
    master_port: int | None = None,
    umask: int | None = None,
) -> subprocess.CompletedProcess:
    """`python -m target argv` (kind "path": `python target argv`; "code": `python -c target argv`) as
    `ranks` real processes with torchrun's worker environment, forked from a warm parent (zygote.py);
    returncode: the first failing rank's code, else 0. A fresh interpreter where the environment
    sets a variable read at import differently (one rank: the same command; more: torchrun).
    nnodes > 1: these are the local ranks of node `node_rank`, meeting the other nodes' (launched
    beside this one, with the same master_port) as torchrun's --nnodes would have them. umask: the
    processes' file mode mask (None: the test process's)."""
    environment = env() if environment is None else environment
    distributed = ranks > 1 or nnodes > 1
    port = str(master_port or free_port()) if distributed else ""
    path, base = _zygote_socket()
    if _warm_env_differs(environment, base):
        command = {"module": ["-m", target], "path": [target], "code": ["-c", target]}[kind]
        if not distributed:
            cmd = [sys.executable, *command, *argv]
        else:
            cmd = [str(BIN / "torchrun"), f"--nproc_per_node={ranks}", f"--nnodes={nnodes}", f"--node_rank={node_rank}",
                   f"--master_port={port}", "--master_addr=127.0.0.1",
                   *(["-m", target] if kind == "module" else [target]), *argv]  # fmt: skip
        mask = None if umask is None else (lambda: os.umask(umask))
        return subprocess.run(cmd, cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=mask)  # fmt: skip
    if distributed:
        environment = environment | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    request = dict(target=target, kind=kind, argv=list(map(str, argv)), env=environment, cwd=str(cwd), umask=umask,
                   ranks=ranks, nnodes=nnodes, node_rank=node_rank)  # fmt: skip
    codes, [(stdout, stderr)] = _warm(path, request, timeout)
    failed = [c for c in codes if c != 0]
    return subprocess.CompletedProcess([target, *argv], failed[0] if failed else 0, stdout, stderr)


def _warm(path: str, request: dict, timeout: float) -> tuple[list[int], list[tuple[str, str]]]:
    """One launch by the warm parent listening at `path`: the ranks' exit codes, and their stdout and
    stderr (one pair for all of them; one per rank where the request has them `apart`)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="accum-launch-") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        codes = _session(path, request | {"stdout": out, "stderr": err}, timeout)
        suffixes = [f".{rank}" for rank in range(len(codes))] if request.get("apart") else [""]
        return codes, [(_text(out + suffix), _text(err + suffix)) for suffix in suffixes]


def _session(path: str, request: dict, timeout: float) -> list[int]:
    """One launch by the warm parent listening at `path`: the ranks' exit codes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        conn.settimeout(timeout)
        conn.sendall((json.dumps(request) + "\n").encode())
        replies, session = conn.makefile(), None
        try:
            session = json.loads(replies.readline())["session"]
            return json.loads(replies.readline())["codes"]
        except (TimeoutError, OSError) as exc:
            if session is not None:
                os.killpg(session, 9)  # the session and every rank it forked
            raise subprocess.TimeoutExpired(request["target"], timeout) from exc


def _text(path: str) -> str:
    return Path(path).read_text(errors="replace") if os.path.exists(path) else ""


def ranks_apart(argv: list[str], ranks: int = 2, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """`python -m accum_cli argv` as `ranks` processes with a launcher's worker environment but no launcher's
    care: none is stopped when another ends (an agent would stop the rest at once, and could cut one off
    before its last line), and each has its own output. Forked warm, as launch()."""
    path, base = _zygote_socket()
    environment = base | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    request = dict(target="accum_cli", kind="module", argv=list(map(str, argv)), env=environment, cwd=str(REPO),
                   ranks=ranks, nnodes=1, node_rank=0, apart=True)  # fmt: skip
    codes, outputs = _warm(path, request, timeout)
    return [
        subprocess.CompletedProcess(["accum_cli", *argv], code, stdout, stderr)
        for code, (stdout, stderr) in zip(codes, outputs, strict=True)
    ]


def python(
    cmd: list[str],
    cwd: Path = REPO,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    umask: int | None = None,
    **how,
) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *cmd], cwd=, env=, capture_output=True, text=True, timeout=)`
    through launch(): `-m module ...`, `-c code ...` or `script ...`, one process. `how` may only
    repeat what launch() does anyway (captured text output, no stdin), or check the exit code."""
    assert set(how) <= {"capture_output", "text", "stdin", "check"}, f"launch() cannot do {sorted(how)}"
    if cmd[0] in ("-m", "-c"):
        target, kind, argv = cmd[1], {"-m": "module", "-c": "code"}[cmd[0]], cmd[2:]
    else:
        target, kind, argv = cmd[0], "path", cmd[1:]
    done = launch(target, argv, kind=kind, timeout=timeout, environment=env, cwd=cwd, umask=umask)
    if how.get("check"):
        done.check_returncode()
    return done


def run_cli(
    args: list[str],
    nproc: int = 1,
    timeout: float = 300,
    wrapper: bool = False,
    env_extra: dict | None = None,
    launcher: str = "warm",
) -> subprocess.CompletedProcess:
    """accum-train as `python -m accum_cli` runs it, on `nproc` ranks forked from the warm parent
    (launch()); launcher="torchrun" (or wrapper=True, the --nproc wrapper, which passes the
    workers' exit code through) starts the real launcher, for tests about launching."""
    if launcher == "warm" and not wrapper:
        return launch("accum_cli", args, ranks=nproc, timeout=timeout, environment=env(**(env_extra or {})))
    if wrapper:
        cmd = [sys.executable, "-m", "accum_cli", "--nproc", str(nproc), "--master-port", str(free_port()), *args]
    elif nproc == 1:
        cmd = [sys.executable, "-m", "accum_cli", *args]
    else:
        cmd = [
            str(BIN / "torchrun"),
            f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}",
            "--master_addr=127.0.0.1",
            "-m",
            "accum_cli",
            *args,
        ]
    return subprocess.run(cmd, cwd=REPO, env=env(**(env_extra or {})), capture_output=True, text=True, timeout=timeout)


# `python -m accum_cli argv` from a `python -c` program (launch's kind "code"): after a prelude of the caller's.
AS_MODULE = """
import runpy, sys
sys.argv = ["accum_cli", *sys.argv[1:]]
runpy.run_module("accum_cli", run_name="__main__", alter_sys=True)
"""


def run_cli_after(prelude: str, args: list[str], nproc: int = 1, timeout: float = 300, env_extra: dict | None = None):
    """accum-train as run_cli runs it, each process first running `prelude`: a patch, as a sitecustomize.py
    on PYTHONPATH would apply it in every process, or a log setting, as TORCH_LOGS would. Forked warm
    (launch's kind "code"), where PYTHONPATH or TORCH_LOGS would take fresh interpreters."""
    environment = env(**(env_extra or {}))
    return launch(prelude + AS_MODULE, args, ranks=nproc, kind="code", timeout=timeout, environment=environment)


def message_lines(stderr: str) -> list[str]:
    """stderr's lines without blanks and without the tokenising progress bar, which a preparation shows
    once it has taken over 2 s (data/prepare.py PROGRESS_AFTER_S): on a loaded machine, a test's tiny one."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("tokenising:")]


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def rel_err(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def worker_pids(marker: str) -> dict[int, int]:
    """rank -> pid of the live worker processes whose command line holds `marker`."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0]
        except OSError:
            continue
        rank = [e for e in environ if e.startswith(b"RANK=")]
        if marker.encode() in cmdline and b"--nproc" not in cmdline and rank and state != "Z":
            found[int(rank[0][5:])] = int(pid)
    return found


def wait_for_steps(out: Path, steps: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Block until a running run has logged `steps` optimizer steps."""
    import time

    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert proc.poll() is None, f"the run ended early: {proc.returncode}"
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.05)


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative path -> SHA-256): to prove nothing was touched."""
    import hashlib

    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


PROBE_IDS = torch.arange(3, 3 + 2 * 24).reshape(2, 24)  # token ids every tiny model here knows


@torch.no_grad()
def probe_logits(model) -> torch.Tensor:
    return model(input_ids=PROBE_IDS).logits.float()


def assert_complete_hf_model(folder: Path, params: dict[str, torch.Tensor], logits: torch.Tensor, tol: float) -> None:
    """`folder` (save_pretrained format) holds every tensor of the model's state dict, each tied
    one once under the name the model itself declares, with these values; and reloaded with
    from_pretrained it gives these logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    stored = {}
    for shard in sorted(folder.glob("*.safetensors")):
        stored |= load_file(shard)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    tied = model.get_expanded_tied_weights_keys(all_submodels=True)  # {tied name: the name it is stored as}
    assert set(model.state_dict()) == set(params), "the reloaded model has other tensors than the trained one"
    assert set(stored) == set(params) - set(tied), f"missing {sorted(set(params) - set(tied) - set(stored))}"
    for name, expected in params.items():
        assert rel_err(stored[tied.get(name, name)], expected) < tol, name
    assert rel_err(probe_logits(model), logits) < tol, "the reloaded model's logits"
