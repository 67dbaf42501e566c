"""Tensor parallelism: the ranks' collectives (`comm`), the worker processes (`group`); which share of each
layer a rank holds is the model's (cbatch/model/shard.py). docs/tensor-parallel.md has the user's side."""


class WorkerFailure(Exception):
    """A tensor-parallel worker died or stopped answering: the environment failed, not the job's rows."""
