"""The real architectures, full size on the meta device: exact parameter counts and each recipe's adapter size."""

from __future__ import annotations

import pytest
import torch

from finetune.models.architectures import gpt_oss_20b, llama_3_2_3b, parameter_count
from finetune.models.loading import lora_config
from finetune.recipe.schema import load_recipe
from tests.conftest import REPO


def test_full_size_parameter_counts():
    assert parameter_count(llama_3_2_3b()) == 3_212_749_824
    assert parameter_count(gpt_oss_20b()) == 20_914_757_184


def llama_lora_params(r: int) -> int:
    """LoRA adds r x (inputs + outputs) per adapted Linear; Llama 3.2 3B: 28 layers of q, k, v, o, gate, up, down."""
    hidden, kv, intermediate = 3072, 8 * 128, 8192
    per_layer = (hidden + hidden) + 2 * (hidden + kv) + (hidden + hidden) + 2 * (hidden + intermediate) + (
        intermediate + hidden)
    return 28 * r * per_layer


def gpt_oss_lora_params(r: int, expert_layers: int) -> int:
    """all-linear is q, k, v, o in each of 24 layers (the router and the experts are not Linear modules); each
    expert tensor (32, inputs, outputs) named in target_parameters adds r x 32 x (inputs + outputs)."""
    hidden, heads, kv, intermediate, experts = 2880, 64 * 64, 8 * 64, 2880, 32
    attention = (hidden + heads) + 2 * (hidden + kv) + (heads + hidden)
    expert = experts * ((hidden + 2 * intermediate) + (intermediate + hidden))
    return 24 * r * attention + expert_layers * r * expert


RECIPES = {
    "llama-3.2-3b-unsloth-qlora": (llama_3_2_3b, llama_lora_params(16)),  # 24,313,856
    "llama-3.2-3b-lora": (llama_3_2_3b, llama_lora_params(16)),
    "gpt-oss-20b-lora": (gpt_oss_20b, gpt_oss_lora_params(8, expert_layers=3)),  # 15,040,512
    "gpt-oss-20b-unsloth-qlora": (gpt_oss_20b, gpt_oss_lora_params(8, expert_layers=0)),  # 3,981,312
}


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_adapter_sizes(name):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    architecture, expected = RECIPES[name]
    recipe = load_recipe(REPO / "configs" / f"{name}.yaml")
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(architecture()), lora_config(recipe))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == expected
    if recipe.lora.target_parameters:
        adapted = {n.split(".mlp.")[0].rsplit(".", 1)[-1] for n, p in model.named_parameters()
                   if p.requires_grad and ".experts." in n}
        assert adapted == {"7", "15", "23"}
