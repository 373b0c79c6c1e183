"""schemathesis against a live router with mock engines: generated requests for
every route of openapi/openapi.yaml get no 5xx, and every answer conforms to the
spec (status code, content type, headers, body schema); invalid input is refused.

Bounded: a fixed number of examples per operation, a fixed seed (override with
SCHEMATHESIS_SEED), and a wall-clock timeout per run.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from connex_harness import ROOT, Router, mock_cluster

SPEC = ROOT / "openapi" / "openapi.yaml"
SCHEMATHESIS = ROOT / ".venv" / "bin" / "schemathesis"
MAX_TOKENS = 64
# Response checks, plus refusing invalid input. Not `positive_data_acceptance`:
# JSON Schema's `integer` also matches 1.0, which the router (like vLLM) refuses
# as a token id, and no schema can say otherwise.
CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_headers_conformance",
        "response_schema_conformance",
        "negative_data_rejection",
    ]
)
MUTATING = r"^/(v1/instances|admin/instances)"
# The routes of each listener (the client one serves OpenAI and the probes).
CLIENT = (
    r"^/(v1/(completions|chat/completions|models|embeddings|score|rerank|messages"
    r"|responses|responses/[^/]+|responses/[^/]+/cancel)"
    r"|health|ready|tokenize|detokenize|pooling|score|rerank)$"
)
INTERNAL_READS = r"^/(metrics|admin/requests)$"


def deployment_spec(tmp_path: Path) -> Path:
    """The spec as this test's deployment configures it: `max_tokens` at most the
    router's --max-tokens-limit (so that generation stays short)."""
    spec = yaml.safe_load(SPEC.read_text())
    fields = spec["components"]["schemas"]["GenerationFields"]["properties"]
    fields["max_tokens"]["maximum"] = MAX_TOKENS
    fields["max_completion_tokens"]["maximum"] = MAX_TOKENS
    path = tmp_path / "openapi.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_schemathesis(spec: Path, url: str, *filters: str) -> None:
    seed = os.environ.get("SCHEMATHESIS_SEED", "20261203")
    args = [
        str(SCHEMATHESIS),
        "run",
        str(spec),
        "--url",
        url,
        "--header",
        "Authorization: Bearer t",
        "--checks",
        CHECKS,
        "--max-examples",
        "25",
        "--seed",
        seed,
        "--workers",
        "1",
        "--request-timeout",
        "20",
        "--no-color",
        "--output-sanitize",
        "false",
        *filters,
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "passed" in done.stdout or "No issues found" in done.stdout, done.stdout[-2000:]


@pytest.fixture
def routers():
    """A router with a prefill and a decode mock, and a bare one for the
    registration and admin writes (so that registrations of made-up engines
    generated there never receive traffic)."""
    with (
        mock_cluster(
            ["--max-tokens-limit", str(MAX_TOKENS)], [("prefill", []), ("decode", [])]
        ) as serving,
        Router() as bare,
    ):
        yield serving.url, serving.internal, bare.internal


def test_openapi_conformance_of_a_live_router(routers, tmp_path):
    serving, serving_internal, bare = routers
    spec = deployment_spec(tmp_path)
    run_schemathesis(spec, serving, "--include-path-regex", CLIENT)
    run_schemathesis(spec, serving_internal, "--include-path-regex", INTERNAL_READS)
    run_schemathesis(spec, bare, "--include-path-regex", MUTATING)
