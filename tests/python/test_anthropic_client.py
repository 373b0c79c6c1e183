"""The official `anthropic` client talks to connex-router's `/v1/messages`
(Anthropic's Messages API, run as a chat through prefill/decode)."""

import anthropic
import pytest

WEATHER = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def client(router: str, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=router, api_key="unused", max_retries=0, **kwargs)


def test_messages_create_and_stream_with_tools(cluster):
    api = client(cluster)
    whole = api.messages.create(
        model="mock",
        max_tokens=10,
        tools=WEATHER,
        output_config={"effort": "low"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    assert whole.type == "message" and whole.role == "assistant"
    assert [block.type for block in whole.content] == ["thinking", "tool_use"]
    assert whole.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == 10
    # Streamed: the client's own accumulation of the events gives the same.
    with api.messages.stream(
        model="mock",
        max_tokens=10,
        tools=WEATHER,
        output_config={"effort": "low"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and "message_stop" in kinds
    assert [block.type for block in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == whole.content[0].thinking
    assert final.content[1].input == whole.content[1].input
    # The tool's result goes back, and the model answers on.
    call = final.content[1]
    after = api.messages.create(
        model="mock",
        max_tokens=4,
        tools=WEATHER,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [c.model_dump() for c in final.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}],
            },
        ],
    )
    assert after.usage.output_tokens == 4


def test_errors_are_anthropic_errors_and_models_list(cluster):
    api = client(cluster)
    with pytest.raises(anthropic.NotFoundError) as missing:
        api.messages.create(
            model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        api.messages.create(
            model="mock",
            max_tokens=2,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"no_such_field": 1},
        )
    assert [m.id for m in api.models.list()] == ["mock"]
