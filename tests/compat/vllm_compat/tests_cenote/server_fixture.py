"""The project's ``tests/server_fixture.py``, loaded by path: vLLM's copied tests own the package
name ``tests`` in this folder."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[3] / "server_fixture.py"
_spec = importlib.util.spec_from_file_location("cenote_server_fixture", _PATH)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
ServerProcess = _module.ServerProcess
free_port = _module.free_port
