from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    """The benchmarks pin torch to one thread; give the test process its setting back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
