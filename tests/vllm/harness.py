"""Real processes for the vLLM tier: `vllm serve` engines, connex-router, clients.

Owns starting and stopping them on free loopback ports. Each engine runs in its
own process group (API server, EngineCore, and with TP 2 its workers; with TP 1
the worker runs inside the EngineCore), so that a test can kill a
whole engine at once, as a machine failure would, and teardown leaves nothing
behind. Used by tests/vllm/ and by `bench/run vllm_resume`. What every tier
shares (the router, ports, waiting, metrics, failure logs) is
tests/connex_harness, re-exported here for the tier's tests.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The harness the Python tiers share lies beside this folder.
sys.path.append(str(Path(__file__).resolve().parents[1]))
import connex_harness  # noqa: E402
import tiny_model  # noqa: E402
from connex_harness import ROOT as ROOT  # noqa: E402
from connex_harness import RUNNING  # noqa: E402
from connex_harness import free_port as free_port  # noqa: E402
from connex_harness import sum_metric as sum_metric  # noqa: E402
from connex_harness import wait_for as wait_for  # noqa: E402

# The engines' interpreter: the repo's venv, or another with its own vLLM build
# (tests/gpu/run: the CUDA one).
PYTHON = os.environ.get("CONNEX_VLLM_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
MODEL_NAME = "tiny"
BLOCK_SIZE = 32
# Engine start on 2 busy cores takes 40-120 s; this bounds a hung start.
START_TIMEOUT_S = float(os.environ.get("CONNEX_VLLM_START_TIMEOUT_S", "600"))

# Engines are not pinned to cores by default ("nobind"): with more engines than
# cores, an engine pinned to a core it shares with a busy one starves its transfer
# threads (a resume took 11 s pinned vs 1.6 s unpinned here). "pin" pins each
# engine's OMP thread to its `core`.
BIND = os.environ.get("CONNEX_VLLM_BIND", "nobind")

# The vLLM tier runs with the hold listeners' transfer secret set, as the chart
# deploys them: every engine, router and test-side Reader started from here takes
# it from the environment (never from a command line).
TRANSFER_SECRET = os.environ.setdefault("CONNEX_TRANSFER_SECRET", "connex-vllm-tier-secret")

# One folder for the logs of every process this session starts.
LOG_DIR = Path(os.environ.get("CONNEX_VLLM_LOG_DIR") or tempfile.mkdtemp(prefix="connex-vllm-"))


def model_dir() -> Path:
    return tiny_model.ensure()


@dataclass
class Engine:
    """One `vllm serve` process group on a loopback port."""

    name: str
    kv_config: dict | None = None
    core: int = 0
    extra_args: list[str] = field(default_factory=list)
    # VLLM_CPU_OMP_THREADS_BIND for this engine, when not the tier's (a TP=2
    # engine binds one rank per core: "0|1").
    threads_bind: str | None = None
    # Another model folder and served name than the tiny model's
    # (reasoning_model.py's engines).
    model: Path | None = None
    served_model_name: str = MODEL_NAME
    port: int = field(default_factory=free_port)
    log_dir: Path = LOG_DIR
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ctrl(self) -> str:
        """The control address of its hold listener (ConnexConnector's
        `ctrl_port`, rank 0's with TP > 1)."""
        assert self.kv_config is not None
        return f"127.0.0.1:{self.kv_config['kv_connector_extra_config']['ctrl_port']}"

    @property
    def title(self) -> str:
        """Its name among the running parts (a failed test's report shows its log)."""
        return f"engine {self.name}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self) -> Engine:
        args = [
            PYTHON,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model or model_dir()),
            "--served-model-name",
            self.served_model_name,
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "2048",
            "--enforce-eager",
            "--block-size",
            str(BLOCK_SIZE),
            "--seed",
            "0",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--uvicorn-log-level",
            "warning",
        ]
        if self.kv_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_config)]
        # Every engine's extra flags from the environment (tests/gpu/run: each
        # engine's share of one GPU).
        args += shlex.split(os.environ.get("CONNEX_VLLM_EXTRA_ARGS", ""))
        args += self.extra_args
        env = dict(os.environ)
        if "--distributed-executor-backend" not in args:
            # One process fewer per engine (a third of its start: each imports
            # torch and vLLM): the worker runs inside the EngineCore process,
            # vLLM's uniprocess executor, what vLLM itself picks for one GPU.
            # The CPU platform turns `uni` into `mp` unless V1 multiprocessing
            # is off, which only vLLM's offline `LLM` reads otherwise (the API
            # server's EngineCore stays a process of its own). Engines with
            # another TP size name their executor (`mp`).
            args += ["--distributed-executor-backend", "uni"]
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND=self.threads_bind
            or (str(self.core % (os.cpu_count() or 1)) if BIND == "pin" else BIND),
            VLLM_NO_USAGE_STATS="1",
            PYTHONUNBUFFERED="1",
        )
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 (closed with the process)
        self.proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        RUNNING[self.title] = self
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Waits for /health; returns the seconds it took. Raises with the log tail."""
        assert self.proc is not None
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - began
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signals the whole process group (API server, EngineCore, worker)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def core_pids(self) -> list[int]:
        """The processes that compute (EngineCore, any workers), without the API
        server: freezing these alone lets the API server send on everything
        they computed."""
        import psutil

        assert self.proc is not None
        children = psutil.Process(self.proc.pid).children(recursive=True)
        return [c.pid for c in children if c.name().startswith("VLLM::")]

    def stop(self) -> None:
        if self.proc is None:
            return
        RUNNING.pop(self.title, None)
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        # Children (EngineCore, worker) share the group: make sure none is left.
        self.kill(signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def metric(self, name: str, absent: float | None = None) -> float:
        """Sum of a Prometheus metric's samples on this engine (see `sum_metric`)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum_metric(text, name, absent)


def concurrently(calls: dict) -> dict:
    """Runs every call at once, each in a thread of its own, and returns each
    one's result, or the exception it raised (`outcome` raises it again, in
    the test the call is for). An engine batches requests that come together:
    a set of answers costs little more than one, where the model's answers do
    not depend on what they are batched with (reasoning_model.py's model is
    trained to wide logit margins for that)."""
    with ThreadPoolExecutor(max_workers=max(1, len(calls))) as pool:
        futures = {key: pool.submit(call) for key, call in calls.items()}
    results = {}
    for key, future in futures.items():
        error = future.exception()
        results[key] = error if error is not None else future.result()
    return results


def outcome(result):
    """A result of `concurrently`: the value, or its exception raised."""
    if isinstance(result, BaseException):
        raise result
    return result


def start_all(engines: list[Engine]) -> dict[str, float]:
    """Starts engines concurrently; returns each one's startup seconds."""
    for engine in engines:
        engine.start()
    try:
        with ThreadPoolExecutor(len(engines)) as pool:
            times = list(pool.map(lambda e: e.wait_ready(), engines))
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return {e.name: t for e, t in zip(engines, times, strict=True)}


@contextmanager
def running(engines: list[Engine]) -> Iterator[list[Engine]]:
    """The engines started together (`start_all`), stopped however the block
    ends: a test module's fixture of its own engines."""
    start_all(engines)
    try:
        yield engines
    finally:
        for engine in engines:
            engine.stop()


def warm_up(engines: list[Engine]) -> None:
    """Makes each engine's first forward (a two-token completion): it is slow
    (lazy initialisation, in every worker of a TP 2 engine), and a pull from
    or into an engine that had not made it yet waited behind it past the
    transfer's 10 s frame timeout (seen in fresh clones' runs)."""
    for engine in engines:
        complete(engine.url, [1, 2, 3], 2, model=engine.served_model_name)


class Router(connex_harness.Router):
    """connex-router for this tier: it names the decoder that served
    (x-connex-decoder, which the tests check), and its log is kept in LOG_DIR."""

    def __init__(self, *flags: str) -> None:
        super().__init__(*flags, expose_instance_headers=True, log_dir=LOG_DIR)


# ---- clients ------------------------------------------------------------------


def complete(url: str, prompt, max_tokens: int, **extra) -> dict:
    """A non-stream greedy completion; returns the JSON answer."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    if reply.status_code != 200:
        raise RuntimeError(f"HTTP {reply.status_code}: {reply.text}")
    return reply.json()


def stream_events(url: str, path: str, body: dict, timeout_s: float = 300) -> Iterator[dict]:
    """POSTs a streaming request; yields each SSE data event as JSON."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=timeout_s) as reply:
        if reply.status_code != 200:
            reply.read()
            raise RuntimeError(f"HTTP {reply.status_code}: {reply.text}")
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                return
            yield json.loads(data)
