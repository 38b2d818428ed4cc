"""What a run records: each step's metrics (metrics: RUN_DIR/metrics.jsonl), mirrored to the
experiment trackers (trackers: TensorBoard, wandb, MLflow, Trackio), the sample tables (samples)
and the model card of each exported adapter (model_card).

The modules import the standard library's `logging` by its absolute name, which this package's
own name does not shadow.
"""
