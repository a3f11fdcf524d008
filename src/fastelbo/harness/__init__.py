"""Judge any KernelBench-style candidate against a reference problem: compile, check, bench.

Nothing here knows about VAEs. A problem file defines `Model`, `get_inputs()`,
`get_init_inputs()` and a module-level `batch_size`; a candidate file defines `ModelNew` with the
same constructor. Reference and candidate code only ever run in worker processes (`worker.py`),
so a hang, a crash or a poisoned CUDA context cannot take the harness down: a check uses one
worker for the candidate (its build, then every regime) and, unless the reference's outputs are
cached (`refcache.py`), one for the reference. Library entry points: `check.run_check`,
`compile.run_compile`, `bench.run_bench`; their reports' `to_dict()` follows `schema.py`.
"""
