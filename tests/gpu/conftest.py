"""Tests that need a CUDA GPU. On a machine without one every test here is skipped, saying
so; `hpcvla bench gpu` is the same check with numbers (README, "GPU nodes")."""

import pytest
import torch

NO_GPU = "needs a CUDA GPU: this machine has none (torch.cuda.is_available() is False)"


def pytest_collection_modifyitems(items):
    if torch.cuda.is_available():
        return
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=NO_GPU))
