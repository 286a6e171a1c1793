#!/usr/bin/env bash
# Set up, then run the test suite: the fast tier by default (tests marked slow
# are left out), every test with --full (what CI runs). Further arguments go to
# pytest. GPU tests skip cleanly where CUDA is absent.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tier=(-m "not slow")
if [ "${1:-}" = "--full" ]; then
  tier=()
  shift
fi
bash scripts/setup.sh
"${PYTHON:-python3}" -m pip install --quiet -r requirements-test.txt
"${PYTHON:-python3}" -m pytest tests -q ${tier[@]+"${tier[@]}"} "$@"
