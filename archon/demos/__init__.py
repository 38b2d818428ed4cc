"""The built-in demos: what a run with no model.path trains, made here from nothing.

    warm_start      the demo model's warm start: a short SFT, or the weights archon ships
                    (warm_starts/: for the settings the demos and the tests use); `python -m
                    archon.demos.warm_start` writes them
    code_tool       the code-tool demo: its BPE tokenizer, its warm start's conversations with the
                    python sandbox, its held-out success in the episode loop
    reasoning_gym   the reasoning-gym demo's warm-start rows
    drafter         the demo base's draft head for speculative decoding (drafters/: shipped for
                    the demo's settings; `python -m archon.demos.drafter` writes it)

Their settings (the `demo` section) and the rules that keep a run's other settings those a warm
start was made for are archon.rl.config.demo's. DEMO_CONFIG is the demo's settings file, which the
recipe runs when it is given no model and the warm-start writer reads by default.
"""

from pathlib import Path

from archon import recipes

DEMO_CONFIG = Path(recipes.__file__).resolve().parent / "configs" / "demo.yaml"
