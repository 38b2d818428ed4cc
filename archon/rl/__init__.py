"""RL pieces: data, rewards, advantages, losses, algorithms and synthetic tasks.

Kept free of imports so that reward worker processes start without loading torch.
"""
