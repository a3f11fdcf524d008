"""`fastelbo bench`: candidates timed against eager PyTorch and torch.compile, as data rows.

    bench.py       run_bench (the parent) and bench_entry / bench_reference (the worker side,
                   run under guard/timing.py and guard/pool.py)
    bench_rows.py  a row's verdict: correctness of the timed calls, noise, the floor
    floor.py       the physical floor (FLOPs and bytes at the device's peak)
"""
