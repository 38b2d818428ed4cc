"""A Tinker-compatible service: the `tinker` SDK (and recipes written on it) trains LoRA adapters and
samples from them on archon, through `python -m archon.serve --base-model DIR`.

Layout: config.py (the settings), server.py (HTTP, API keys, futures), handlers.py (the endpoints),
wire.py (the protobuf messages), backend.py (sessions, training clients, samplers), adapters.py
(LoRA models on the shared base, checkpoints and tinker:// paths), losses.py (the loss functions),
scoring.py and sampling.py (log-probs and the built-in engine's samples), training.py (forward and
forward_backward, several clients batched in one multi-LoRA forward), vllm_sampler.py (samples from
vLLM with --sampler vllm), ranks.py (the server under torchrun: FSDP2, TP or EP, calls broadcast from rank 0).
docs/tinker.md has the usage.
"""
