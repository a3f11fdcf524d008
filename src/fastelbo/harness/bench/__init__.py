"""`fastelbo bench`: candidates timed against eager PyTorch and torch.compile, as data rows.

    bench.py       run_bench: the parent, which sends guard/bench_entry.py's tasks (the worker
                   side, beside the candidate) by spec and judges what they return
    bench_rows.py  a row's verdict: correctness of the timed calls, noise, the floor
    floor.py       the physical floor (FLOPs and bytes at the device's peak)
"""
