import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def one_thread():
    """Two shared cores: torch's default thread pool oversubscribes them (a 1 s Trainer run takes a minute);
    modules training real models opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _torch_threads_given_back():
    """A test that changes torch's thread count without restoring it would change every later in-process run's
    matmul reductions (an ulp in the losses), so runs compared with a CLI subprocess would differ."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)
