import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """On a busy 2-core machine, syncing two threads costs ~10x the arithmetic of the tiny
    tensors these tests use; the global setting is restored after each module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
