"""The machinery a run stands on: checkpoints (whole and sharded), torchrun process groups, run
locks, the device, and the allocator setting for CPU training.

Nothing here is imported by the model; `checkpoint` reads and writes models. The package face
(`mixture_of_depths.load_model`) re-exports the checkpoint loader.
"""
