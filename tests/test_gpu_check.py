"""``scripts/gpu_check.sh`` on a machine without a GPU (it runs what needs none, writes its report and says so),
and the GPU names ``benchmarks/gpu.py`` maps to peak FLOP/s (which the MFU test of ``tests/gpu`` relies on)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from fabric.utilities.throughput import device_peak_flops

#: Slow: scripts/gpu_check.sh run whole (`bash scripts/test.sh --end-to-end`; CI runs it).
pytestmark = pytest.mark.end_to_end

ROOT = Path(__file__).resolve().parents[1]


def _benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fabric_benchmarks_gpu", ROOT / "benchmarks" / "gpu.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


def test_gpu_check_without_a_gpu_runs_the_cpu_parts_and_reports_every_part(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("with a GPU, gpu_check.sh runs the whole GPU check (minutes): run it directly")
    report = tmp_path / "report.md"
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "report.md"],  # relative: to the caller's directory
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert "no CUDA GPU here: ran only the CPU-runnable parts" in result.stdout
    text = report.read_text()
    assert "- no CUDA GPU here: ran only the CPU-runnable parts" in text
    assert "- result: every part that ran passed" in text
    smoke = "GPU benchmark, CPU smoke run (benchmarks/gpu.py --cpu-smoke)"
    parts = {  # each part that runs here -> what its output shows
        "real-GPU tests (tests/gpu), collected: they skip without a GPU": r"\d+ skipped in",
        "faked-CUDA tests (tests/accelerators/test_cuda.py)": r"\d+ passed in",
        smoke: r"\| gpt \| eager \| fabric \| \S+ \| [\d.]+ \|",
    }
    for title, output in parts.items():
        assert re.search(rf"\| \d \| {re.escape(title)} \| 0 \| \d+ \|", text), title  # the summary row
        section = re.split(r"\n## \d+\. ", text.split(f". {title}\n", 1)[1], maxsplit=1)[0]
        assert "- exit code: 0" in section and re.search(output, section), section
    assert "needs a CUDA GPU (run scripts/gpu_check.sh on a GPU machine)" in text
    assert re.search(r"## \d\. examples on cuda\n\n- skipped: no CUDA GPU here", text)
    for framework in ("torch", "fabric", "lightning", "accelerate"):  # a timing, or why there is none
        assert re.search(rf"\| mlp \| eager \| {framework} \| [^|]+ \| ([\d.]+|not installed) \|", text), framework


@pytest.mark.parametrize(
    ("device_name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.5e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835.5e12),
        ("NVIDIA H200", 989.5e12),
        ("NVIDIA GH200 480GB", 989.5e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362.05e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA GeForce GTX 1080", None),
    ],
)
def test_the_peak_bf16_flops_by_gpu_name(device_name: str, peak: float | None) -> None:
    assert device_peak_flops(device_name, torch.bfloat16) == peak
