"""Builds a tiny random-weight Llama and its tokenizer locally (no hub access).

The vLLM tests and `bench/run vllm_resume` serve this model: 2 layers, hidden 64,
head_dim 32 (the smallest head size vLLM's CPU attention backend supports), random
weights from seed 0, and a byte-level BPE tokenizer trained on the local Python
standard library, with a small chat template. Building it takes a few seconds; the
result is cached in a folder keyed by this file's recipe version.

    python tests/vllm/tiny_model.py [DEST]     # prints the model folder
"""

import glob
import os
import sys
import sysconfig
from pathlib import Path

RECIPE = "tiny-llama-v1"
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DEST = ROOT / ".cache" / RECIPE
VOCAB = 2048
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus() -> list[str]:
    """Local text to train the tokenizer on: the standard library's sources, sorted."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))[:200]
    return [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]


def build_tokenizer(dest: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(dest)


def build_model(dest: Path, **layers) -> None:
    """The tiny Llama; `layers` adds to its config (the sliding-window model's
    `layer_types` and `sliding_window`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        **layers,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(dest, safe_serialization=True)


def ensure(dest: Path = DEFAULT_DEST) -> Path:
    """Returns the model folder, building it first if it is missing."""

    def build(tmp: Path) -> None:
        build_tokenizer(tmp)
        build_model(tmp)

    return build_once(dest, RECIPE, build)


SLIDING_RECIPE = "tiny-llama-sliding-v1"
# Its second layer attends to the last SLIDING_WINDOW tokens only: with vLLM's
# hybrid KV cache manager, two KV cache groups (full and sliding window).
SLIDING_WINDOW = 64


def ensure_sliding(dest: Path = ROOT / ".cache" / SLIDING_RECIPE) -> Path:
    """The tiny Llama with one full-attention and one sliding-window layer
    (Llama's `layer_types`, as vLLM reads them), same tokenizer recipe."""

    def build(tmp: Path) -> None:
        build_tokenizer(tmp)
        build_model(
            tmp,
            layer_types=["full_attention", "sliding_attention"],
            sliding_window=SLIDING_WINDOW,
        )

    return build_once(dest, SLIDING_RECIPE, build)


def build_once(dest: Path, recipe: str, build) -> Path:
    """`dest`, built by `build` into a folder of this process's first and
    renamed into place when whole (marked DONE with `recipe`), unless it is
    there already: concurrent builders never see half a model."""
    if (dest / "DONE").exists():
        return dest
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    build(tmp)
    (tmp / "DONE").write_text(recipe + "\n")
    try:
        tmp.rename(dest)
    except OSError:
        # Another process built it first; theirs is as good as ours.
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return dest


if __name__ == "__main__":
    print(ensure(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DEST))
    print(ensure_sliding())
