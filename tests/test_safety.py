"""Safety: code shipped with a model never runs unless --trust-remote-code is given. (Checkpoints
that try to run code are attacked for real in test_trust.py.)"""

import json

import pytest
from helpers import REPO, env, python, save_tiny_model


def plant_code(model, sentinel, model_type: str) -> None:
    (model / "evil_modeling.py").write_text(
        f"import pathlib\npathlib.Path({str(sentinel)!r}).touch()\n"
        "from transformers import LlamaConfig as EvilConfig, LlamaForCausalLM as EvilForCausalLM\n"
    )
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = {"AutoConfig": "evil_modeling.EvilConfig",
                          "AutoModelForCausalLM": "evil_modeling.EvilForCausalLM"}  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("model_type, code", [("llama", 2), ("evil-llm", 2)], ids=["known type", "unknown type"])
def test_code_shipped_with_a_model_never_runs_unasked(tmp_path, model_type, code):
    """Refused either way: an unknown type by transformers, a known one (whose own class transformers
    would train, the code dropped unsaid) by accum-train (test_trust_weights.py)."""
    model = save_tiny_model(tmp_path / "model")
    sentinel = tmp_path / "remote-code-ran"
    plant_code(model, sentinel, model_type)
    result = python(
        ["-m", "accum_cli", "--model", str(model), "--max-steps", "1", "--global-batch", "8",
         "--micro-batch", "8", "--output-dir", str(tmp_path / "out")],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == code, result.stdout + result.stderr
    assert not sentinel.exists(), "the model's code ran without --trust-remote-code"
    if code == 2:
        assert "--trust-remote-code" in result.stderr and not (tmp_path / "out").exists()


def test_a_tokenizer_that_ships_code_is_refused_by_name_not_dropped_unsaid(tmp_path):
    """Its auto_map names code to run at load: without --trust-remote-code transformers refuses it,
    which read as "no tokenizer" (text data: the wrong fix; pre-tokenised data: a final/ without it)."""
    model = save_tiny_model(tmp_path / "model")
    sentinel = tmp_path / "remote-code-ran"
    (model / "my_tokenizer.py").write_text(f"import pathlib\npathlib.Path({str(sentinel)!r}).touch()\n")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config |= {"tokenizer_class": "MyTokenizer", "auto_map": {"AutoTokenizer": ["my_tokenizer.MyTokenizer", None]}}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    result = python(
        ["-m", "accum_cli", "--model", str(model), "--max-steps", "1", "--global-batch", "8",
         "--micro-batch", "8", "--output-dir", str(tmp_path / "out")],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"accum-train: error: --model {model}: its tokenizer ships its own code (auto_map) to run at load; read it,"
        " then pass --trust-remote-code if you trust it"
    ]
    assert not sentinel.exists() and not (tmp_path / "out").exists()
