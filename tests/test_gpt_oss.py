"""GPT-OSS loading: eager attention for its sinks, MXFP4 checkpoints, and packed examples kept apart."""

from __future__ import annotations

import json

import pytest
import torch

from finetune.errors import UserError
from finetune.models.loading import load_model
from finetune.recipe.schema import load_recipe
from tests.conftest import REPO
from tests.test_packing import documents, packed_rows


def test_transformers_gpt_oss_leaks_across_packed_examples_without_our_masks():
    """Why finetune.model.isolate_packed_examples exists: drop it when this starts failing."""
    from transformers import AutoModelForCausalLM

    from finetune.data.collate import PackedRowsCollator
    from finetune.models.architectures import tiny_gpt_oss

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_gpt_oss(vocab_size=256, pad_token_id=0, eos_token_id=1)).eval()
    row = packed_rows(documents(12, seed=2), max_length=128)[0]
    batch = PackedRowsCollator(pad_token_id=0)([row])
    first = row["seq_lengths"][0]
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        second = torch.tensor([row["input_ids"][first:first + row["seq_lengths"][1]]])
        alone = model(input_ids=second, use_cache=False).logits
    assert not torch.allclose(packed[0, first:first + second.shape[1]], alone[0], atol=1e-3)


def test_loads_with_eager_attention_and_isolated_packing(tiny_models):
    recipe = load_recipe(REPO / "configs" / "gpt-oss-20b-lora.yaml", [f"model.name_or_path={tiny_models['gpt-oss']}",
                                                                     "model.attn_implementation=null"])
    model, lora = load_model(recipe, {"bf16": False}, "hf", gradient_checkpointing=False)
    assert model.config._attn_implementation == "eager"  # chosen for the sinks, not set by the recipe
    assert model.get_decoder()._forward_pre_hooks  # packed examples get masks built from their positions
    assert lora.target_parameters == recipe.lora.target_parameters


def test_mxfp4_checkpoint_with_qlora_is_refused_before_loading(tiny_models, tmp_path):
    config = json.loads((tiny_models["gpt-oss"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))  # no weights at all: nothing may be loaded
    recipe = load_recipe(REPO / "configs" / "gpt-oss-20b-lora.yaml", [f"model.name_or_path={tmp_path}", "method=qlora"])
    with pytest.raises(UserError, match="MXFP4 checkpoint, which bitsandbytes cannot requantize"):
        load_model(recipe, {"bf16": False}, "hf", gradient_checkpointing=False)
