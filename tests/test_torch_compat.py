"""Every private torch symbol the project uses resolves in the installed torch (accum_cli/torch_compat.py):
an upgrade that moves one fails here, naming it."""

from __future__ import annotations

import pytest

from accum_cli import torch_compat


@pytest.mark.parametrize("name", sorted(torch_compat.PRIVATE))
def test_each_private_symbol_is_where_we_expect_it(name):
    try:
        assert getattr(torch_compat, name) is not None
    except torch_compat.MovedError as exc:
        pytest.fail(f"torch_compat.{name}: {exc}")


def test_a_moved_symbol_fails_loudly_naming_it(monkeypatch):
    monkeypatch.setitem(torch_compat.PRIVATE, "Gone", "torch.distributed.fsdp._fully_shard.NoSuchThing")
    with pytest.raises(torch_compat.MovedError, match="torch.distributed.fsdp._fully_shard.NoSuchThing"):
        torch_compat.Gone  # noqa: B018
    monkeypatch.setitem(torch_compat.PRIVATE, "GoneOp", "torch.ops.mkldnn._no_such_op")
    with pytest.raises(torch_compat.MovedError, match="_no_such_op"):
        torch_compat.GoneOp  # noqa: B018
