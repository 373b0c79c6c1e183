"""Structured output continued after a decoder failure: the grammar
fast-forwarded over the generated tokens a continuation's prompt ends with.

vLLM creates a request's grammar matcher at its root and advances it only on
the tokens that request samples. A continuation (docs/resume.md) carries the
first decoder's generated tokens in its prompt, so without this its grammar
would start again at the root: a second JSON document after half of one. The
router says how many of the prompt's last tokens are generated output
(`kv_transfer_params.generated_tokens`); before the request's first step, the
connector feeds exactly those to the grammar, as vLLM's own update after each
step would have, so that the first new token is sampled under the grammar's
state where the first decoder left it.

A grammar that rejects the replayed tokens (another vLLM version or model on
the first decoder) ends the request with an error, never an answer that breaks
its schema; so does a structured continuation on an engine whose internals
below differ (the feature is refused at start, with one log line).

vLLM 0.32 internals this relies on, each checked when the connector starts:
- the Scheduler creates its `structured_output_manager` before its KV
  connector (`v1/core/sched/scheduler.py` `Scheduler.__init__`): the connector
  finds that Scheduler in the frames that construct it;
- `StructuredOutputManager.accept_tokens(request, ids)` advances a request's
  grammar on tokens already in `request.all_token_ids` (the scheduler's own
  call after each step), skipping those before a reasoning parser's end and
  latching `structured_output_request.reasoning_ended` past it;
  `StructuredOutputManager._get_reasoner(request)` (the request's reasoning
  parser, None without one) and `enable_in_reasoning`;
- `StructuredOutputManager._get_constraint_bounds` asks the reasoning parser
  whether the *prompt* ended reasoning while `reasoning_ended` is None: a
  continuation's prompt holds the generated tokens, so the replay first sets
  `reasoning_ended` from the original prompt (the prompt without them);
- `Request.structured_output_request` (a `StructuredOutputRequest` with
  `grammar`, compiled by the time the connector is asked about the request:
  vLLM keeps it in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR until then) and
  `reasoning_ended`;
- `Scheduler.grammar_compile_error_reqs`: a set of request ids the scheduler
  finishes with FINISHED_ERROR at its next `update_from_output` (vLLM's own
  path for a grammar that failed to compile). The Scheduler makes it after
  its connector, so it is looked up when a request is refused; without it a
  refused request is never scheduled (the router's first-token timeout moves
  it on), never run from the grammar's root.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("connex.vllm.grammar_replay")

# The continuation's kv_transfer_params key: how many of the prompt's last
# tokens are generated output (router/src/pd/resume.rs `GENERATED_TOKENS`).
GENERATED_TOKENS = "generated_tokens"
# How many frames up from the connector's constructor the Scheduler may be
# (Scheduler.__init__ -> KVConnectorFactory.create_connector -> connector).
MAX_FRAMES = 12


@dataclass(frozen=True)
class Refused:
    """A continuation this decoder must end with an error."""

    error: str


def generated_tokens(params: object, prompt_len: int) -> int | str:
    """How many of the prompt's last tokens the router says are generated
    output (0 when it says nothing), or why the value is not one."""
    if not isinstance(params, Mapping) or params.get(GENERATED_TOKENS) is None:
        return 0
    value = params[GENERATED_TOKENS]
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= prompt_len:
        return f"{GENERATED_TOKENS} must be an integer in 0..{prompt_len} (the prompt's length)"
    return value


def find_scheduler(start: Any) -> Any | None:
    """The vLLM Scheduler whose constructor is creating the connector: the
    `self` of the first calling frame that has a `structured_output_manager`."""
    frame = start
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and hasattr(owner, "structured_output_manager"):
            return owner
        frame = frame.f_back
    return None


def missing_internals(scheduler: Any) -> list[str]:
    """The internals (module docstring) that `scheduler` lacks, by name."""
    if scheduler is None:
        return ["the vLLM Scheduler constructing the connector"]
    missing = []
    manager = getattr(scheduler, "structured_output_manager", None)
    for name in ("accept_tokens", "_get_reasoner"):
        if not callable(getattr(manager, name, None)):
            missing.append(f"StructuredOutputManager.{name}")
    if not hasattr(manager, "enable_in_reasoning"):
        missing.append("StructuredOutputManager.enable_in_reasoning")
    try:
        from vllm.v1.structured_output.request import StructuredOutputRequest
    except ImportError:
        missing.append("vllm.v1.structured_output.request.StructuredOutputRequest")
    else:
        fields = getattr(StructuredOutputRequest, "__dataclass_fields__", {})
        for name in ("reasoning_ended",):
            if name not in fields:
                missing.append(f"StructuredOutputRequest.{name}")
        if not isinstance(getattr(StructuredOutputRequest, "grammar", None), property):
            missing.append("StructuredOutputRequest.grammar")
    try:
        from vllm.v1.request import Request
    except ImportError:
        missing.append("vllm.v1.request.Request")
    else:
        if not isinstance(getattr(Request, "use_structured_output", None), property):
            missing.append("Request.use_structured_output")
    return missing


class GrammarReplay:
    """Fast-forwards each structured continuation's grammar, once per request
    (also across preemption: the grammar then already holds its tokens)."""

    def __init__(self, scheduler: Any | None) -> None:
        missing = missing_internals(scheduler)
        self.unsupported = (
            "this vLLM lacks what the connector's grammar replay relies on ("
            + ", ".join(missing)
            + ")"
            if missing
            else None
        )
        self._scheduler = scheduler
        self._manager = None if scheduler is None else scheduler.structured_output_manager
        self._done: set[str] = set()
        # Refused requests stay refused each time the scheduler asks again
        # (before the update that finishes them, or for good on a vLLM
        # without the scheduler's error set): never scheduled meanwhile.
        self._refused: dict[str, Refused] = {}
        if self.unsupported:
            logger.warning(
                "ConnexConnector: structured output is not continued after a decoder "
                "failure here: %s; such continuations end with an error",
                self.unsupported,
            )

    @classmethod
    def from_caller(cls) -> GrammarReplay:
        """The replay of the Scheduler that is constructing the connector."""
        frame = inspect.currentframe()
        try:
            return cls(find_scheduler(frame.f_back if frame else None))
        finally:
            del frame

    def forget(self, req_id: str) -> None:
        self._done.discard(req_id)
        self._refused.pop(req_id, None)

    def replay(self, request: Any) -> Refused | None:
        """Feeds a structured continuation's generated tokens to its grammar,
        the first time the scheduler asks about the request; a `Refused` when
        the request must end with an error (already queued for that)."""
        req_id = request.request_id
        if req_id in self._done:
            return self._refused.get(req_id)
        self._done.add(req_id)
        if not getattr(request, "use_structured_output", False):
            return None
        prompt = list(request.prompt_token_ids or ())
        count = generated_tokens(getattr(request, "kv_transfer_params", None), len(prompt))
        if count == 0:
            return None
        if isinstance(count, str):
            return self._refuse(req_id, count)
        structured = getattr(request, "structured_output_request", None)
        if self.unsupported or structured is None:
            return self._refuse(req_id, self.unsupported or "it has no structured_output_request")
        assert self._manager is not None
        grammar = structured.grammar
        if grammar is None or isinstance(grammar, Exception):
            # vLLM asks the connector only once the grammar compiled.
            return self._refuse(req_id, "its grammar is not compiled")
        tail = prompt[len(prompt) - count :]
        if structured.reasoning_ended is None:
            structured.reasoning_ended = self._prompt_ended_reasoning(
                request, prompt[: len(prompt) - count]
            )
        before = getattr(grammar, "num_processed_tokens", None)
        if self._manager.accept_tokens(request, tail):
            logger.info(
                "request %s: structured output continued after %d generated tokens",
                req_id,
                count,
            )
            return None
        after = getattr(grammar, "num_processed_tokens", None)
        accepted = (
            f"{after - before} accepted"
            if isinstance(before, int) and isinstance(after, int)
            else "some rejected"
        )
        return self._refuse(
            req_id, f"its grammar rejected the {count} generated tokens ({accepted})"
        )

    def _prompt_ended_reasoning(self, request: Any, original: list[int]) -> bool | None:
        """Whether the prompt before the generated tokens ended reasoning, as
        vLLM decides it for a request's first step (None without a reasoning
        parser, or with the grammar on inside reasoning: nothing to decide)."""
        assert self._manager is not None
        if self._manager.enable_in_reasoning:
            return None
        reasoner = self._manager._get_reasoner(request)
        if reasoner is None:
            return None
        return bool(reasoner.is_reasoning_end(original))

    def _refuse(self, req_id: str, why: str) -> Refused:
        """Queues `req_id` to be finished with an error by the scheduler's next
        update (the caller keeps it from being scheduled meanwhile). Without
        the scheduler's set (a vLLM constructed otherwise) the request is
        never scheduled: the router's first-token timeout moves it on."""
        error = f"structured output cannot be continued: {why}"
        # The scheduler's own set for grammars that failed to compile (made
        # after the connector, so looked up here).
        errors = getattr(self._scheduler, "grammar_compile_error_reqs", None)
        if isinstance(errors, set):
            logger.error("request %s: %s; the request ends with an error", req_id, error)
            errors.add(req_id)
        else:
            logger.error(
                "request %s: %s; this vLLM has no Scheduler.grammar_compile_error_reqs to "
                "end it with: it is not scheduled",
                req_id,
                error,
            )
        refused = Refused(error)
        self._refused[req_id] = refused
        return refused
