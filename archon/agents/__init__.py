"""Multi-turn agents: tools, environments and the loops that run them."""
