"""Imports a module that does not exist (line 2)."""
import fastelbo_no_such_module  # noqa: F401


class ModelNew:
    pass
