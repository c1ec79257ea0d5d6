"""Optional integrations: wandb, mlflow and transformers load only when used; a missing one names its extra."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


def test_importing_and_constructing_the_integrations_imports_none_of_their_packages() -> None:
    code = (
        "import sys\n"
        "from fabric.trainer import DataSpec, Trainer\n"
        "from fabric.trainer.loggers import MLFlowLogger, WandBLogger\n"
        "from fabric.trainer.profiler import Profiler, cyclic_schedule\n"
        "import fabric.trainer.huggingface\n"
        "MLFlowLogger(); WandBLogger(); Profiler(cyclic_schedule()); DataSpec([])\n"
        "print(sorted(m for m in ('wandb', 'mlflow', 'transformers', 'tokenizers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_missing_package_names_the_extra_that_brings_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from fabric.trainer.huggingface import HuggingFaceModel
    from fabric.trainer.loggers import MLFlowLogger, WandBLogger

    for name in ("wandb", "mlflow", "mlflow.tracking", "transformers"):
        monkeypatch.setitem(sys.modules, name, None)  # what an environment without the package looks like
    with pytest.raises(ImportError, match=r'pip install -e "\.\[wandb\]"'):
        WandBLogger().log_metrics({"loss": 1.0}, step=1)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[mlflow\]"'):
        MLFlowLogger().log_hyperparameters({"lr": 0.1})
    with pytest.raises(ImportError, match=r'pip install -e "\.\[transformers\]"'):
        HuggingFaceModel(torch.nn.Linear(1, 1))  # type: ignore[arg-type]
