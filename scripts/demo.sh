#!/usr/bin/env bash
# The main job: set up, then run the quickstart demo (GPU if present, else CPU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
"${PYTHON:-python3}" examples/quickstart.py "$@"
