"""The RL run: the loop over RL steps (loop.RLRun), its tasks (task), the run directory (run_dir),
asynchronous rollouts (producer, versions), multi-turn episodes (episodes), what a step reports
(step_metrics), and stopping on SIGTERM (interrupt).

Kept free of imports, as archon.rl is.
"""
