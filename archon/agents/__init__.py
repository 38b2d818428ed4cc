"""Multi-turn agents: environments, tools, the families' chat formats on token ids, trajectories."""
