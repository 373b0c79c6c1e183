"""A single `vllm serve` of the tiny model: the baseline the P/D tests compare with."""

import harness


def test_greedy_completions_are_deterministic(plain):
    prompt = "def main(argv):\n    parser = argparse.ArgumentParser()\n"
    first = harness.complete(plain.url, prompt, max_tokens=48)
    again = harness.complete(plain.url, prompt, max_tokens=48)
    choice, choice_again = first["choices"][0], again["choices"][0]
    assert len(choice["token_ids"]) == 48
    assert choice["token_ids"] == choice_again["token_ids"]
    assert choice["text"] == choice_again["text"]
    # The same prompt given as token ids continues identically.
    by_ids = harness.complete(plain.url, choice["prompt_token_ids"], max_tokens=48)
    assert by_ids["choices"][0]["token_ids"] == choice["token_ids"]


def test_stream_equals_non_stream(plain):
    prompt = "import os\nimport sys\n"
    whole = harness.complete(plain.url, prompt, max_tokens=32)["choices"][0]
    body = {
        "model": harness.MODEL_NAME,
        "prompt": prompt,
        "max_tokens": 32,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    ids: list[int] = []
    text = ""
    for event in harness.stream_events(plain.url, "/v1/completions", body):
        for choice in event["choices"]:
            ids += choice.get("token_ids") or []
            text += choice.get("text") or ""
    assert ids == whole["token_ids"]
    assert text == whole["text"]
