"""The parent's judging of correctness: `fastelbo check` and `fastelbo compile`.

    check.py    run_check: plans the regimes, drives the reference's and the candidate's
                workers, judges, reports (their worker side: guard/reference_tasks.py,
                candidate_tasks.py)
    compile.py  run_compile: does the candidate import and build, with the compiler's errors
"""
