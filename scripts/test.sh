#!/usr/bin/env bash
# Set up, then run the test suite. GPU tests skip cleanly where CUDA is absent.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
"${PYTHON:-python3}" -m pip install --quiet -r requirements-test.txt
"${PYTHON:-python3}" -m pytest tests -q "$@"
