"""Tensor parallelism: each layer split across ranks (`shard`), their collectives (`comm`), the worker
processes (`group`). docs/tensor-parallel.md has the user's side."""


class WorkerFailure(Exception):
    """A tensor-parallel worker died or stopped answering: the environment failed, not the job's rows."""
