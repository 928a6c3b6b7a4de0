"""Safety: nothing in the package unpickles files, and remote code needs asking."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "accum_cli"


def test_the_package_never_unpickles_or_torch_loads():
    for source in PACKAGE.rglob("*.py"):
        text = source.read_text()
        assert not re.search(r"\bpickle\.loads?\(|\btorch\.load\(", text), source


def test_remote_code_is_off_unless_asked():
    from accum_cli.config import TrainConfig

    assert TrainConfig().trust_remote_code is False
    for source in PACKAGE.rglob("*.py"):
        assert "trust_remote_code=True" not in source.read_text(), source
