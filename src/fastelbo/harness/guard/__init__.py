"""The guard: what runs in or around a candidate's process, and keeps it honest.

Imports none of check/, bench/, agents/ or batch/ (tests/test_layout.py): a worker holds the
guard and the harness's core, never the parent's judging.

    worker.py     a worker process (forked or a new interpreter): runs the tasks sent by spec
    supervisor.py the parent's side of a worker: start it, send tasks, hold its limits, outcomes
    forking.py    forked workers' start
    sandbox.py    Landlock, no capabilities, resource limits, the private directories
    seccomp.py    no process outside the worker's own tree
    process_tree.py  the worker's process tree, read and ended from the parent (/proc)
    orphans.py    every process a candidate starts dies with its check
    handoff.py    files handed to and read from a worker's directory
    shared.py     CUDA IPC inputs copied into a pool of their own
    loader.py     the problem's and the candidate's modules, loaded in the worker
    reference_tasks.py  check's reference worker: the reference pass, a resident regime's judging
    candidate_tasks.py  check's and compile's candidate worker: the build, the check, the import
    envelopes.py  the perturbed-reference envelope of a trial
    pool.py       bench's timed inputs, and which calls are judged
    timing.py     bench's timing loops
    gpu_metrics.py  bench's GPU measurements: a CUDA graph's replay, peak memory, kernels
    bench_entry.py  bench's worker tasks: an entry's timed rows, the reference's replays
    watch.py      the loops' own state, watched while the candidate runs
    integrity.py  the tripwires: timers, hooks, modes, the harness's own code
    scan.py       the static scan of a candidate's source
"""
