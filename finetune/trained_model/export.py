"""Export a trained model: the adapter alone, or merged into its base; checked, then optionally pushed to the Hub.

    adapter   PEFT's adapter_model.safetensors + adapter_config.json (base_model_name_or_path: the recipe's model)
    merged    the adapter merged into the base loaded unquantized in 16 bits (a QLoRA adapter too: merging into
              4-bit weights would round the adapter away), saved as safetensors
    both      the tokenizer with the chat template used in training, generation_config.json whose eos_token_id
              lists the model's real end tokens, finetune.yaml, and a model card (README.md with metadata)

Everything is written to a staging folder beside --out and checked before it takes the name: the folder is
reloaded with transformers (+ PEFT) and its logits on a fixed prompt are compared with the model before export
(exactly equal for an adapter; within 16-bit rounding when merged or cast). A failed check leaves nothing behind.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import CommandFailed, UserError
from finetune.run_folder import CONFIG_NAME
from finetune.trained_model import gguf, saved_model
from finetune.trained_model.model_card import base_origin, write_card

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
GGUF_REPORT = "gguf-check.json"
CHECK_CONVERSATION = [{"role": "user", "content": "Write one sentence about the sea, then count to five."}]
# Relative to the largest reference logit. bfloat16 keeps 8 bits of mantissa (relative step 2^-8 = 0.0039) and
# float16 11; a merged or cast model rounds every weight once, and the rounding errors of a few layers add up to a
# few steps. A wrong merge (a missing or doubled adapter, a wrong scale) is off by far more, at every position.
# A mixture-of-experts router can pick another expert at a near tie once its inputs are rounded, which moves that
# one position's logits a lot; so a 16-bit export passes when nearly every position is within the tolerance.
TOLERANCE = {"bfloat16": 0.05, "float16": 0.01, "float32": 1e-4}
POSITIONS_WITHIN = 0.95


@dataclass
class Export:
    folder: Path
    what: str  # adapter | merged model | model (fine-tuned in full)
    max_difference: float  # of the reloaded export's logits from the model's, relative to the largest logit
    tolerance: float
    positions_within: int  # prompt positions whose logits are within the tolerance
    positions: int
    attention: str | None = None  # the implementation to load it with, where transformers' default differs
    gguf: Path | None = None
    gguf_report: dict | None = None  # llama.cpp's check of it (gguf.Report.as_dict)
    url: str | None = None


def export(path, out, merge: bool = False, dtype: str = "bf16", base_model: str | None = None,
           push_to_hub: str | None = None, private: bool = False, gguf_type: str | None = None,
           license: str | None = None) -> Export:
    """`gguf_type`: also a GGUF of that type (gguf.TYPES), checked by llama.cpp before the folder takes its name."""
    source = saved_model.locate(path)
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists and is not empty; choose another folder")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    merged = merge or not source.is_adapter  # a fully fine-tuned model is exported whole, in --dtype
    converter = _check_gguf(source, merged, gguf_type, base_model) if gguf_type else None

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-partial-"))
    staging.chmod(0o777 & ~_umask())  # mkdtemp's folder is private; the export is an ordinary folder
    try:
        result = _write_and_check(source, staging, merged, DTYPES[dtype], base_model)
        if gguf_type:
            result.gguf, result.gguf_report = _write_and_check_gguf(source, staging, converter, gguf_type,
                                                                    result.attention, merged, base_model)
        write_card(source, staging, out.name, merged, DTYPES[dtype], license, result.attention,
                   result.gguf_report)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    result.folder = out
    if result.gguf:
        result.gguf = out / result.gguf.name
    if push_to_hub:
        result.url = push(out, push_to_hub, private)
    return result


def _check_gguf(source: saved_model.SavedModel, merged: bool, gguf_type: str, base_model: str | None) -> Path:
    """What a GGUF export needs, found before any work: a known type, the pinned llama.cpp, and a model (and
    adapter) its converters take; the converter."""
    from transformers import AutoConfig

    types = gguf.TYPES if merged else gguf.ADAPTER_TYPES
    if gguf_type not in types:
        also = "; merged (--merge) also " + ", ".join(sorted(set(gguf.TYPES) - set(types))) if not merged else ""
        raise UserError(f"--gguf-type {gguf_type}: choose one of {', '.join(types)}{also}")
    script = gguf.converter()
    config = AutoConfig.from_pretrained(source.base_model(base_model) if source.is_adapter else source.path)
    tokenizer = saved_model.load_tokenizer(source)
    gguf.convertible(script, config, tokenizer)
    if not merged:
        gguf.adapter_convertible(script, source.path, config, tokenizer)
    return script


def _write_and_check_gguf(source: saved_model.SavedModel, staging: Path, script: Path, gguf_type: str,
                          attention: str | None, merged: bool, base_model: str | None) -> tuple[Path, dict]:
    """The checked export as a GGUF in `staging` (the whole model, or the adapter as a GGUF adapter), and llama.cpp's
    check of it (gguf-check.json); a check that fails raises, and the export is not kept."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.data.render import Renderer
    from finetune.trained_model.chat import configured_end_ids

    tokenizer = AutoTokenizer.from_pretrained(staging)
    with tempfile.TemporaryDirectory(dir=staging.parent) as scratch:
        if merged:
            target, reference, base_gguf = _convert_model(script, staging, Path(scratch), gguf_type,
                                                          gguf.adds_bos(tokenizer))
            model = AutoModelForCausalLM.from_pretrained(staging, dtype=torch.float32,
                                                         **({"attn_implementation": attention} if attention else {}))
        else:
            target, reference, base_gguf, model = _convert_adapter(source, base_model, script, staging, tokenizer,
                                                                   Path(scratch), gguf_type)
        renderer, end_ids = _renderer(tokenizer, source, Renderer), configured_end_ids(model.generation_config)
        report = gguf.check(target, gguf_type, reference, model.eval(), tokenizer, renderer, end_ids, base_gguf)
    found = report.as_dict()
    if report.problems:
        raise CommandFailed("gguf check failed: " + "; ".join(report.problems[:5]) + "; nothing was written")
    found["ollama"] = (_write_modelfile(source, staging, target, tokenizer, renderer, end_ids) if merged else
                       "no Modelfile: Ollama loads a GGUF adapter on its base as a GGUF (ADAPTER), which an adapter "
                       "export does not hold; export merged (--merge --gguf) for one")
    (staging / GGUF_REPORT).write_text(json.dumps(found, indent=2) + "\n", encoding="utf-8")
    return target, found


def _convert_model(script: Path, staging: Path, scratch: Path, gguf_type: str, bos: bool) -> tuple[Path, Path, None]:
    """The export as model-TYPE.gguf in `staging`, and an f32 GGUF to check it against (itself, for f32)."""
    target = staging / f"model-{gguf_type}.gguf"
    reference = target if gguf_type == "f32" else scratch / "model-f32.gguf"
    gguf.convert(script, staging, reference, "f32", bos)
    if gguf_type in gguf.QUANTIZED_BY_THE_BINDINGS:
        gguf.quantize(reference, target, gguf_type)
    elif gguf_type != "f32":
        gguf.convert(script, staging, target, gguf_type, bos)
    return target, reference, None


def _convert_adapter(source: saved_model.SavedModel, base_model: str | None, script: Path, staging: Path, tokenizer,
                     scratch: Path, gguf_type: str):
    """The adapter as adapter-TYPE.gguf in `staging`; an f32 one to check it against; the f32 base GGUF both are
    checked on (in `scratch`); and the model they are compared with (the base in fp32 with the adapter)."""
    from peft import PeftModel

    target = staging / f"adapter-{gguf_type}.gguf"
    reference, base_gguf = target if gguf_type == "f32" else scratch / "adapter-f32.gguf", scratch / "base-f32.gguf"
    model = _base_with_the_runs_tokenizer(source, base_model, staging, tokenizer, scratch / "base")
    gguf.convert(script, scratch / "base", base_gguf, "f32", gguf.adds_bos(tokenizer))
    for kind, file in {"f32": reference, gguf_type: target}.items():
        gguf.convert_adapter(script, staging, scratch / "base", file, kind)
    return target, reference, base_gguf, PeftModel.from_pretrained(model, staging)


def _base_with_the_runs_tokenizer(source: saved_model.SavedModel, base_model: str | None, staging: Path, tokenizer,
                                  folder: Path):
    """The base model unquantized in fp32, written to `folder` with the export's tokenizer and generation config
    (the template the run trained with, its end tokens): the base GGUF an adapter is checked on."""
    import torch
    from transformers import GenerationConfig

    model = saved_model.load_base(source, base_model, dtype="float32")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model.generation_config = GenerationConfig.from_pretrained(staging)
    model.generation_config.save_pretrained(folder)
    return model.to(torch.float32)


def _write_modelfile(source: saved_model.SavedModel, staging: Path, gguf_file: Path, tokenizer, renderer,
                     end_ids: set[int]) -> str:
    """An Ollama Modelfile beside the GGUF, where the template can be written as Ollama's; what was done."""
    from finetune.trained_model import ollama

    def render(messages: list[dict]) -> str:
        return renderer.render_text({"messages": messages}, add_generation_prompt=True)

    try:
        text = ollama.modelfile(gguf_file.name, render, tokenizer.convert_ids_to_tokens(sorted(end_ids)),
                                source.recipe.data.system_prompt, source.recipe.train_setting("max_length"),
                                tokenizer.bos_token if gguf.adds_bos(tokenizer) else "")
    except ollama.Inexpressible as why:
        return f"no Modelfile: {why}"
    (staging / "Modelfile").write_text(text, encoding="utf-8")
    return "Modelfile"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_and_check(source: saved_model.SavedModel, staging: Path, merged: bool, dtype: str,
                     base_model: str | None) -> Export:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.data.render import Renderer
    from finetune.models.loading import default_attention
    from finetune.trained_model.chat import configured_end_ids, end_token_ids

    tokenizer = saved_model.load_tokenizer(source)
    renderer = _renderer(tokenizer, source, Renderer)
    prompt = renderer.prompt_ids(CHECK_CONVERSATION) if tokenizer.chat_template else tokenizer(
        CHECK_CONVERSATION[0]["content"])["input_ids"]

    if merged and source.is_adapter:
        model = saved_model.load_model(source, base_model, dtype=dtype)
        reference = _logits(model, prompt)  # the adapter on the 16-bit base, before merging
        model = model.merge_and_unload()
    else:
        model = saved_model.load_model(source, base_model)
        reference = _logits(model, prompt)  # the model as trained (a full model as saved, before the cast)
        if merged:
            model = model.to(getattr(torch, dtype))
    device = model.device
    attention = default_attention(model.config)  # Gemma 2's soft-capped scores: sdpa, the default, ignores the cap
    model.save_pretrained(staging)
    generation = model.generation_config
    # The base's end tokens stay (Llama 3.2 lists <|end_of_text|>, <|eom_id|> after a tool call and <|eot_id|>),
    # with the template's own.
    generation.eos_token_id = sorted(configured_end_ids(generation) | end_token_ids(tokenizer, renderer))
    generation.pad_token_id = tokenizer.pad_token_id
    generation.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / CONFIG_NAME).write_text(source.recipe.to_yaml(), encoding="utf-8")
    if not merged:
        _point_adapter_at_base(staging, source)
    del model
    gc.collect()
    torch.cuda.empty_cache()

    # The check: load what was written with transformers (and PEFT), as a user would, and compare.
    reloaded_tokenizer = AutoTokenizer.from_pretrained(staging)
    if tokenizer.chat_template and _renderer(reloaded_tokenizer, source, Renderer).prompt_ids(CHECK_CONVERSATION) != prompt:
        raise CommandFailed("export check failed: the exported tokenizer renders conversations differently from "
                            "the one used in training; nothing was written")
    if merged:
        reloaded = AutoModelForCausalLM.from_pretrained(staging, dtype=getattr(torch, dtype), device_map={"": device},
                                                        **({"attn_implementation": attention} if attention else {}))
    else:
        from peft import PeftModel

        reloaded = PeftModel.from_pretrained(saved_model.load_base(source, base_model), staging)
    differences = _relative_differences(reference, _logits(reloaded.eval(), prompt))
    tolerance = TOLERANCE[dtype] if merged else 0.0
    within = sum(difference <= tolerance for difference in differences)
    needed = len(differences) if tolerance == 0 else POSITIONS_WITHIN * len(differences)
    if within < needed:
        raise CommandFailed(
            f"export check failed: the reloaded export's logits differ from the model's by up to "
            f"{max(differences):.3g} of the largest logit, within {tolerance:g} at only {within} of "
            f"{len(differences)} positions; nothing was written"
        )
    what = "merged model" if merged and source.is_adapter else "model" if merged else "adapter"
    return Export(staging, what, max(differences), tolerance, within, len(differences), attention)


def _renderer(tokenizer, source: saved_model.SavedModel, renderer_class):
    data = source.recipe.data
    return renderer_class(tokenizer, tokenizer.chat_template, data.template_date,
                          template_kwargs=data.template_kwargs)


def _logits(model, prompt: list[int]):
    import torch

    with torch.inference_mode():
        ids = torch.tensor([prompt], device=model.device)
        return model(input_ids=ids).logits[0].float().cpu()


def _relative_differences(reference, other) -> list[float]:
    """Per prompt position: the largest logit difference, relative to the largest reference logit."""
    return ((reference - other).abs().max(dim=-1).values / reference.abs().max()).tolist()


def _point_adapter_at_base(staging: Path, source: saved_model.SavedModel) -> None:
    """The adapter names the recipe's base model (a Hub id people can load), not the path it loaded from here."""
    from finetune import builtin

    config_path = staging / saved_model.ADAPTER_CONFIG
    config = json.loads(config_path.read_text(encoding="utf-8"))
    name = source.recipe.model.name_or_path
    config["base_model_name_or_path"] = base_origin(name) or builtin.resolve_model(name)
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def push(folder: Path, repo: str, private: bool) -> str:
    """Upload the folder with huggingface_hub. The token is the standard one (HF_TOKEN, or `hf auth login`) and is
    handed to huggingface_hub only: never printed, never written."""
    from huggingface_hub import HfApi, get_token

    later = f"the export in {folder} is complete and checked; upload it later with `hf upload {repo} {folder}`"
    if not get_token():
        raise UserError(f"--push-to-hub {repo}: no Hugging Face token; run `hf auth login` or set HF_TOKEN; {later}")
    api = HfApi()
    try:
        url = api.create_repo(repo, private=private, exist_ok=True)
        api.upload_folder(repo_id=url.repo_id, folder_path=folder, commit_message="Upload with finetune export")
    except Exception as error:  # offline, refused, network: one line, the local export stays
        text = str(error).strip().splitlines()
        raise CommandFailed(f"--push-to-hub {repo}: the upload failed ({type(error).__name__}: "
                            f"{text[0] if text else 'no detail'}); {later}") from None
    return f"{url}"
