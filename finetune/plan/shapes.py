"""What the memory and time plans need of a model: exact parameter counts by kind and the sizes activations follow,
counted on the meta device from the model's configuration (no weights, no download), with the recipe's adapter."""

from __future__ import annotations

from dataclasses import dataclass

SAVED_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MXFP4_BYTES = 17 / 32  # 4 bits a weight and an 8-bit scale per 32


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a model: exact parameter counts by kind, and the sizes activations follow."""
    model_type: str
    layers: int
    hidden: int
    q_width: int  # heads x head_dim
    kv_width: int
    heads: int
    intermediate: int  # of the dense MLP, or of one expert
    experts_per_token: int  # 0 for dense models
    vocab: int
    embedding: int  # parameters
    head: int  # 0 when tied to the embedding
    linear: int  # weights of nn.Linear layers in the decoder (what 4-bit quantization replaces)
    experts: int  # MoE expert weights (3D parameters)
    other: int  # norms, biases, routers, sinks
    largest_layer: int  # parameters of one decoder layer
    largest_linear: int
    layer_linears: tuple[int, ...]  # weights of each nn.Linear in one decoder layer
    saved: int  # bytes of the checkpoint's weights (the config's dtype; MXFP4 experts in 4.25 bits)
    adapted_inputs: tuple[int, ...]  # in_features of each LoRA-adapted Linear in one layer
    adapter: int  # trainable parameters of the LoRA adapter (0 for full fine-tuning)
    norm_width: int  # values per token that one layer's RMSNorms normalize (Gemma's four, q/k norms per head)
    logit_softcapping: bool  # tanh soft-capping of the logits (Gemma 2)
    attention: str  # the attention implementation the model loads with when the recipe names none

    @property
    def parameters(self) -> int:
        return self.embedding + self.head + self.linear + self.experts + self.other


def model_shape(config, recipe) -> Shape:
    """Counts from the model built on the meta device (no memory, no download), with the recipe's adapter."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.models.loading import default_attention

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=recipe.model.trust_remote_code)
    text = config.get_text_config()
    embedding = model.get_input_embeddings().weight.numel()
    output = model.get_output_embeddings()
    head = 0 if output is None or output.weight is model.get_input_embeddings().weight else output.weight.numel()
    decoder_layers = model.get_decoder().layers
    linear_weights = {id(m.weight): m.weight.numel() for m in decoder_layers.modules() if isinstance(m, torch.nn.Linear)}
    experts = sum(p.numel() for name, p in decoder_layers.named_parameters() if p.dim() == 3 and "experts" in name)
    total = sum(p.numel() for p in model.parameters())
    first = decoder_layers[0]
    layer_linears = tuple(m.weight.numel() for m in first.modules() if isinstance(m, torch.nn.Linear))
    largest_linear = max(linear_weights.values())
    adapted, adapter = _adapter(model, recipe)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", heads)
    per_head = {"q_norm": heads, "k_norm": kv_heads}  # applied to every head's query or key
    norm_width = sum(module.weight.numel() * per_head.get(name.rsplit(".", 1)[-1], 1)
                     for name, module in first.named_modules() if type(module).__name__.endswith("RMSNorm"))
    return Shape(
        model_type=text.model_type, layers=len(decoder_layers), hidden=text.hidden_size, q_width=heads * head_dim,
        kv_width=kv_heads * head_dim, heads=heads,
        intermediate=getattr(text, "moe_intermediate_size", None) or text.intermediate_size,
        experts_per_token=getattr(text, "num_experts_per_tok", 0) if experts else 0, vocab=text.vocab_size,
        embedding=embedding, head=head, linear=sum(linear_weights.values()), experts=experts,
        other=total - embedding - head - sum(linear_weights.values()) - experts,
        largest_layer=sum(p.numel() for p in first.parameters()), largest_linear=largest_linear,
        layer_linears=layer_linears, saved=_checkpoint_bytes(config, total, experts), adapted_inputs=adapted,
        adapter=adapter, norm_width=norm_width, logit_softcapping=bool(getattr(text, "final_logit_softcapping", None)),
        attention=default_attention(config) or "sdpa",
    )


def _checkpoint_bytes(config, parameters: int, experts: int) -> int:
    dtype = str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    each = SAVED_BYTES.get(dtype, 4)
    quantization = getattr(config, "quantization_config", None) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else \
        getattr(quantization, "quant_method", None)
    if str(method) == "mxfp4":
        return int(experts * MXFP4_BYTES + (parameters - experts) * each)
    return parameters * each


def _adapter(model, recipe) -> tuple[tuple[int, ...], int]:
    """(in_features of the adapted Linears of layer 0, trainable adapter parameters) as PEFT builds them."""
    if recipe.method == "full":
        return (), 0
    from peft import get_peft_model
    from peft.tuners.lora import Linear as LoraLinear

    from finetune.models.loading import lora_config

    peft_model = get_peft_model(model, lora_config(recipe, model))
    first = peft_model.get_base_model().get_decoder().layers[0]
    adapted = tuple(m.in_features for m in first.modules() if isinstance(m, LoraLinear))
    return adapted, sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
