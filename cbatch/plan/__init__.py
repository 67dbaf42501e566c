"""`cbatch plan`: check every row and predict a run before booking the machine, without loading weights.

    devices.py   the machine the run will use (a preset or this one): its KV pool and a default cost model
    lengths.py   how many tokens each row is planned to generate (max_tokens, or an earlier run's lengths)
    simulate.py  the job's rows through `LocalExecutor` and the real scheduler, priced by a cost model;
                 the search over --max-num-seqs / --max-num-batched-tokens
    command.py   options, the printed plan, the --report JSON, the exit code
"""
