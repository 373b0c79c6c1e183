"""The OpenAI Agents SDK's loop, unchanged, through connex-router on mock
engines that answer like a model (`--eos-after-tokens`): the model calls the
function tool, the SDK runs it and sends its output back as an item, the
model answers; streamed and not, chained by `previous_response_id`, and with
a decoder killed mid-turn."""

import asyncio

import openai
import pytest
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from connex_harness import mock_cluster

# Tokens of each answer, the end-of-sequence token last: a call's arguments
# or an answer of EOS_AFTER - 1 words.
EOS_AFTER = 12
MODEL = ["--enable-scale-out", "--eos-after-tokens", str(EOS_AFTER)]

set_tracing_disabled(True)


def agent(router_url: str, calls: list[str]) -> Agent:
    @function_tool
    def get_weather(words: str) -> str:
        """The weather where `words` say."""
        calls.append(words)
        return "sunny"

    client = openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0)
    model = OpenAIResponsesModel(model="mock", openai_client=client)
    return Agent(name="weather", instructions="Use the tool.", tools=[get_weather], model=model)


def cluster(d0_faults: list[str]):
    """A router (round robin over decoders d0 then d1), a prefill and two
    decoders answering like a model; d0 with `d0_faults`."""
    return mock_cluster(
        ["--decode-policy", "round_robin"],
        [
            ("prefill", []),
            ("decode", ["--id", "d0", *MODEL, *d0_faults]),
            ("decode", ["--id", "d1", *MODEL]),
        ],
    )


def assert_one_tool_round(result, calls: list[str]) -> None:
    kinds = [type(item) for item in result.new_items]
    assert kinds == [ToolCallItem, ToolCallOutputItem, MessageOutputItem], kinds
    assert len(calls) == 1 and len(calls[0].split()) == EOS_AFTER - 1, calls
    assert len(result.final_output.split()) == EOS_AFTER - 1, result.final_output
    # Two model calls, each ended by its end-of-sequence token.
    assert [r.usage.output_tokens for r in result.raw_responses] == [EOS_AFTER, EOS_AFTER]


def test_run_calls_the_tool_and_answers():
    with cluster([]) as router:
        calls: list[str] = []
        result = asyncio.run(Runner.run(agent(router.url, calls), "Weather in Paris?"))
        assert_one_tool_round(result, calls)
        # The next run chained by id: the router holds the conversation.
        chained = asyncio.run(
            Runner.run(
                agent(router.url, calls),
                "And tomorrow?",
                previous_response_id=result.last_response_id,
            )
        )
        assert len(calls) == 2
        assert len(chained.final_output.split()) == EOS_AFTER - 1


def test_run_streamed_calls_the_tool_and_answers():
    async def streamed(router_url: str, calls: list[str]):
        result = Runner.run_streamed(agent(router_url, calls), "Weather in Paris?")
        kinds = [event.type async for event in result.stream_events()]
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        return result

    with cluster([]) as router:
        calls: list[str] = []
        result = asyncio.run(streamed(router.url, calls))
        assert_one_tool_round(result, calls)


@pytest.mark.parametrize("stream", [False, True])
def test_a_decoder_killed_mid_turn_is_resumed_and_the_run_completes(stream):
    # d0 takes the first turn and dies after 6 of its 12 tokens, inside the
    # call's arguments; d1 continues it.
    faults = ["--crash-after-tokens", "6", "--decode-us-per-token", "1000"]
    with cluster(faults) as router:
        calls: list[str] = []

        async def run():
            if not stream:
                return await Runner.run(agent(router.url, calls), "Weather in Paris?")
            result = Runner.run_streamed(agent(router.url, calls), "Weather in Paris?")
            async for _ in result.stream_events():
                pass
            return result

        result = asyncio.run(run())
        assert_one_tool_round(result, calls)
        assert router.metric("connex_resumes_total") == 1
