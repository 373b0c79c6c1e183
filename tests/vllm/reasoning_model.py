"""Builds a tiny Llama that answers fixed chats with reasoning and tool calls.

A random-weight model ends early and never forms a tool call, so vLLM's
reasoning and tool-call parsers are never exercised by it. This model is
trained on the CPU, for a few seconds, to reproduce under greedy decoding a
fixed answer for each of five fixed chats (`CASES`): reasoning, `</think>`,
then either a text answer or a pythonic tool call list with two calls
(`[get_weather(city='Paris', unit='celsius'), get_local_time(zone=...)]`,
the format of vLLM's `pythonic` tool parser), then EOS. The chat template
pre-opens `<think>` after `<|assistant|>` (as DeepSeek-R1's does), so the
model's output starts inside the reasoning: vLLM 0.32's deepseek_r1 streaming
parser puts the `<think>` marker itself into the reasoning when a model emits
it in one engine step with the next tokens, which a loaded engine does.

The answers are laid out so that token `KILL_AT` of each falls at the kill
point the case is named after (`kill_regions`): mid-reasoning, at the
`</think>` boundary, mid-content, inside a tool call's arguments, between the
two calls. One decoder killed while it streams all five covers them all.

Served with `--reasoning-parser deepseek_r1 --tool-call-parser pythonic
--enable-auto-tool-choice`, vLLM's own chat answer then has `reasoning`,
`content` and `tool_calls` (`EXPECTED`). The tokenizer is a byte-level
BPE (trained on the local standard library, like tiny_model.py) whose
vocabulary has `<think>` and `</think>` as single, non-special tokens (as
DeepSeek-R1's and Qwen3's have: the reasoning parser looks their ids up, and
the text keeps them, so the parser can split on them); the chat template
renders the offered tools' names and parameters. The model: 2 layers,
hidden 128, head_dim 32 (the smallest head size vLLM's CPU attention takes).

Training stops once every answer token, EOS included, is the argmax of the
model's bf16 logits (the engines run it in bf16) by a margin of at least
`MARGIN` over the runner-up, so that kernels that round differently (vLLM's
CPU attention, a resumed decoder computing the generated tokens as prompt)
cannot change a greedy token; the build fails loudly otherwise. The result is
cached in a folder keyed by `RECIPE`.

    python tests/vllm/reasoning_model.py [DEST]     # prints the model folder
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_model  # noqa: E402

RECIPE = "reasoning-llama-v3"
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DEST = ROOT / ".cache" / RECIPE
MODEL_NAME = "reasoner"
VOCAB = 2048
THINK, END_THINK = "<think>", "</think>"
# Engine flags that make vLLM parse this model's answers.
PARSER_ARGS = [
    "--reasoning-parser",
    "deepseek_r1",
    "--tool-call-parser",
    "pythonic",
    "--enable-auto-tool-choice",
]
# Greedy tokens must win by this much (logits, bf16) at every answer position.
MARGIN = 6.0
MAX_STEPS = 1500
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|>You may call these tools:"
    "{%- for tool in tools %}{% set f = tool['function'] if 'function' in tool else tool %}"
    "{{ '\\n- ' }}{{ f['name'] }}({{ (f.get('parameters') or {}).get('properties', {}) | list "
    "| join(', ') }}): {{ f.get('description') or '' }}"
    "{%- endfor %}<|end|>{% endif %}"
    "{%- for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}<|end|>{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|><think>{% endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_local_time",
            "description": "The current time in a time zone.",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string"}},
                "required": ["zone"],
            },
        },
    },
]


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# name: (messages, tools offered, reasoning, what follows `</think>`). Each case is
# named after the kill point that falls at token KILL_AT of its answer (see
# kill_regions): all five are there at once, so that one decoder killed while it
# streams all of them covers every kill point.
CASES: dict[str, tuple[list[dict], list[dict] | None, str, str]] = {
    "reasoning": (
        _user("Is 17 a prime number? Explain briefly."),
        None,
        "The user asks whether 17 is prime. 17 is odd, so 2 does not divide it; 1 + 7 = 8, "
        "so 3 does not either. It does not end in 0 or 5, so 5 does not divide it. 5 squared "
        "is 25, more than 17, so no divisor is left to try.",
        "Yes, 17 is a prime number: its only divisors are 1 and 17.",
    ),
    "boundary": (
        _user("What is the capital of France?"),
        TOOLS,
        "The user asks for the capital of France. No tool is needed: it is a well known fact, "
        "so I can reply to it directly.",
        "The capital of France is Paris, which is also its largest city.",
    ),
    "content": (
        _user("Write a short poem about the sea."),
        None,
        "A short poem about the sea is wanted.",
        "The sea is wide and the sea is deep, it rocks the boats and the fish to sleep. It "
        "sings at night and it shines by day, and it carries the ships from the bay away.",
    ),
    "arguments": (
        _user("What is the weather in Paris right now, and what time is it there?"),
        TOOLS,
        "The user wants the current weather in Paris and the local time there. I will call "
        "both of the tools at once.",
        "[get_weather(city='Paris', unit='celsius'), get_local_time(zone='Europe/Paris')]",
    ),
    "between": (
        _user("How is the weather in Tokyo, and what time is it there?"),
        TOOLS,
        "The user asks about Tokyo: its weather and its local time.",
        "[get_weather(city='Tokyo', unit='celsius'), get_local_time(zone='Asia/Tokyo')]",
    ),
}
# The token (count of generated tokens at the cut) where every case is at the
# kill point it is named after.
KILL_AT = 48

# What vLLM's parsers make of each answer: reasoning, content, and the tool
# calls as (name, arguments).
EXPECTED = {
    "reasoning": (CASES["reasoning"][2], CASES["reasoning"][3], []),
    "boundary": (CASES["boundary"][2], CASES["boundary"][3], []),
    "content": (CASES["content"][2], CASES["content"][3], []),
    "arguments": (
        CASES["arguments"][2],
        None,
        [
            ("get_weather", {"city": "Paris", "unit": "celsius"}),
            ("get_local_time", {"zone": "Europe/Paris"}),
        ],
    ),
    "between": (
        CASES["between"][2],
        None,
        [
            ("get_weather", {"city": "Tokyo", "unit": "celsius"}),
            ("get_local_time", {"zone": "Asia/Tokyo"}),
        ],
    ),
}


def answer(case: str) -> str:
    """The text the model generates for a case (the template opened `<think>`)."""
    _, _, reasoning, rest = CASES[case]
    return f"{reasoning}{END_THINK}{rest}"


def chat_body(case: str, **extra) -> dict:
    """The chat request of a case, greedy, as a client would send it."""
    messages, tools, _, _ = CASES[case]
    body = {"model": MODEL_NAME, "messages": messages, "temperature": 0, "max_tokens": 400}
    if tools is not None:
        body["tools"] = tools
    return body | extra


def build_tokenizer(dest: Path):
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=tiny_model.SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_model.corpus(), trainer=trainer)
    # Single tokens that decode as text (special=False), as in DeepSeek-R1's
    # and Qwen3's vocabularies: vLLM's chat detokenizer skips special tokens.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK, END_THINK)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(dest)
    return fast


def encode_cases(fast) -> dict[str, tuple[list[int], list[int]]]:
    """Each case's prompt ids (as vLLM renders the chat) and answer ids + EOS."""
    out = {}
    for name, (messages, tools, _, _) in CASES.items():
        prompt = fast.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        prompt_ids = fast(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = fast(answer(name), add_special_tokens=False)["input_ids"]
        assert fast.decode(answer_ids) == answer(name), (name, fast.decode(answer_ids))
        out[name] = (prompt_ids, answer_ids + [fast.eos_token_id])
    return out


def kill_regions(model: Path = DEFAULT_DEST) -> dict[str, tuple[int, int]]:
    """For each case, the range (inclusive) of k, the count of the answer's tokens
    the client (the router's journal) has when its decoder dies, for which the
    continuation starts at the kill point the case is named after:

    - `reasoning`: inside the reasoning, at least 4 tokens from either end;
    - `boundary`: within 3 tokens of `</think>` (before or after it);
    - `content`: inside the text answer, at least 4 tokens from either end;
    - `arguments`: inside the first call's arguments (after `get_weather(` and
      at least one argument token, before the `'),` that closes the call);
    - `between`: after the first call's `'),`, before the second call's `(`.

    Every range holds KILL_AT (the build checks it)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    regions = {}
    for name in CASES:
        pieces = tok.encode(answer(name), add_special_tokens=False).tokens
        n = len(pieces) + 1  # + EOS
        end = pieces.index(END_THINK)
        if name == "reasoning":
            regions[name] = (4, end - 4)
        elif name == "boundary":
            regions[name] = (end - 3, end + 3)
        elif name == "content":
            regions[name] = (end + 5, n - 4)
        else:
            opens = [i for i, p in enumerate(pieces) if p == "("]
            closes = pieces.index("'),")
            if name == "arguments":
                regions[name] = (opens[0] + 2, closes)
            else:
                regions[name] = (closes + 1, opens[1])
    return regions


def margins(model, batch, labels):
    """Per answer position: (argmax == label, top-1 minus the best other logit)."""
    import torch

    with torch.no_grad():
        logits = model(**batch).logits[:, :-1].float()
    target = labels[:, 1:]
    mask = target != -100
    safe = target.clamp(min=0)
    right = logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    others = logits.scatter(-1, safe.unsqueeze(-1), float("-inf")).max(-1).values
    return (right - others)[mask]


def train(dest: Path, fast, cases) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # One thread: on a busy 2-core machine two OpenMP threads spin against the
    # other processes and a step takes 50 times longer (2 s instead of 40 ms).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    width = max(len(p) + len(a) for p, a in cases.values())
    ids = torch.full((len(cases), width), fast.pad_token_id)
    labels = torch.full((len(cases), width), -100)
    attention = torch.zeros((len(cases), width), dtype=torch.long)
    for row, (prompt, answer) in enumerate(cases.values()):
        seq = prompt + answer
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, len(prompt) : len(seq)] = torch.tensor(answer)
        attention[row, : len(seq)] = 1
    batch = {"input_ids": ids, "attention_mask": attention}
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    began = time.monotonic()
    worst = float("-inf")
    for step in range(1, MAX_STEPS + 1):
        loss = model(**batch, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            worst = margins(model.to(torch.bfloat16), batch, labels).min().item()
            model.float()
            if worst >= MARGIN:
                break
    torch.set_num_threads(threads)
    took = time.monotonic() - began
    if worst < MARGIN:
        raise RuntimeError(
            f"{RECIPE}: after {step} steps ({took:.0f}s) the worst greedy margin is "
            f"{worst:.2f} < {MARGIN}: the model does not reproduce its answers reliably"
        )
    print(
        f"{RECIPE}: trained {step} steps in {took:.1f}s, worst margin {worst:.2f}", file=sys.stderr
    )
    model.to(torch.bfloat16).save_pretrained(dest, safe_serialization=True)


def ensure(dest: Path = DEFAULT_DEST) -> Path:
    """Returns the model folder, building it first if it is missing."""

    def build(tmp: Path) -> None:
        fast = build_tokenizer(tmp)
        for name, (low, high) in kill_regions(tmp).items():
            assert low <= KILL_AT <= high, f"{name}: token {KILL_AT} is not in {low}..{high}"
        train(tmp, fast, encode_cases(fast))

    return tiny_model.build_once(dest, RECIPE, build)


if __name__ == "__main__":
    print(ensure(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DEST))
