"""archon: a PyTorch-native backend for RL post-training of LLMs with LoRA."""

__version__ = "0.1.0"
