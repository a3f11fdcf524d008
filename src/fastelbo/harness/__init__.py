"""Judge any KernelBench-style candidate against a reference problem: compile, check, bench.

Nothing here knows about VAEs. A problem file defines `Model`, `get_inputs()`,
`get_init_inputs()` and a module-level `batch_size`; a candidate file defines `ModelNew` with the
same constructor. Reference and candidate code only ever run in spawned worker processes
(`worker.py`), so a hang, a crash or a poisoned CUDA context cannot take the harness down.
"""
