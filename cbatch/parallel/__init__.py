"""Tensor parallelism's ground floor: the ranks' collectives (`comm`), which the model holds, and the error of a
dead rank. Which share of each layer a rank holds is the model's (cbatch/model/shard.py); the worker processes
are the engine's (cbatch/engine/tensor_parallel.py). docs/tensor-parallel.md has the user's side."""


class WorkerFailure(Exception):
    """A tensor-parallel worker died or stopped answering: the environment failed, not the job's rows."""
