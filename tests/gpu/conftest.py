"""GPU tests: skipped on machines without CUDA (CI), run by tests/gpu/run.sh on a GPU machine."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if "tests/gpu/" in str(item.fspath).replace("\\", "/")]
    for item in gpu:   # GPU tests start ranks and helpers of their own: the procs tier
        item.add_marker(pytest.mark.procs)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run tests/gpu/run.sh on a GPU machine)")
    for item in gpu:
        item.add_marker(skip)
