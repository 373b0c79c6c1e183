#!/usr/bin/env bash
# Builds the PyO3 module connex._transfer (shim-py/) in place, so that
# shim-py/python is the `connex` package with its module; installs it into .venv
# (editable) for the vLLM engines and tests. Quiet and incremental.
#   tests/vllm/build-shim.sh [--release]
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/python ] || python3 -m venv .venv
if [ ! -x .venv/bin/maturin ]; then
    .venv/bin/pip install --quiet --disable-pip-version-check maturin==1.16.0
fi
VIRTUAL_ENV="$PWD/.venv" .venv/bin/maturin develop --quiet --manifest-path shim-py/Cargo.toml "$@" \
    2> >(grep -vE '^\s*(Compiling|Finished|Building|Installed|📦|🔗|🐍|🛠|💻)' >&2 || true)
