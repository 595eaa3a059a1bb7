"""What every engine start pays: building a model imports nothing it does not need."""

from __future__ import annotations

import os
import subprocess
import sys

from factories.smollm2 import find_smollm2_gguf


def test_building_models_does_not_import_dynamo() -> None:
    """nn.Embedding's normal_ on the meta device imported torch._dynamo (1-1.5 s a start)."""
    code = (
        "import sys\n"
        "from cenote.config import default_model_path\n"
        "from cenote.models.config_reader import read_model_config\n"
        "from cenote.models.loader import load_model\n"
        f"for path in (default_model_path(), {str(find_smollm2_gguf())!r}):\n"
        "    load_model(read_model_config(str(path)))\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
