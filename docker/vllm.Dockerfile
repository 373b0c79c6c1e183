# vLLM with the connex-ai package (the ConnexConnector and the agent): the image
# the chart's vLLM pools run. Built where its base can be pulled (a registry);
# linted in tests/run here, where none can be.
#
#   .venv/bin/maturin build --release -m shim-py/Cargo.toml -o target/wheels
#   docker build -f docker/vllm.Dockerfile -t connex-vllm:0.32.0 target/wheels
#
# The wheel built so has the tcp transfer backend only: the chart's
# vllm.image.backends default ([tcp]), and the chart refuses ucx or mooncake
# until listed there. For them, build the wheel with `--features ucx` (and add
# UCX's libraries, Debian's libucx0, to the image) or `--features mooncake`
# (and Mooncake's Transfer Engine library), then list the backend.
#
# VLLM_VERSION is the one vLLM version Connex supports; README, the chart and
# tests/vllm/install.sh name the same (tests/python/test_versions.py checks it).
ARG VLLM_VERSION=0.32.0
FROM vllm/vllm-openai:v${VLLM_VERSION}
COPY connex_ai-*.whl /tmp/wheels/
RUN pip install --no-cache-dir --no-deps /tmp/wheels/connex_ai-*.whl && rm -rf /tmp/wheels
