"""Sending adapters (or merged weights) from the trainer to rollout engines: the weight-sync
strategies (archon.sync.weight_sync: `build_weight_sync`, `WeightSync.publish`) and their parts.

Transports: in-process (the native engine shares the model), disk (a PEFT directory the server
loads) and collective (a stateless process group between trainer rank 0 and the server's workers,
tensors broadcast in size-bounded buckets; the group and the buckets are archon.parallel's
process_group and buckets, shared with the workers' extension). Modes: adapter (the server applies
the LoRA) and merged (the modules holding LoRA-adapted weights, W + s*B@A where adapted, loaded
into the server's base weights); full (every weight).
"""

from archon.parallel.buckets import receive_tensors, send_tensors
from archon.parallel.process_group import StatelessGroup
from archon.sync.payload import adapter_payload, full_payload, merged_payload
from archon.sync.weight_sync import InProcessSync, WeightSync, build_weight_sync

__all__ = [
    "InProcessSync",
    "StatelessGroup",
    "WeightSync",
    "adapter_payload",
    "build_weight_sync",
    "full_payload",
    "merged_payload",
    "receive_tensors",
    "send_tensors",
]
