"""A structured request's continuation inside vLLM's real Scheduler: the
connector fast-forwards its grammar over the generated tokens its prompt ends
with (`kv_transfer_params.generated_tokens`, grammar_replay.py).

Each test plays the worker: after the replay it samples, one step at a time,
the tokens the first decoder would have gone on with, then EOS. vLLM's own
update advances the grammar on each and ends the request with an error on a
token the grammar rejects (and refuses EOS before the document is complete),
so a request that finishes with `stop` had its grammar exactly where the first
decoder left it: a grammar started at its root, or fed a replayed token twice,
or fed reasoning, rejects the rest.
"""

from __future__ import annotations

import logging
import time

import pytest
import reasoning_model as rm
from connex.adapters.vllm.grammar_replay import GrammarReplay
from sched_utils import EOS, make_request, make_scheduler, runner_output, step
from transformers import AutoTokenizer
from vllm.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
ANSWER = '{"city": "Paris de France", "days": 12}'


class Records(logging.Handler):
    """The replay's log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def replay_log():
    handler = Records()
    logger = logging.getLogger("connex.vllm.grammar_replay")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def tokens(tokenizer, *pieces: str) -> list[int]:
    """Each piece tokenized alone (a special or marker token stays one)."""
    return [t for piece in pieces for t in tokenizer.encode(piece, add_special_tokens=False)]


def start(sched, prompt: list[int], generated: int, so: StructuredOutputsParams, max_tokens=64):
    """A continuation of `generated` tokens (the prompt's last ones), its
    grammar compiled as the engine core does before it reaches the scheduler."""
    request = make_request(
        prompt,
        max_tokens=max_tokens,
        kv_transfer_params={"generated_tokens": generated},
        structured_outputs=so,
    )
    sched.structured_output_manager.grammar_init(request)
    sched.add_request(request)
    deadline = time.monotonic() + 30
    while not request.structured_output_request.is_grammar_ready:
        assert time.monotonic() < deadline, "the grammar did not compile"
        time.sleep(0.01)
    return request


def sample(sched, request, rest: list[int]):
    """Steps with the worker sampling `rest` then EOS; the request's finish."""
    pending = [*rest, EOS]
    sampled: list[int] = []
    for _ in range(len(pending) + 10):
        out = sched.schedule()
        token = pending[0] if request.request_id in out.num_scheduled_tokens else 0
        results = sched.update_from_output(out, runner_output(out, token=token))
        if request.request_id in out.num_scheduled_tokens:
            pending.pop(0)
        for eco in results.values():
            for output in eco.outputs:
                if output.request_id == request.request_id:
                    sampled += output.new_token_ids
                    if output.finish_reason is not None:
                        return str(output.finish_reason), sampled
    raise AssertionError(f"{request.request_id} did not finish; sampled {sampled}")


@pytest.fixture(scope="module")
def tiny_tokenizer():
    import harness

    return AutoTokenizer.from_pretrained(str(harness.model_dir()))


@pytest.mark.parametrize("cut", ["mid-string", "between-keys", "mid-number"])
def test_a_json_grammar_continues_where_the_first_decoder_left_it(tiny_tokenizer, cut, replay_log):
    sched = make_scheduler("kv_consumer")
    answer = tokens(tiny_tokenizer, ANSWER)
    text_at = {"mid-string": ANSWER.index("de"), "between-keys": ANSWER.index(' "days')}
    text_at["mid-number"] = ANSWER.index("2}")
    # The first token whose text reaches the cut.
    k = next(
        i for i in range(1, len(answer)) if len(tiny_tokenizer.decode(answer[:i])) >= text_at[cut]
    )
    assert 0 < k < len(answer)
    prompt = tokens(tiny_tokenizer, "<|user|>Where to?<|end|><|assistant|>") + answer[:k]
    request = start(sched, prompt, k, StructuredOutputsParams(json=SCHEMA))
    # vLLM asks the connector again while a request waits (and after a
    # preemption): the grammar is fed the replayed tokens once.
    assert sched.connector.get_num_new_matched_tokens(request, 0) == (0, False)
    finish, sampled = sample(sched, request, answer[k:])
    assert finish == "stop", (finish, tiny_tokenizer.decode(sampled))
    assert sampled[:-1] == answer[k:]
    assert request.structured_output_request.grammar.is_terminated()
    assert any(f"after {k} generated tokens" in line for line in replay_log), replay_log
    assert not sched.requests


def test_the_same_tokens_on_a_grammar_started_at_its_root_are_rejected(tiny_tokenizer):
    """What the replay prevents: the continuation's tokens on a grammar that
    was not fast-forwarded (the request says nothing of generated tokens)."""
    sched = make_scheduler("kv_consumer")
    answer = tokens(tiny_tokenizer, ANSWER)
    k = len(answer) // 2
    request = make_request(
        tokens(tiny_tokenizer, "<|user|>Where to?<|end|><|assistant|>") + answer[:k],
        max_tokens=64,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    sched.structured_output_manager.grammar_init(request)
    sched.add_request(request)
    while not request.structured_output_request.is_grammar_ready:
        time.sleep(0.01)
    finish, _ = sample(sched, request, answer[k:])
    assert finish == "error"


def test_regex_and_grammar_constraints_continue(tiny_tokenizer):
    """A regex, and an EBNF grammar (what vLLM's input processor turns a
    `choice` into before the engine core sees it)."""
    sched = make_scheduler("kv_consumer")
    for so, text in (
        (StructuredOutputsParams(regex=r"w[0-9]+( w[0-9]+)*"), "w12 w345 w6"),
        (
            StructuredOutputsParams(grammar='root ::= "Paris de France" | "Paris Texas"'),
            "Paris Texas",
        ),
    ):
        ids = tokens(tiny_tokenizer, text)
        k = max(1, len(ids) // 2)
        request = start(sched, tokens(tiny_tokenizer, "<|user|>?<|end|>") + ids[:k], k, so)
        finish, sampled = sample(sched, request, ids[k:])
        assert finish == "stop", (so, tiny_tokenizer.decode(sampled))


def test_tokens_the_grammar_rejects_end_the_request_with_an_error(tiny_tokenizer, replay_log):
    """A first decoder whose tokens this grammar refuses (another vLLM or
    model): the request ends with an error before anything is sampled."""
    sched = make_scheduler("kv_consumer")
    wrong = tokens(tiny_tokenizer, '{"city": 7')
    prompt = tokens(tiny_tokenizer, "<|user|>Where to?<|end|><|assistant|>") + wrong
    request = start(sched, prompt, len(wrong), StructuredOutputsParams(json=SCHEMA))
    out, outputs = step(sched)
    assert request.request_id not in out.num_scheduled_tokens
    (output,) = [o for o in outputs if o.request_id == request.request_id]
    assert str(output.finish_reason) == "error"
    assert output.new_token_ids == []
    assert not sched.requests
    (line,) = [line for line in replay_log if request.request_id in line]
    assert "its grammar rejected the" in line and "accepted" in line, line


def test_a_refused_continuation_is_never_scheduled_while_it_waits_to_end(tiny_tokenizer):
    """Asked again about a refused request (each step until the update that
    ends it, or for good on a Scheduler without its error set), the connector
    still refuses it: it never runs from a grammar that rejected its tokens."""
    sched = make_scheduler("kv_consumer")

    class WithoutErrorSet:
        """A Scheduler with the replay's internals but no error set."""

        structured_output_manager = sched.structured_output_manager

    sched.connector.scheduler.replay = GrammarReplay(WithoutErrorSet())
    wrong = tokens(tiny_tokenizer, '{"city": 7')
    prompt = tokens(tiny_tokenizer, "<|user|>Where to?<|end|><|assistant|>") + wrong
    request = start(sched, prompt, len(wrong), StructuredOutputsParams(json=SCHEMA))
    for _ in range(3):
        out, outputs = step(sched)
        assert request.request_id not in out.num_scheduled_tokens
        assert not [o for o in outputs if o.request_id == request.request_id]


def test_a_vllm_without_the_internals_refuses_at_start_and_fails_structured_continuations(
    tiny_tokenizer, replay_log
):
    sched = make_scheduler("kv_consumer")

    class Older:
        """A Scheduler whose structured output manager has no accept_tokens."""

        structured_output_manager = object()
        grammar_compile_error_reqs = sched.grammar_compile_error_reqs

    replay = GrammarReplay(Older())
    assert replay.unsupported is not None and "accept_tokens" in replay.unsupported
    assert any("not continued after a decoder failure" in line for line in replay_log)
    sched.connector.scheduler.replay = replay
    answer = tokens(tiny_tokenizer, ANSWER)
    prompt = tokens(tiny_tokenizer, "<|user|>Where to?<|end|><|assistant|>") + answer[:4]
    request = start(sched, prompt, 4, StructuredOutputsParams(json=SCHEMA))
    _, outputs = step(sched)
    (output,) = [o for o in outputs if o.request_id == request.request_id]
    assert str(output.finish_reason) == "error" and output.new_token_ids == []
    # A plain continuation is no grammar's business: it runs.
    plain = make_request(prompt, max_tokens=2, kv_transfer_params={"generated_tokens": 4})
    sched.add_request(plain)
    finish, _ = sample(sched, plain, [42, 43])
    assert finish == "length"


def test_the_running_vllm_has_what_the_replay_relies_on():
    sched = make_scheduler("kv_consumer")
    assert sched.connector.scheduler.replay.unsupported is None


@pytest.fixture(scope="module")
def reasoner():
    model = rm.ensure()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    return model, tokenizer


@pytest.mark.parametrize("killed", ["inside the reasoning", "after </think>"])
def test_a_reasoning_request_replays_the_grammar_from_the_end_of_its_reasoning(
    reasoner, killed, replay_log
):
    """deepseek_r1: the grammar starts after `</think>`. The prompt pre-opens
    `<think>` (the model's chat template does); a continuation's prompt holds
    the reasoning, and its end when killed after it, which vLLM alone would
    read as a prompt that ended reasoning and feed the reasoning to the
    grammar."""
    model, tokenizer = reasoner
    sched = make_scheduler("kv_consumer", model_dir=model, reasoning_parser="deepseek_r1")
    original = tokens(tokenizer, "<|user|>Where to?<|end|><|assistant|>", rm.THINK)
    output = tokens(tokenizer, "Let me see, somewhere warm.", rm.END_THINK, ANSWER)
    end = output.index(tokenizer.convert_tokens_to_ids(rm.END_THINK))
    k = end // 2 if killed == "inside the reasoning" else end + 3
    request = start(sched, original + output[:k], k, StructuredOutputsParams(json=SCHEMA))
    finish, sampled = sample(sched, request, output[k:])
    assert finish == "stop", (killed, tokenizer.decode(sampled))
    assert sampled[:-1] == output[k:]
    # The grammar took the whole answer after the reasoning (an answer left
    # unconstrained would finish too, its grammar never fed).
    structured = request.structured_output_request
    assert structured.reasoning_ended is True
    assert structured.grammar.is_terminated()
