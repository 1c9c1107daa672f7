"""Things the toolkit makes itself, so the quickstart and the tests need no network and no downloads.

- `builtin:tiny-llama`: a small Llama-architecture model (random weights from a fixed seed) with a byte-level tokenizer
  (one llama.cpp's GGUF converter takes) and a ChatML chat template, written once as an ordinary Hugging Face folder.
- `builtin:greetings`: a generated chat dataset of three patterns (greet a name, shout a word, repeat a word) whose
  answers copy from the prompt, so a model that learned it answers prompts it never saw.
- `builtin:unseen-names`: 200 greetings of names that builtin:greetings never has, to evaluate the quickstart on.

Both are written under $FINETUNE_HOME (default ~/.cache/finetune) and are the same on every machine.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import string
import tempfile
from pathlib import Path

PREFIX = "builtin:"
VERSION = 4  # raised whenever what a builtin holds changes, so a folder an older toolkit built is not reused
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
TEMPLATE = Path(__file__).parent / "templates" / "chatml.jinja"
MODEL_TYPE = "llama"  # every builtin model's architecture
SPACE = "\u2581"  # the token a space becomes, as in SentencePiece
RESERVED = 4  # 256 bytes, 4 markup tokens and 4 reserved: the 264 embedding rows of the tiny Llama


def home() -> Path:
    return Path(os.environ.get("FINETUNE_HOME", Path.home() / ".cache" / "finetune"))


def is_builtin(name: str) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def resolve_model(name: str) -> str:
    """A local folder for `builtin:NAME` models, created on first use; other names are returned unchanged."""
    if not is_builtin(name):
        return name
    builders = {"tiny-llama": _write_tiny_llama}
    return str(_materialize(name, builders, "model"))


def resolve_dataset(name: str) -> str:
    """A local JSONL file for `builtin:NAME` datasets, created on first use; other names are returned unchanged."""
    if not is_builtin(name):
        return name
    builders = {"greetings": _write_greetings, "unseen-names": _write_unseen_names}
    return str(_materialize(name, builders, "dataset") / "train.jsonl")


def _materialize(name: str, builders: dict, what: str) -> Path:
    from finetune.errors import UserError

    key = name.removeprefix(PREFIX)
    if key not in builders:
        raise UserError(f"unknown builtin {what} {name!r}; builtin {what}s are: "
                        + ", ".join(PREFIX + k for k in builders))
    target = home() / "builtin" / f"{key}-v{VERSION}"
    if not (target / "done").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{key}-"))
        builders[key](staging)
        (staging / "done").write_text("")
        try:
            staging.rename(target)  # atomic: concurrent processes build their own copy, the first rename wins
        except OSError:
            shutil.rmtree(staging)
    return target


def make_tokenizer():
    """A byte-level tokenizer: one token per byte (a space is one token, "▁"), plus the chat markup tokens.

    It is laid out as a Llama 2-style tokenizer (BPE with byte fallback and no merges), the one layout llama.cpp's
    converter takes without recognizing a known model's vocabulary, so a builtin model also exports to GGUF. Each
    byte has the id it had in the GPT-2-style byte-level vocabulary of builtin version 3 (printable bytes first), so
    the quickstart trains exactly as it did."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    order = printable + [byte for byte in range(256) if byte not in printable]
    vocab = {SPACE if byte == ord(" ") else f"<0x{byte:02X}>": i for i, byte in enumerate(order)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        # the reserved ones fill the vocabulary up to the model's embedding rows, which the converter needs
        additional_special_tokens=["<|im_start|>"] + [f"<|reserved_{i}|>" for i in range(RESERVED)],
        add_prefix_space=False,  # llama.cpp would otherwise put a space before the text, as SentencePiece does
    )
    tokenizer.chat_template = TEMPLATE.read_text(encoding="utf-8")
    return tokenizer


def make_tiny_llama_config(tokenizer, **overrides):
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaConfig(**{**settings, **overrides})


def _write_tiny_llama(folder: Path) -> None:
    import safetensors.torch
    import torch
    from transformers import LlamaForCausalLM
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(make_tiny_llama_config(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.config.architectures = [type(model).__name__]  # what save_pretrained records, and TRL reads
    # Not model.save_pretrained: under a process group it writes only on global rank 0, and every machine of a
    # multi-machine run builds its own copy.
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    safetensors.torch.save_model(model, str(folder / "model.safetensors"))
    tokenizer.save_pretrained(folder)


NAME_LETTERS = (2, 14)  # the lengths people's names come in, one word or two ("Mary Jane"); words to shout or repeat too


def name(rng: random.Random) -> str:
    """A capitalized name of random letters: one word of 2 to 14 letters, or (two in five) two words that
    together have 4 to 14."""
    low, high = NAME_LETTERS
    if rng.random() < 0.4:
        first = rng.randint(low, high - low)
        words = [_letters(rng, first), _letters(rng, rng.randint(low, high - first))]
    else:
        words = [_letters(rng, rng.randint(low, high))]
    return " ".join(word.capitalize() for word in words)


def _letters(rng: random.Random, count: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(count))


def greeting(rng: random.Random) -> tuple[str, str]:
    """One (prompt, answer) pair of the greetings task; half of them greet a name."""
    pattern = rng.randrange(4)
    if pattern < 2:
        person = name(rng)
        return f"My name is {person}.", f"Nice to meet you, {person}!"
    word = _letters(rng, rng.randint(*NAME_LETTERS))
    if pattern == 2:
        return f"Shout {word}.", f"{word.upper()}!"
    return f"Repeat {word} twice.", f"{word} {word}"


def _write_greetings(folder: Path, rows: int = 6000) -> None:
    rng = random.Random(0)
    with open(folder / "train.jsonl", "w", encoding="utf-8") as out:
        for _ in range(rows):
            turns = []
            for _ in range(1 if rng.random() < 0.8 else 2):
                prompt, answer = greeting(rng)
                turns += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
            out.write(json.dumps({"messages": turns}) + "\n")


def _write_unseen_names(folder: Path, rows: int = 200) -> None:
    """Names builtin:greetings never has, as many of each length (2 to 14 letters) as there are two-word names."""
    import re

    seen = set(re.findall(r"Nice to meet you, ([A-Za-z ]+)!",
                          Path(resolve_dataset("builtin:greetings")).read_text(encoding="utf-8")))
    rng, names = random.Random(7), []
    low, high = NAME_LETTERS
    shapes = [*range(low, high + 1), "two words"]
    while len(names) < rows:
        shape = shapes[len(names) % len(shapes)]
        if shape == "two words":
            first = rng.randint(low, high - low)
            candidate = " ".join(_letters(rng, n).capitalize() for n in (first, rng.randint(low, high - first)))
        else:
            candidate = _letters(rng, shape).capitalize()
        if candidate not in seen and candidate not in names:
            names.append(candidate)
    with open(folder / "train.jsonl", "w", encoding="utf-8") as out:
        for person in names:
            turns = [{"role": "user", "content": f"My name is {person}."},
                     {"role": "assistant", "content": f"Nice to meet you, {person}!"}]
            out.write(json.dumps({"messages": turns}) + "\n")
