"""The tiny checkpoints and transformers' outputs on them, made once per pytest session in a
temp dir (make_models.py; seconds on a CPU, never committed)."""

import os

import pytest

import make_models


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """name -> checkpoint directory (with its reference/ beside the weights), for every shape."""
    out = tmp_path_factory.mktemp("engine-models")
    make_models.torch.set_num_threads(min(2, os.cpu_count() or 1))
    return {name: make_models.make(name, str(out)) for name in make_models.SHAPES}
