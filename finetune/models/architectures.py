"""The architectures the shipped recipes train, as configs, and scaled-down versions that keep their features.

The full-size configs are those of meta-llama/Llama-3.2-3B-Instruct and openai/gpt-oss-20b (../shared/DESIGN.md,
section 4); tests check them against the published parameter counts on the meta device. The tiny versions keep
what the code paths depend on (Llama 3 rope scaling, tied embeddings; GPT-OSS experts, router, attention sinks,
alternating sliding-window layers, biases, yarn rope) so CPU tests exercise the same code as the real models.
"""

from __future__ import annotations

LLAMA_3_2_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
GPT_OSS_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


def llama_3_2_3b(**changes):
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters=LLAMA_3_2_ROPE, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    )
    return LlamaConfig(**{**settings, **changes})


def gpt_oss_20b(**changes):
    from transformers import GptOssConfig

    layers = changes.pop("num_hidden_layers", 24)
    settings = dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=layers,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True,
        swiglu_limit=7.0, rope_parameters=GPT_OSS_ROPE, router_aux_loss_coef=0.9, output_router_logits=False,
        eos_token_id=200002, pad_token_id=199999,
    )
    return GptOssConfig(**{**settings, **changes})


def tiny_llama_3_2(**changes):
    """Llama 3.2 with its vocabulary, rope scaling and tied embeddings, at hidden 64 and 2 layers."""
    return llama_3_2_3b(**{**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16), **changes})


def tiny_gpt_oss(**changes):
    """GPT-OSS with its vocabulary, 4 experts (2 active), sinks and a sliding and a full layer, at hidden 64."""
    return gpt_oss_20b(**{**dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                 sliding_window=16), **changes})


def parameter_count(config) -> int:
    """Parameters of the model a config describes, counted on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


# The families people fine-tune beside them, at a published size each, and tiny versions that keep what differs:
# Qwen 2.5's q/k/v biases, Qwen 3's q/k norms, Gemma's embedding scale, sandwich norms, sliding-window layers and
# (Gemma 2) soft-capping, Mistral's sliding window, Phi-3's fused qkv_proj and gate_up_proj.
def qwen2_5_1_5b(**changes):
    from transformers import Qwen2Config

    settings = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                    num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
                    tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
    return Qwen2Config(**{**settings, **changes})


def qwen3_4b(**changes):
    from transformers import Qwen3Config

    settings = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                    rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
    return Qwen3Config(**{**settings, **changes})


def gemma2_2b(**changes):
    from transformers import Gemma2Config

    settings = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=4096,
                    final_logit_softcapping=30.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=256,
                    max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 107],
                    pad_token_id=0)
    return Gemma2Config(**{**settings, **changes})


def gemma3_1b(**changes):
    """google/gemma-3-1b-it, the text-only Gemma 3 (the 4B and larger are image-text models)."""
    from transformers import Gemma3TextConfig

    settings = dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                    query_pre_attn_scalar=256, max_position_embeddings=32768, tie_word_embeddings=True,
                    bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0)
    return Gemma3TextConfig(**{**settings, **changes})


def gemma3_4b(text: dict | None = None, vision: dict | None = None, **changes):
    """google/gemma-3-4b-it: Gemma 3's text decoder with a SigLIP vision tower (an image-text model; the toolkit
    trains its text decoder on text)."""
    from transformers import Gemma3Config, SiglipVisionConfig

    text_config = gemma3_1b(**{**dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                                      num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
                                      sliding_window=1024, max_position_embeddings=131072,
                                      rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                          "rope_theta": 1000000.0},
                                                       "sliding_attention": {"rope_type": "default",
                                                                             "rope_theta": 10000.0}}),
                                  **(text or {})})
    vision_config = SiglipVisionConfig(**{**dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                                 num_attention_heads=16, image_size=896, patch_size=14,
                                                 vision_use_head=False), **(vision or {})})
    settings = dict(text_config=text_config.to_dict(), vision_config=vision_config.to_dict(), mm_tokens_per_image=256,
                    boi_token_index=255999, eoi_token_index=256000, image_token_index=262144,
                    eos_token_id=[1, 106], tie_word_embeddings=True)
    return Gemma3Config(**{**settings, **changes})


def mistral_7b(**changes):
    from transformers import MistralConfig

    settings = dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5,
                    sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return MistralConfig(**{**settings, **changes})


def phi3_mini(**changes):
    from transformers import Phi3Config

    settings = dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                    sliding_window=2047, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                    eos_token_id=32000, pad_token_id=32000)
    return Phi3Config(**{**settings, **changes})


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16)
FAMILIES = {  # name: the published size's config; tiny(name) scales it down
    "qwen2.5": qwen2_5_1_5b, "qwen3": qwen3_4b, "gemma2": gemma2_2b, "gemma3": gemma3_1b, "mistral": mistral_7b,
    "phi3": phi3_mini,
}


def tiny(family: str, **changes):
    """The family's architecture at hidden 64 and 2 layers (one sliding-window and one full where it alternates)."""
    settings = {**TINY, **({"sliding_window": 16} if family in ("gemma2", "gemma3", "mistral", "phi3") else {}),
                **({"num_key_value_heads": 4} if family == "phi3" else {})}
    config = FAMILIES[family](**{**settings, **changes})
    if family == "gemma3":
        config.layer_types = ["sliding_attention", "full_attention"]
    return config


def tiny_gemma3_image_text(vocab_size: int):
    """Gemma 3 4B's image-text model at hidden 64 (text) and 32 (a one-layer vision tower), for a vocabulary of
    `vocab_size` whose last three ids stand for its image tokens."""
    text = {**TINY, "sliding_window": 16, "vocab_size": vocab_size, "layer_types": ["sliding_attention",
                                                                                  "full_attention"]}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    return gemma3_4b(text, vision, mm_tokens_per_image=4, boi_token_index=vocab_size - 3,
                     eoi_token_index=vocab_size - 2, image_token_index=vocab_size - 1)
