"""Packing: no token lost or duplicated, boundaries kept, and no attention or position leak between examples."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from finetune.data.collate import PackedRowsCollator
from finetune.data.encoding import pack
from finetune.data.render import IGNORE


def documents(count: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        length = rng.randint(3, 60)
        ids = [rng.randrange(3, 250) for _ in range(length)]
        prompt = rng.randint(1, length - 1)
        docs.append((ids, [IGNORE] * prompt + ids[prompt:]))
    return docs


def packed_rows(docs, max_length):
    import tempfile

    import datasets

    table = datasets.Dataset.from_dict({"input_ids": [d[0] for d in docs], "labels": [d[1] for d in docs]})
    with tempfile.TemporaryDirectory() as folder:
        return list(pack(table, max_length, f"{folder}/packed.arrow"))


def split(row) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    pieces, start = [], 0
    for length in row["seq_lengths"]:
        pieces.append((tuple(row["input_ids"][start:start + length]), tuple(row["labels"][start:start + length])))
        start += length
    assert start == len(row["input_ids"]) == len(row["labels"])
    return pieces


def test_no_token_lost_or_duplicated_and_boundaries_kept():
    docs = documents(500)
    rows = packed_rows(docs, max_length=128)
    assert all(len(row["input_ids"]) <= 128 for row in rows)
    assert len(rows) < len(docs) / 3  # several examples per row
    unpacked = Counter(piece for row in rows for piece in split(row))
    assert unpacked == Counter((tuple(ids), tuple(labels)) for ids, labels in docs)


def test_collator_restarts_positions_and_masks_boundaries():
    docs = documents(40, seed=1)
    rows = packed_rows(docs, max_length=96)[:3]
    batch = PackedRowsCollator(pad_token_id=0)(rows)
    width = max(len(row["input_ids"]) for row in rows)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (3, width)
    assert int(batch["num_real_tokens"]) == sum(len(row["input_ids"]) for row in rows)
    for r, row in enumerate(rows):
        start = 0
        for length in row["seq_lengths"]:
            assert batch["position_ids"][r, start:start + length].tolist() == list(range(length))
            assert batch["labels"][r, start] == IGNORE  # never predicted from the previous example
            assert batch["labels"][r, start + 1:start + length].tolist() == row["labels"][start + 1:start + length]
            start += length
        assert (batch["labels"][r, start:] == IGNORE).all()  # padding carries no loss


@pytest.mark.parametrize("backend, flash, one_row", [("unsloth", False, True), ("hf", True, True), ("hf", False, False)])
def test_unsloth_and_flash_attention_take_each_micro_batch_as_one_row(backend, flash, one_row):
    """Unsloth keeps packed examples apart only in a one-row batch: the batches it gets, from the collator TRL builds
    for our arguments, are one row of every example with positions restarting and no padding. Other attention
    without FlashAttention gets rows with block-diagonal masks (PackedRowsCollator, above)."""
    import types

    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from finetune.recipe.schema import load_recipe
    from finetune.training.arguments import runtime_arguments

    recipe = load_recipe("quickstart")
    padding_free = runtime_arguments(recipe, types.SimpleNamespace(eval=None), flash, backend, "llama")["padding_free"]
    assert padding_free == one_row
    if not one_row:
        return
    rows = packed_rows(documents(40, seed=1), max_length=96)[:3]
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=padding_free)(rows)
    total = sum(len(row["input_ids"]) for row in rows)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (1, total)
    assert "attention_mask" not in batch
    start = 0
    for length in [length for row in rows for length in row["seq_lengths"]]:
        assert batch["position_ids"][0, start:start + length].tolist() == list(range(length))
        assert batch["labels"][0, start] == IGNORE  # never predicted from the previous example
        start += length


def test_gpt_oss_under_unsloth_is_never_packed():
    """Unsloth's GPT-OSS attention takes no mask while training: packing is refused there (before anything loads),
    and the shipped Unsloth GPT-OSS recipe trains one example a row."""
    from finetune.errors import UserError
    from finetune.models import backends
    from finetune.recipe.schema import load_recipe

    with pytest.raises(UserError, match="under Unsloth, GPT-OSS's attention takes no mask while training, so examples "
                                        "packed into one row would attend to each other; set train.packing=false"):
        backends.check_packing("unsloth", "gpt_oss", True)
    backends.check_packing("unsloth", "gpt_oss", False)
    backends.check_packing("hf", "gpt_oss", True)  # our mask hook keeps them apart (test below)
    backends.check_packing("unsloth", "llama", True)  # one row a micro-batch (test above)
    assert load_recipe("gpt-oss-20b-unsloth-qlora").train["packing"] is False


def tiny_model(name: str):
    from transformers import AutoModelForCausalLM

    from finetune.builtin import make_tiny_llama_config, make_tokenizer
    from finetune.models.architectures import FAMILIES, tiny, tiny_gpt_oss
    from finetune.models.loading import isolate_packed_examples

    torch.manual_seed(0)
    if name in FAMILIES:  # their attention as loaded: sliding windows (Gemma, Mistral, Phi-3) narrower than examples
        return AutoModelForCausalLM.from_config(tiny(name, vocab_size=256, pad_token_id=0, eos_token_id=1,
                                                     bos_token_id=2, sliding_window=8), dtype=torch.float32)
    if name == "gpt-oss":  # sinks, experts, a sliding-window layer narrower than the examples
        model = AutoModelForCausalLM.from_config(tiny_gpt_oss(vocab_size=256, pad_token_id=0, eos_token_id=1,
                                                              sliding_window=8), dtype=torch.float32)
        isolate_packed_examples(model)  # transformers' GptOssModel leaves position_ids out of its masks
        return model
    return AutoModelForCausalLM.from_config(make_tiny_llama_config(make_tokenizer(), attn_implementation=name))


@pytest.mark.parametrize("name", ["sdpa", "eager", "gpt-oss", "qwen2.5", "qwen3", "gemma2", "gemma3", "mistral",
                                  "phi3"])
def test_packed_logits_equal_separate_logits(name):
    """Each example in a packed row sees only itself: logits match running it alone."""
    model = tiny_model(name).eval()
    docs = documents(12, seed=2)
    rows = packed_rows(docs, max_length=128)[:2]
    batch = PackedRowsCollator(pad_token_id=0)(rows)
    batch.pop("num_real_tokens")
    with torch.no_grad():
        packed = model(**{k: batch[k] for k in ("input_ids", "position_ids")}, use_cache=False).logits
        for r, row in enumerate(rows):
            start = 0
            for length in row["seq_lengths"]:
                alone = model(input_ids=torch.tensor([row["input_ids"][start:start + length]]), use_cache=False).logits
                torch.testing.assert_close(packed[r, start:start + length], alone[0], atol=1e-5, rtol=1e-5)
                start += length
