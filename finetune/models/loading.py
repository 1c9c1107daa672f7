"""Load the tokenizer and the model a recipe names, ready for TRL's SFTTrainer.

`hf`: transformers + PEFT, bitsandbytes NF4 for qlora, MXFP4 checkpoints (GPT-OSS) dequantized to bf16.
`unsloth`: Unsloth's FastLanguageModel, its LoRA and its gradient checkpointing.
The chat template used for training is set on the tokenizer, so it is saved with every checkpoint and used again
at chat time.
"""

from __future__ import annotations

from pathlib import Path

from finetune import builtin, hub
from finetune.data.render import training_template
from finetune.errors import UserError
from finetune.hooks.transformers import isolate_packed_examples
from finetune.recipe.schema import Recipe

# A model folder holds at least one of these where it has a tokenizer (fast, SentencePiece, BPE, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "tiktoken.model")


def load_tokenizer(recipe: Recipe):
    from transformers import AutoTokenizer

    source = _local_or_available(recipe)
    folder = Path(source)
    if folder.is_dir() and not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise UserError(
            f"model.name_or_path: {source} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}). Save the base "
            "model's tokenizer beside the weights: AutoTokenizer.from_pretrained(BASE).save_pretrained(FOLDER)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, revision=recipe.model.revision, trust_remote_code=recipe.model.trust_remote_code
        )
    except (OSError, ValueError) as error:
        raise UserError(f"model.name_or_path: cannot load a tokenizer from {source!r}: {_first_line(error)}") from None
    template, where = tokenizer.chat_template, f"the chat template of {source}"
    if recipe.model.chat_template:
        path = Path(recipe.model.chat_template).expanduser()
        if not path.is_file():
            raise UserError(f"model.chat_template: {path} does not exist")
        try:
            template, where = path.read_text(encoding="utf-8"), f"model.chat_template {path}"
        except UnicodeDecodeError:
            raise UserError(f"model.chat_template: {path} is not UTF-8 text") from None
    if template:
        _check_template(template, where)
        tokenizer.chat_template = training_template(tokenizer, template)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return exact_decoding(tokenizer)


def exact_decoding(tokenizer):
    """The tokenizer, decoding to exactly its tokens' text, as transformers decodes with a BPE tokenizer whatever
    its config says: where the config still asks for clean_up_tokenization_spaces (Llama 3.2's), transformers
    ignores it and warns at the first decode of every process (chat, serve, eval). The setting is cleared here."""
    from tokenizers.models import BPE

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and isinstance(backend.model, BPE) and \
            not getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False):
        tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def check_token_ids(tokenizer, config) -> None:
    """Every id the tokenizer can give the model has a row in its embedding: the pad and end tokens, and its added
    tokens (the largest ids it has). A tokenizer class of another family can add a pad token past the model's
    vocabulary, and the run would fail at its first padded batch."""
    rows = config.get_text_config().vocab_size
    named = {f"its pad token {tokenizer.pad_token!r}": tokenizer.pad_token_id,
             f"its end token {tokenizer.eos_token!r}": tokenizer.eos_token_id,
             **{f"its added token {token!r}": index for token, index in tokenizer.get_added_vocab().items()}}
    outside = [(what, index) for what, index in named.items() if index is not None and index >= rows]
    if not outside:
        return
    what, index = max(outside, key=lambda item: item[1])
    inside = tokenizer.eos_token_id is not None and tokenizer.eos_token_id < rows
    fix = (f"set its pad token to one inside the vocabulary (e.g. \"pad_token\": \"{tokenizer.eos_token}\" in "
           "tokenizer_config.json) or " if what.startswith("its pad token") and inside else "use the model's own "
           "tokenizer, or ")
    raise UserError(f"model.name_or_path: the tokenizer does not match the model: {what} is id {index:,}, and the "
                    f"model's embedding has {rows:,} rows (ids 0 to {rows - 1:,}); {fix}resize the model's embeddings "
                    "to the tokenizer (model.resize_token_embeddings(len(tokenizer)), then save the model)")


def _check_template(template: str, where: str) -> None:
    """A chat template that is not valid Jinja fails once, here, rather than once per row: parsed as transformers
    reads it (a sandboxed environment with loop controls, and the `{% generation %}` blocks of training templates)."""
    from jinja2 import TemplateError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, loopcontrols]).parse(template)
    except TemplateError as error:
        line = f" (line {error.lineno})" if getattr(error, "lineno", None) else ""
        raise UserError(f"{where} is not a valid Jinja template{line}: {error.message}") from None


def _local_or_available(recipe: Recipe) -> str:
    """Where the recipe's model loads from: a local folder (builtins made on first use), or a Hub name that can be
    loaded now (else a UserError at once, without the libraries' minute of retries)."""
    source = builtin.resolve_model(recipe.model.name_or_path)
    if Path(source).expanduser().exists():
        return source
    if not hub.looks_like_hub_name(source):
        raise UserError(f"model.name_or_path: {source} does not exist (no such folder; relative paths start from "
                        f"the folder finetune runs in, {Path.cwd()})")
    hub.check_available(source, "model.name_or_path")
    return source


def training_precision(recipe: Recipe) -> dict:
    """{bf16, fp16}: the recipe's choice, else bf16 where the hardware has it (fp16 on CUDA cards without it)."""
    if recipe.precision:
        return {"bf16": recipe.precision == "bf16", "fp16": recipe.precision == "fp16"}
    import torch

    if torch.cuda.is_available():
        bf16 = torch.cuda.is_bf16_supported()
        return {"bf16": bf16, "fp16": not bf16}
    return {"bf16": False, "fp16": False}  # CPU: float32; bf16 autocast on CPU is slower than float32 on most machines


def weights_dtype(recipe: Recipe, precision: dict):
    """The dtype weights load in: the training precision for a frozen (LoRA) base, float32 masters for full."""
    import torch

    names = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if recipe.model.dtype != "auto":
        return names[recipe.model.dtype]
    if recipe.method == "full":
        return torch.float32
    return torch.bfloat16 if precision.get("bf16") else torch.float16 if precision.get("fp16") else torch.float32


def load_model(recipe: Recipe, precision: dict, backend: str, gradient_checkpointing: bool):
    """(model, peft LoraConfig or None). With hf, PEFT wraps the model inside the trainer; Unsloth wraps it here.
    With model.adapter the model comes wrapped, that adapter trainable."""
    if backend == "unsloth":
        return _load_unsloth(recipe, precision, gradient_checkpointing), None
    if recipe.model.adapter:
        return _with_adapter(load_hf_model(recipe, precision), recipe.model.adapter, gradient_checkpointing), None
    model = load_hf_model(recipe, precision)
    return model, lora_config(recipe, model)


def load_reference_model(recipe: Recipe, precision: dict):
    """DPO's and KTO's frozen reference for a full fine-tune, loaded as the policy is (dtype, placement per
    process, attention, the GPT-OSS mask hook); None where TRL needs none: with an adapter the reference is the model
    with it switched off (or a frozen copy of model.adapter), and precomputed log-probabilities need no model."""
    if recipe.stage not in ("dpo", "kto") or recipe.method != "full" \
            or recipe.stage_section.get("precompute_ref_log_probs"):
        return None
    reference = load_hf_model(recipe, precision)
    reference.requires_grad_(False)
    return reference.eval()


def _with_adapter(model, adapter: str, gradient_checkpointing: bool):
    from peft import PeftModel, prepare_model_for_kbit_training

    if getattr(model, "is_loaded_in_4bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    elif gradient_checkpointing:
        model.enable_input_require_grads()  # the checkpointed layers' inputs need gradients for the adapter's
    return PeftModel.from_pretrained(model, adapter, is_trainable=True)


def _placement():
    """Each DDP process holds a whole model on its own device (never "auto" or "balanced", which split one model
    over the GPUs that DDP gives the other processes); under FSDP or DeepSpeed the weights load on the CPU and the
    engine shards them."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = PartialState()
    if state.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        return None
    return {"": state.device}


def model_config(recipe: Recipe, source: str | None = None):
    """The model's configuration (no weights), checked against the recipe: what validation can know of the model."""
    from transformers import AutoConfig

    source = source or _local_or_available(recipe)
    try:
        config = AutoConfig.from_pretrained(
            source, revision=recipe.model.revision, trust_remote_code=recipe.model.trust_remote_code
        )
    except (OSError, ValueError) as error:
        raise UserError(f"model.name_or_path: cannot load a model from {source!r}: {_first_line(error)}") from None
    if is_mxfp4(config) and recipe.method == "qlora":
        raise UserError(
            f"method qlora: {source} is an MXFP4 checkpoint, which bitsandbytes cannot requantize (its experts are "
            "not Linear layers); use method=lora (bf16), or model.backend=unsloth with Unsloth's 4-bit checkpoint"
        )
    return config


def is_mxfp4(config) -> bool:
    return (getattr(config, "quantization_config", None) or {}).get("quant_method") == "mxfp4"


def load_hf_model(recipe: Recipe, precision: dict):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    source = _local_or_available(recipe)
    config = model_config(recipe, source)
    dtype = weights_dtype(recipe, precision)
    kwargs = {
        "dtype": dtype,
        "revision": recipe.model.revision,
        "trust_remote_code": recipe.model.trust_remote_code,
        "device_map": _placement(),
        "attn_implementation": recipe.model.attn_implementation or default_attention(config),
    }
    if is_mxfp4(config):
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)  # MXFP4 weights have no gradients: train in bf16
    if recipe.method == "qlora":
        kwargs["quantization_config"] = four_bit_config(dtype, sharded=kwargs["device_map"] is None)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as error:
        raise UserError(f"model.name_or_path: cannot load a model from {source!r}: {_first_line(error)}") from None
    isolate_packed_examples(model)
    return model


def four_bit_config(dtype, sharded: bool):
    """NF4 with double quantization, computing in `dtype`. Sharded (FSDP, DeepSpeed ZeRO-3), the 4-bit weights are
    stored in that dtype too: the engines shard only parameters of one floating-point dtype."""
    from transformers import BitsAndBytesConfig

    storage = {"bnb_4bit_quant_storage": dtype} if sharded else {}
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype, **storage)


def default_attention(config) -> str | None:
    """Eager attention where sdpa would compute other scores than the model's (GPT-OSS's attention sinks, Gemma 2's
    soft-capped scores), unless a kernel that knows them is chosen; others: transformers' default."""
    text = config.get_text_config()
    return "eager" if text.model_type == "gpt_oss" or getattr(text, "attn_logit_softcapping", None) else None


def check_attention(recipe: Recipe, config) -> None:
    """sdpa has no soft-capping: a model whose attention scores are soft-capped would train on other scores than
    the ones it was made with (transformers 5.17 passes the cap to eager and FlashAttention only)."""
    cap = getattr(config.get_text_config(), "attn_logit_softcapping", None)
    if cap and recipe.model.attn_implementation == "sdpa":
        raise UserError(f"model.attn_implementation: sdpa ignores this model's attention soft-capping "
                        f"(attn_logit_softcapping {cap}), so it would train on other attention scores than the "
                        "model's; leave model.attn_implementation unset (eager), or use flash_attention_2")


def _load_unsloth(recipe: Recipe, precision: dict, gradient_checkpointing: bool):
    from unsloth import FastLanguageModel

    lora = recipe.lora
    model, _ = FastLanguageModel.from_pretrained(  # Unsloth loads an adapter folder with its base, trainable
        model_name=recipe.model.adapter or builtin.resolve_model(recipe.model.name_or_path),
        max_seq_length=recipe.train_setting("max_length"),
        dtype=weights_dtype(recipe, precision) if recipe.model.dtype != "auto" else None,
        load_in_4bit=recipe.method == "qlora",
        load_in_16bit=recipe.method == "lora",
        full_finetuning=recipe.method == "full",
        device_map=_placement(),
        revision=recipe.model.revision,
        trust_remote_code=recipe.model.trust_remote_code,
        use_gradient_checkpointing="unsloth" if gradient_checkpointing else False,
        random_state=recipe.train_setting("seed"),
    )
    isolate_packed_examples(model)
    if recipe.method == "full" or recipe.model.adapter:
        return model
    return FastLanguageModel.get_peft_model(
        model,
        **_adapter_settings(lora),
        use_gradient_checkpointing="unsloth" if gradient_checkpointing else False,
        random_state=recipe.train_setting("seed"),
    )


# An image-text model (Gemma 3 4B and up) trains its text decoder here: the data is text, so its vision tower and
# projector get no gradient, and under DDP the reducer would wait for theirs. "all-linear" leaves them out.
VISION_MODULES = r".*\.(vision_tower|vision_model|visual|multi_modal_projector)(\..*)?"


def lora_config(recipe: Recipe, model):
    """PEFT's LoraConfig for the recipe's adapter on `model` (loaded, or built on the meta device)."""
    if recipe.method == "full":
        return None
    import re

    from peft import LoraConfig

    settings = _adapter_settings(recipe.lora)
    if settings["target_modules"] == "all-linear" and any(re.fullmatch(VISION_MODULES, name)
                                                          for name, _ in model.named_modules()):
        settings["exclude_modules"] = VISION_MODULES
    return LoraConfig(**settings, task_type="CAUSAL_LM")


def _adapter_settings(lora) -> dict:
    """The recipe's lora section in PEFT's names (Unsloth's get_peft_model takes the same, and hands on to PEFT's
    LoraConfig what it does not name itself, such as use_dora)."""
    return dict(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules,
                target_parameters=lora.target_parameters, modules_to_save=lora.modules_to_save,
                use_rslora=lora.use_rslora, use_dora=lora.use_dora)


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
