"""The official `openai` client talks to connex-router as to any OpenAI server."""

import openai


def client(router: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0)


def test_non_stream_completion(cluster):
    reply = client(cluster).completions.create(model="mock", prompt="Hello", max_tokens=7)
    assert reply.object == "text_completion"
    assert reply.usage.completion_tokens == 7
    assert len(reply.choices[0].text.split()) == 7
    assert reply.choices[0].finish_reason == "length"


def test_stream_chat(cluster):
    api = client(cluster)
    messages = [{"role": "user", "content": "Say something"}]
    whole = api.chat.completions.create(model="mock", messages=messages, max_tokens=6)
    stream = api.chat.completions.create(
        model="mock",
        messages=messages,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, ids = [], None, set()
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
    assert "".join(pieces) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 6
    assert len(ids) == 1


def test_errors_are_openai_errors(cluster):
    api = client(cluster)
    try:
        api.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    except openai.NotFoundError as err:
        assert "no-such-model" in str(err)
    else:
        raise AssertionError("unknown model was accepted")
    try:
        api.completions.create(model="mock", prompt="x", max_tokens=-3)
    except openai.BadRequestError as err:
        assert err.status_code == 400
    else:
        raise AssertionError("negative max_tokens was accepted")
