"""The parent's judging of correctness: `fastelbo check` and `fastelbo compile`.

    check.py    run_check: plans the regimes, drives the reference's and the candidate's
                workers (their worker side: guard/reference_tasks.py, candidate_tasks.py)
    verdicts.py the check's second half: the candidate's regimes replayed and judged, envelopes
    compile.py  run_compile: does the candidate import and build, with the compiler's errors
"""
