"""benchmarks/device_wheels.py: the wheels a device call carries are the dependency closure of
mlxtend and the MCP SDK as installed here, extras and device markers honoured, less what the
device's image holds."""
from __future__ import annotations

import importlib.util
from pathlib import Path

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "device_wheels.py"
spec = importlib.util.spec_from_file_location("device_wheels", PATH)
device_wheels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(device_wheels)


def test_the_closure_follows_extras_and_the_devices_markers():
    got = device_wheels.needed()
    # pyjwt[crypto] brings cryptography, and it cffi (missed by hand on 2026-12-05)
    assert {"mcp", "mlxtend", "pydantic-core", "pyjwt", "cryptography", "cffi"} <= set(got)
    assert "anyio" in got  # carried on purpose (ALWAYS)
    # in the image, or asked for only by an extra nobody asked for, or on Windows only
    assert not {"numpy", "scikit-learn", "torch", "python-dotenv", "typer", "pywin32"} & set(got)
    assert all(v and v[0].isdigit() for v in got.values()), got


def test_a_root_not_installed_here_is_named():
    import pytest
    with pytest.raises(SystemExit, match="no-such-package-fastelbo"):
        device_wheels.needed(roots=("no-such-package-fastelbo",))
