#!/usr/bin/env bash
# A separate virtual environment with llm-foundry 0.22.0, for the end-to-end tests that run its `llmfoundry train`
# unchanged through the Composer drop-in mode (tests/compat/test_llm_foundry.py). llm-foundry pins torch 2.7 and
# Composer, which does not install beside torch 2.13: it is installed without its dependencies, and those it imports
# are installed here at versions inside its pins (Composer itself is what the drop-in mode answers).
# One workaround for this machine, not for the product: mosaicml-streaming imports torchvision at its top
# (streaming.vision), and no torchvision wheel the registry offers imports against torch 2.13+cpu
# ("operator torchvision::nms does not exist"). A .pth file registers an empty `streaming.vision` before anything
# imports streaming; llm-foundry's text data never uses it.
# Usage: bash scripts/foundry_env.sh [VENV_DIR]   (default: .venv-foundry in the repository; about 2 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-foundry}"
python -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q "torch==2.13.0" "transformers==4.51.3" "tokenizers==0.21.4" "datasets==3.6.0" \
  "huggingface-hub==0.33.5" "accelerate==1.8.1" "omegaconf==2.4.0" "einops==0.8.1" "sentencepiece==0.2.0" \
  "catalogue==2.0.10" "typer==0.29.2" "tenacity==9.2.1" "torchmetrics==1.9.0" "mosaicml-cli==0.8.3" \
  "GitPython==3.1.44" "setuptools<81" "tabulate==0.10.0" "beautifulsoup4==4.15.0" "boto3==1.44.8" \
  "brotli==1.2.1" "python-snappy==0.7.3" "xxhash==3.8.2" "zstd==1.5.7.2" "paramiko==3.5.1" "matplotlib==3.11.2" \
  "mlflow-skinny==2.22.5"
"$venv/bin/pip" install -q --no-deps "llm-foundry==0.22.0" "mosaicml-streaming==0.12.0"
"$venv/bin/pip" install -q -e .
site_packages="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cat > "$site_packages/_fabric_no_streaming_vision.py" <<'PY'
"""Registers an empty ``streaming.vision`` (see scripts/foundry_env.sh): torchvision does not import here."""
import sys
import types

sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
PY
echo "import _fabric_no_streaming_vision" > "$site_packages/_fabric_no_streaming_vision.pth"
echo "$venv/bin/python"
