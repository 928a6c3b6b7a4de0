"""Shared test helpers: tiny real models and datasets on disk, real launcher subprocesses."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
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


def env(threads: int = 1, **extra: str) -> dict[str, str]:
    e = dict(os.environ) | extra
    e.update(OMP_NUM_THREADS=str(threads), MASTER_ADDR="127.0.0.1", PYTHONUNBUFFERED="1")
    e.pop("RANK", None)
    e.pop("WORLD_SIZE", None)
    return e


def run_cli(
    args: list[str], nproc: int = 1, timeout: float = 300, wrapper: bool = False, env_extra: dict | None = None
) -> subprocess.CompletedProcess:
    """accum-train as users start it: `python -m accum_cli` for one process, torchrun for more,
    or the --nproc wrapper (which passes the workers' exit code through)."""
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
