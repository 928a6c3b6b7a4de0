import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def no_process_group_leaks():
    """A test that started a process group in this interpreter must not leak it into the next."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
