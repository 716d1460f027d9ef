#!/usr/bin/env bash
# Idempotent setup for a fresh machine: a Python 3.11 venv with liverl and its dev extras,
# and the Apache Kafka jars (resolved once by Maven into ~/.cache/liverl/kafka).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev]"
.venv/bin/python -m pip check
.venv/bin/python -c "from pipeline.kafka.broker import LocalBroker; from pipeline.settings import Settings; s = Settings(); s.uses_local_broker and LocalBroker(s).ensure_jars()"
