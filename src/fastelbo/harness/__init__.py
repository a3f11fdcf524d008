"""Judge any KernelBench-style candidate against a reference problem: compile, check, bench.

Nothing here knows about VAEs. A problem file defines `Model`, `get_inputs()`,
`get_init_inputs()` and a module-level `batch_size`; a candidate file defines `ModelNew` with the
same constructor. Reference and candidate code only ever run in worker processes
(`guard/worker.py`, started and held to their limits by `guard/supervisor.py`), so a hang, a
crash or a poisoned CUDA context cannot take the harness down: a check uses one worker for the
candidate (its build, then every regime) and, unless the reference's outputs are cached
(`refcache.py`), one for the reference. Library entry points:
`check.check.run_check`, `check.compile.run_compile`, `bench.bench.run_bench`,
`agents.session.Session`; their reports' `to_dict()` follows `schema.py`.

A wing per trust zone (docs/layout.md): `guard/` runs in or around the candidate's process and
imports none of `check/`, `bench/`, `agents/`, `batch/` (the parent's judging and its APIs);
the modules here are the core both sides share.
"""
