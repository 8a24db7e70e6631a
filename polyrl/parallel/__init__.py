"""Learner ranks under torch.distributed (docs/scaling.md): the process group and its launch (``group``,
``launch``), the policy sharded with FSDP2 (``fsdp``), weight sync to engines and sharded checkpoints."""
