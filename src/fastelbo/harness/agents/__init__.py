"""The agents' API: a warm Session, and the MCP tools over it.

    session.py       Session: compile_kernel, run_correctness, benchmark, submit_kernel, judge_batch
    server.py        `fastelbo serve`: the MCP tools (imports mcp only when run)
    tool_results.py  the tools' structured results
    summary.py       the full reports cut to what fits an agent's context window
"""
