"""`cbatch run --ray ...`: flags -> RayOptions; Ray's failures -> one line and an exit code."""
from __future__ import annotations

import sys

from cbatch.run.exit_codes import EXIT_ROW_ERRORS
from cbatch.run.preflight import JobError, JobOptions
from cbatch.scaleout import LOCAL, RayMissingError


def run_on_ray(options: JobOptions, address: str, replicas: int | None, gpus_per_replica: int | None,
               block_rows: int) -> int:
    """Raises JobError for a bad job (exit 2), like `run_job`."""
    from cbatch.scaleout.ray_job import RayOptions, ReplicaFailure, run_ray_job  # imports Ray only when run

    ray_options = RayOptions(
        address=None if address == LOCAL else address, replicas=replicas,
        gpus_per_replica=gpus_per_replica, block_rows=block_rows,
    )
    try:
        return run_ray_job(options, ray_options)
    except RayMissingError as exc:
        raise JobError(f"--ray: {exc}") from None
    except ReplicaFailure as exc:
        print(f"cbatch: error: {exc}; finished rows are saved, run the same command again to resume", file=sys.stderr)
        return EXIT_ROW_ERRORS  # the job did not finish; its rows are kept
