#!/usr/bin/env bash
# A separate virtual environment with litgpt and Lightning, for the end-to-end tests that run litgpt unchanged through
# the Lightning drop-in mode (tests/compat/test_litgpt.py). It cannot be the main one: Lightning installs its own
# `fabric` console script, and litgpt pins huggingface-hub<1.4, which the main environment's transformers refuses.
# Usage: bash scripts/litgpt_env.sh [VENV_DIR]   (default: .venv-litgpt in the repository; about 2 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-litgpt}"
python -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q "torch==2.13.0" "litgpt==0.5.13" "lightning==2.6.6" "jsonargparse[signatures]==4.41.0" requests "bitsandbytes==0.50.2"
"$venv/bin/pip" install -q -e .
echo "$venv/bin/python"
