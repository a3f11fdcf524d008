"""`fastelbo judge`: every pair of a run (problem, candidate) judged as `fastelbo check` judges one.

One role per module, data flowing down the list:

    layout.py    the run on disk: KernelBench's layout or a manifest, as Pairs
    store.py     the results store (SQLite): a row per pair, keyed by what decides its verdict
    slot.py      one device's warm Session, running one job at a time (a check, a bench)
    engine.py    where slots run: threads of this process (local) or Dask distributed (dask)
    run.py       the schedule: builds ahead, checks, one bench per problem, the store, progress
    analysis.py  the summary (compile / correct rates, fast_p) and KernelBench's eval_results.json
    cli.py       the subcommand's arguments and its output

Imports nothing heavy: the command line parses its arguments without torch or dask.
"""
