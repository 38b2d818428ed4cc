import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def tiny_checkpoint(tmp_path_factory):
    """Factory: a tiny random-weight HF checkpoint of a model_type, saved to a temp dir."""
    from archon.tools.align import make_tiny_hf_checkpoint

    def make(model_type: str, seed: int = 0, **overrides):
        out = tmp_path_factory.mktemp(model_type) / "hf"
        return make_tiny_hf_checkpoint(model_type, out, seed=seed, **overrides)

    return make
