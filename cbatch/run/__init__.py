"""Running a job: rows in, results out, whatever executes them (one engine, a Ray pool, the simulator).

    preflight.py   every check that can refuse a job, before anything loads; the resolved job
    results.py     RowResult: one row's outcome, and the record the part files and OUTPUT hold
    executor.py    LocalExecutor: rows through one engine (parse, tokenize, queue, step, results)
    driver.py      the one loop: feed rows, poll the executor, store results, display, interrupts
    job.py         `cbatch run`: preflight -> engine -> driver -> report and OUTPUT
    exit_codes.py  the exit codes and which failure maps to which
"""
