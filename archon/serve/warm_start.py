"""A warm start for the cookbook's math_rl demo, through the SDK against a running server: SFT of a
new adapter on additions written as the arithmetic environment writes them (the cookbook's
role_colon renderer, its few-shot turn, "What is x + y?" with x, y in [0, 100]), then save_state.
A tiny random base learns the format (an integer, then the renderer's stop) in a few dozen steps,
which gives the RL recipe rewards that vary within a group.

    python -m archon.serve.warm_start --base-model DIR --base-url http://127.0.0.1:8000 --steps 40

prints the checkpoint's tinker:// path, which the recipe takes as load_checkpoint_path.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import tinker
import tyro
from tinker_cookbook import renderers
from tinker_cookbook.supervised.data import conversation_to_datum
from tinker_cookbook.tokenizer_utils import get_tokenizer

FEW_SHOT = [{"role": "user", "content": "What is 4 + 5?"}, {"role": "assistant", "content": "9"}]
"""The arithmetic environment's few-shot turn (tinker_cookbook.recipes.math_rl.arithmetic_env)."""


@dataclass
class WarmStartConfig:
    base_model: str
    """The server's base model (a local HF directory, whose tokenizer the renderer uses)."""
    base_url: str = "http://127.0.0.1:8000"
    api_key: str = "tml-local"
    steps: int = 40
    batch: int = 16
    learning_rate: float = 1e-2
    rank: int = 8
    seed: int = 0
    name: str = "warm"
    """The save_state name."""


def conversation(rng: random.Random) -> list[dict]:
    x, y = rng.randint(0, 100), rng.randint(0, 100)
    return [*FEW_SHOT, {"role": "user", "content": f"What is {x} + {y}?"}, {"role": "assistant", "content": str(x + y)}]


def main(argv: list[str] | None = None) -> str:
    config = tyro.cli(WarmStartConfig, args=argv)
    renderer = renderers.get_renderer("role_colon", get_tokenizer(config.base_model))
    service = tinker.ServiceClient(base_url=config.base_url, api_key=config.api_key)
    client = service.create_lora_training_client(
        base_model=config.base_model, rank=config.rank, seed=config.seed
    ).result()
    rng = random.Random(config.seed)
    last = renderers.TrainOnWhat.LAST_ASSISTANT_MESSAGE
    for step in range(config.steps):
        data = [conversation_to_datum(conversation(rng), renderer, 256, last) for _ in range(config.batch)]
        result = client.forward_backward(data, "cross_entropy")
        client.optim_step(tinker.types.AdamParams(learning_rate=config.learning_rate)).result()
        print(f"step {step}: loss:sum {result.result().metrics['loss:sum']:.3f}", flush=True)
    path = client.save_state(config.name).result().path
    print(path, flush=True)
    return path


if __name__ == "__main__":
    main()
