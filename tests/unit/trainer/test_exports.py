"""The package exports the training API for scripts, and importing it costs the agent and the launcher no torch."""

from __future__ import annotations

import subprocess
import sys


def test_the_package_exports_the_training_api_without_importing_torch_until_asked():
    code = (
        "import sys, disttrain.trainer as t; assert 'torch' not in sys.modules, 'torch imported eagerly'; "
        "assert t.ElasticTrainer.__name__ == 'ElasticTrainer' and t.TrainerOptions and t.Step; "
        "assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
