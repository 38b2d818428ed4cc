import dataclasses
import os

import pytest
import torch
from helpers import randomised_lora_model

from archon.rollout.vllm_launch import separate_inductor_cache
from archon.tools.align import make_tiny_hf_checkpoint

# Tiny models gain nothing from a second intra-op thread, and on a busy machine the threads spin
# waiting for each other (steps up to 100x slower).
torch.set_num_threads(1)

# A suite run under ATEN_CPU_CAPABILITY compiles into a cache of its own (the tests' processes and
# the vLLM workers they start inherit it): inductor's cache does not tell capabilities apart.
separate_inductor_cache(os.environ)

# vLLM servers the tests start run their model in the engine-core process (vLLM's uniprocess
# executor) instead of a worker process of its own: one Python process fewer to start (29 s
# against 39 s for a tiny server on 2 idle cores, docs/testing.md; about thirty start in a run). The
# worker extension, the collective transport and the generation code are the same in both; a run's
# servers keep vLLM's CPU default (a worker process, OpenMP threads bound to its cores), which the
# modules that use the `vllm_production_layout` fixture test. Set VLLM_ENABLE_V1_MULTIPROCESSING=1
# to run every test that way.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# ... and such a server forks its engine-core process instead of spawning it: 6 CPU seconds to start it
# against 19 (tests/vllm_site/vllm_engine_core_fork.py). Every Python process the tests start finds
# the directory on PYTHONPATH.
VLLM_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_site")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (VLLM_SITE, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(scope="module")
def vllm_production_layout():
    """The module's vLLM servers start as a run's do: the model in a worker process of its own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        yield


@pytest.fixture
def float64_math():
    """The test runs inside archon.precision.fp32_islands_in_fp64: with fp64 models, an equality
    comparison in float64 that no CPU's arithmetic can move (CONTRIBUTING.md)."""
    from archon.precision import fp32_islands_in_fp64

    with fp32_islands_in_fp64():
        yield


@pytest.fixture
def tiny_checkpoint(tmp_path_factory):
    """Factory: a tiny random-weight HF checkpoint of a model_type, saved to a temp dir."""

    def make(model_type: str, seed: int = 0, **overrides):
        out = tmp_path_factory.mktemp(model_type) / "hf"
        return make_tiny_hf_checkpoint(model_type, out, seed=seed, **overrides)

    return make


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    """A tiny random-weight Qwen3 checkpoint shared by the tests of a module."""
    return make_tiny_hf_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3") / "hf", seed=0)


@pytest.fixture(scope="module")
def importable_module(tmp_path_factory):
    """Factory: write(name, source) puts module `name` in a directory on sys.path and returns the
    name; both are removed again after the test module."""
    import sys

    added = []

    def write(name: str, source: str) -> str:
        directory = tmp_path_factory.mktemp(name)
        (directory / f"{name}.py").write_text(source)
        sys.path.insert(0, str(directory))
        added.append((str(directory), name))
        return name

    yield write
    for directory, name in added:
        sys.path.remove(directory)
        sys.modules.pop(name, None)


@pytest.fixture
def lora_model():
    """Factory: build_model(path, lora) with every LoRA factor drawn from N(0, scale^2)."""
    return randomised_lora_model


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory):
    """The demo's warm-started model and task data (recipes/configs/demo.yaml), made once per test
    session; pass it as --demo.cache-dir and the recipe reuses it. Returns (cache_dir, DemoFiles)."""
    from archon.demos.warm_start import prepare_demo
    from archon.recipes.grpo_lora import DEMO_CONFIG
    from archon.rl.config import load_config_file

    cache_dir = tmp_path_factory.mktemp("demo_cache")
    config = load_config_file(DEMO_CONFIG)
    demo = dataclasses.replace(config.demo, cache_dir=str(cache_dir))
    return cache_dir, prepare_demo(demo, config.parallel, config.seed, rank=0, log=lambda message: None)
