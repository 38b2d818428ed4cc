"""RL post-training with LoRA, in subpackages:

- config: RLConfig, its command line and files, and validate() with every rule of the settings.
- algorithms: the algorithm registry, advantage estimators and policy losses.
- rewards: reward configs and the scorer (reward terms, servers, judges); the reward functions
  and the worker process that runs them sit beside it (reward_fns, reward_worker).
- data: prompt datasets, their sources and batches; reasoning-gym tasks; the synthetic task.
- run: the RL run (RLRun) and its phases.
- logging: metrics, experiment trackers, sample tables, model cards.

The other modules here are the old paths of moved modules, re-exporting them for one release.
Kept free of imports so that reward worker processes start without loading torch.
"""
