"""The RL run.

- loop: RLRun, the run loop: the phases' order, the run's progress, the lifetime of what it starts.
- context: RunContext, what every phase reads (trainer, tokenizer, layout, engines, stop ids),
  built once.
- the phases of an RL step, each a function of the context: collect (rollouts, made now or ahead
  by a producer), score, prepare (advantages, the packed batch, log-probs), update and publish,
  evaluate; checkpoints (save and resume).
- step_metrics: TaskStep, one task's record of a step as the phases fill it in, and the metrics.
- task: a task of the run (data, reward, algorithm, adapter version, streaks).
- engines (the rollout engines), batches (packing rollouts for training), teachers (on-policy
  distillation), episodes (multi-turn tasks), producer and versions (asynchronous rollouts),
  run_dir (the run directory's check and lock), interrupt (SIGTERM as Ctrl-C).

Kept free of imports, as archon.rl is.
"""
