"""Load the tokenizer and the model a recipe names, ready for TRL's SFTTrainer.

The `hf` backend: transformers + PEFT, with bitsandbytes NF4 for qlora. Each process puts its model on its own
device (never device_map="auto" under DDP). The chat template used for training is set on the tokenizer, so it is
saved with every checkpoint and used again at chat time.
"""

from __future__ import annotations

from pathlib import Path

from finetune import builtin
from finetune.data.render import training_template
from finetune.errors import UserError


def load_tokenizer(recipe):
    from transformers import AutoTokenizer

    source = builtin.resolve_model(recipe.model.name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, revision=recipe.model.revision, trust_remote_code=recipe.model.trust_remote_code
        )
    except OSError as error:
        raise UserError(f"model.name_or_path: cannot load a tokenizer from {source!r}: {_first_line(error)}") from None
    template = tokenizer.chat_template
    if recipe.model.chat_template:
        path = Path(recipe.model.chat_template).expanduser()
        if not path.is_file():
            raise UserError(f"model.chat_template: {path} does not exist")
        template = path.read_text(encoding="utf-8")
    if template:
        tokenizer.chat_template = training_template(tokenizer, template)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def weights_dtype(recipe, precision: dict):
    """The dtype weights load in: the training precision for a frozen (LoRA) base, float32 masters for full."""
    import torch

    names = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if recipe.model.dtype != "auto":
        return names[recipe.model.dtype]
    if recipe.method == "full":
        return torch.float32
    return torch.bfloat16 if precision.get("bf16") else torch.float16 if precision.get("fp16") else torch.float32


def load_model(recipe, precision: dict):
    """(model, peft LoraConfig or None); PEFT wraps the model inside the trainer."""
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = weights_dtype(recipe, precision)
    kwargs = {
        "dtype": dtype,
        "revision": recipe.model.revision,
        "trust_remote_code": recipe.model.trust_remote_code,
        "device_map": {"": PartialState().device},
    }
    if recipe.model.attn_implementation:
        kwargs["attn_implementation"] = recipe.model.attn_implementation
    if recipe.method == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
    source = builtin.resolve_model(recipe.model.name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as error:
        raise UserError(f"model.name_or_path: cannot load a model from {source!r}: {_first_line(error)}") from None
    return model, lora_config(recipe)


def lora_config(recipe):
    if recipe.method == "full":
        return None
    from peft import LoraConfig

    lora = recipe.lora
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        modules_to_save=lora.modules_to_save,
        use_rslora=lora.use_rslora,
        use_dora=lora.use_dora,
        task_type="CAUSAL_LM",
    )


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
