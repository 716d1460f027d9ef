#!/usr/bin/env bash
# The README's test command: set up, start the local Kafka broker, run every test
# (unit and integration), and stop the broker even when tests fail.
set -euo pipefail
cd "$(dirname "$0")/.."
./.ci/setup.sh
export LIVERL_STATE_DIR="${LIVERL_STATE_DIR:-$PWD/.liverl/test}"
stop_broker() { .venv/bin/liverl broker down || true; }
trap stop_broker EXIT
.venv/bin/liverl broker up
.venv/bin/liverl topics apply
.venv/bin/ruff check pipeline tests bench
.venv/bin/ruff format --check pipeline tests bench
.venv/bin/mypy pipeline
# The package layers (pyproject.toml [tool.importlinter]).
.venv/bin/lint-imports
# Every runtime import is a runtime dependency (tests/test_runtime_only.py proves it running).
.venv/bin/deptry .
.venv/bin/python -m pytest "$@"
