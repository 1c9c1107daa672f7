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
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import CommandFailed, UserError
from finetune.run_folder import CONFIG_NAME, checkpoint_step, read_rows
from finetune.trained import saved_model

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
GGUF_TYPES = {"bf16": "bf16", "fp16": "f16", "fp32": "f32"}
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
    gguf: Path | None = None
    url: str | None = None


def export(path, out, merge: bool = False, dtype: str = "bf16", base_model: str | None = None,
           push_to_hub: str | None = None, private: bool = False, gguf: bool = False,
           license: str | None = None) -> Export:
    source = saved_model.locate(path)
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists and is not empty; choose another folder")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    merged = merge or not source.is_adapter  # a fully fine-tuned model is exported whole, in --dtype
    converter = gguf_converter() if gguf else None
    if gguf and not merged:
        raise UserError("--gguf converts a whole model: add --merge to merge the adapter into its base first")

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-partial-"))
    staging.chmod(0o777 & ~_umask())  # mkdtemp's folder is private; the export is an ordinary folder
    try:
        result = _write_and_check(source, staging, merged, DTYPES[dtype], base_model)
        write_card(source, staging, out.name, merged, DTYPES[dtype], license)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    result.folder = out
    if converter:
        result.gguf = _convert_to_gguf(converter, out, dtype)
    if push_to_hub:
        result.url = push(out, push_to_hub, private)
    return result


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_and_check(source: saved_model.SavedModel, staging: Path, merged: bool, dtype: str,
                     base_model: str | None) -> Export:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.data.render import Renderer
    from finetune.trained.chat import end_token_ids

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
    model.save_pretrained(staging)
    generation = model.generation_config
    # The base's end tokens stay (Llama 3.2 lists <|end_of_text|>, <|eom_id|> after a tool call and <|eot_id|>),
    # with the template's own.
    listed = generation.eos_token_id
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    generation.eos_token_id = sorted({*listed, *end_token_ids(tokenizer, renderer)})
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
        reloaded = AutoModelForCausalLM.from_pretrained(staging, dtype=getattr(torch, dtype), device_map={"": device})
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
    return Export(staging, what, max(differences), tolerance, within, len(differences))


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


def final_losses(source: saved_model.SavedModel) -> dict[str, float]:
    """The last train and eval loss up to this model's step, from its run's progress.jsonl."""
    if source.run is None:
        return {}
    last_step = checkpoint_step(source.path)
    losses: dict[str, float] = {}
    for row in read_rows(source.run):
        if last_step is not None and row.get("step", 0) > last_step:
            continue
        for key, name in (("loss", "train_loss"), ("eval_loss", "eval_loss")):
            if key in row:
                losses[name] = row[key]
                losses[f"{name}_step"] = row["step"]
    return losses


def training_sources(recipe) -> list[str]:
    """The names of the recipe's training sources, a mixture's entries included (`{path: ..., rows: N}`)."""
    entries = recipe.data.train if isinstance(recipe.data.train, list) else [recipe.data.train]
    return [entry["path"] if isinstance(entry, dict) else entry for entry in entries]


def hub_datasets(recipe) -> list[str]:
    """The recipe's training data that are Hub datasets (owner/name), for the card's metadata."""
    return [repo for repo in (hub_dataset(name) for name in training_sources(recipe)) if repo]


def hub_dataset(name: str) -> str | None:
    if Path(name).suffix in (".jsonl", ".json", ".parquet", ".csv"):
        return None  # a data file, here or on the machine that trained
    return hub_id(name.partition("@")[0].partition(":")[0])


def data_names(recipe) -> str:
    """The training data as the card names it: Hub datasets and builtins by name, local data never by its path."""
    return ", ".join(dict.fromkeys(data_name(name) for name in training_sources(recipe)))


def data_name(name: str) -> str:
    from finetune import builtin

    return hub_dataset(name) or (name if builtin.is_builtin(name) else "local data")


def hub_id(name: str) -> str | None:
    """`name` if it is a Hub repository id (owner/name), not a builtin or a path on this machine."""
    from finetune import builtin

    if builtin.is_builtin(name) or Path(name).expanduser().exists() or name.count("/") != 1 or name.startswith("."):
        return None
    return name


TRAINERS = {"sft": "SFTTrainer", "dpo": "DPOTrainer", "kto": "KTOTrainer", "grpo": "GRPOTrainer"}


def base_origin(name: str) -> str | None:
    """The Hub id of the base model: the name itself, or for a local folder the id its config, its card or the
    Hugging Face cache path names; None for a local model of unknown origin. Builtins keep their name."""
    from finetune import builtin

    if builtin.is_builtin(name) or hub_id(name):
        return name
    folder = Path(name).expanduser()
    cached = [part for part in folder.resolve().parts if part.startswith("models--")]
    if cached:  # ~/.cache/huggingface/hub/models--OWNER--NAME/snapshots/...
        return cached[-1].removeprefix("models--").replace("--", "/", 1)
    candidates = []
    card = folder / "README.md"
    if card.is_file():
        from huggingface_hub import ModelCard

        try:
            base = ModelCard.load(card).data.base_model
        except Exception:  # a card without metadata: no origin from it
            base = None
        candidates += base if isinstance(base, list) else [base]
    config = folder / "config.json"
    if config.is_file():
        candidates.append(json.loads(config.read_text(encoding="utf-8")).get("_name_or_path"))
    return next((c for c in candidates if isinstance(c, str) and hub_id(c)), None)


def base_license(base: str) -> str | None:
    """The base model's license from its model card, when the card is on this machine (a local folder or the
    Hugging Face cache); None when unknown."""
    from huggingface_hub import ModelCard, try_to_load_from_cache

    card = Path(base).expanduser() / "README.md"
    if not card.is_file():
        cached = try_to_load_from_cache(hub_id(base), "README.md") if hub_id(base) else None
        if not isinstance(cached, str):
            return None
        card = Path(cached)
    try:
        return ModelCard.load(card).data.license
    except Exception:  # a card without metadata, or unparsable: the license stays unknown
        return None


def write_card(source: saved_model.SavedModel, staging: Path, title: str, merged: bool, dtype: str = "bfloat16",
               license: str | None = None) -> None:
    """README.md with the Hub's metadata: what was trained, on what, how, and how to use it."""
    from huggingface_hub import ModelCard, ModelCardData

    from finetune import builtin

    recipe = source.recipe
    origin = base_origin(recipe.model.name_or_path)
    base = origin or "a local model"  # never this machine's path
    loadable_base = builtin.resolve_model(origin) if origin else "BASE"  # builtins are local folders
    license = license or base_license(source.base_model()) or "other"
    datasets = hub_datasets(recipe)
    data = ModelCardData(
        base_model=hub_id(origin) if origin else None, datasets=datasets or None, license=license,
        library_name="transformers" if merged else "peft", pipeline_tag="text-generation",
        tags=["finetune", "trl", recipe.stage, *([] if merged else ["lora"]),
              *(["qlora"] if recipe.method == "qlora" else [])],
    )
    losses = final_losses(source)
    train = recipe.train
    what = {"full": "A fully fine-tuned", "lora": "A LoRA", "qlora": "A QLoRA (LoRA on a 4-bit NF4 base)"}[recipe.method]
    lines = [
        f"# {title}",
        "",
        f"{what} fine-tune of {_quoted(base, origin)}, trained with finetune (TRL's `{TRAINERS[recipe.stage]}` "
        "and PEFT)"
        + (f", exported merged into the base in {dtype}." if merged and source.is_adapter else
           f", exported in {dtype}." if merged else ": the adapter alone."),
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| base model | {_quoted(base, origin)} |",
        *([f"| stage | {recipe.stage}"
           + (f" ({', '.join(f'{k} {v}' for k, v in recipe.stage_section.items() if k != 'rewards')})"
              if recipe.stage_section else "")
           + (f"; rewards {', '.join(r['function'] for r in recipe.grpo['rewards'])}" if recipe.stage == "grpo" else "")
           + ("; continued an adapter trained before (model.adapter)" if recipe.model.adapter else "") + " |"]
          if recipe.stage != "sft" or recipe.model.adapter else []),
        f"| method | {recipe.method}"
        + (f" (r {recipe.lora.r}, alpha {recipe.lora.alpha}, targets {recipe.lora.target_modules}"
           + (f", parameters {', '.join(recipe.lora.target_parameters)}" if recipe.lora.target_parameters else "")
           + ")" if recipe.method != "full" else "") + " |",
        f"| data | {data_names(recipe)} |",
        f"| loss on | {recipe.data.loss_on} turns; reasoning (`thinking`) trained: "
        f"{'yes' if recipe.data.train_thinking else 'no'} |",
    ]
    for key in ("learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
                "gradient_accumulation_steps", "max_length", "packing", "lr_scheduler_type", "warmup_steps", "seed"):
        if key in train:
            lines.append(f"| {key} | {train[key]} |")
    for name in ("train_loss", "eval_loss"):
        if name in losses:
            lines.append(f"| final {name.replace('_', ' ')} | {losses[name]:.4f} (step {losses[name + '_step']}) |")
        else:
            lines.append(f"| final {name.replace('_', ' ')} | not recorded |")
    lines += evaluation_lines(source)
    lines += ["", "## Use it", "", "```python"]
    if merged:
        lines += ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                  'model = AutoModelForCausalLM.from_pretrained("REPO", dtype="auto", device_map="auto")',
                  'tokenizer = AutoTokenizer.from_pretrained("REPO")']
    else:
        lines += ["from peft import PeftModel", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                  f'base = AutoModelForCausalLM.from_pretrained("{loadable_base}", dtype="auto", device_map="auto")',
                  'model = PeftModel.from_pretrained(base, "REPO")',
                  'tokenizer = AutoTokenizer.from_pretrained("REPO")  # with the chat template used in training']
    lines += [
        'messages = [{"role": "user", "content": "Hello!"}]',
        'inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",',
        '                                       return_dict=True).to(model.device)',
        "output = model.generate(**inputs, max_new_tokens=256)  # stops at the end tokens in generation_config.json",
        'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
        "```",
        "",
        "REPO is this repository's id, or the folder it was downloaded to"
        + ("." if origin or merged else "; BASE is the base model this adapter was trained on."),
        "",
        "## Recipe",
        "",
        f"The resolved recipe ({CONFIG_NAME}, also in this folder):",
        "",
        "```yaml",
        _shown_recipe(recipe, base).rstrip(),
        "```",
        "",
        "## License",
        "",
        "The base model's license applies; see its model card." if license == "other" else f"`{license}`",
    ]
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")
    card.save(staging / "README.md")


def _quoted(base: str, origin: str | None) -> str:
    return f"`{base}`" if origin else base


def _shown_recipe(recipe, base: str) -> str:
    """The recipe as the card shows it, with no path of this machine: the base model by its Hub id or as "a local
    model", data as `data_names` names it, the run folder by its name."""
    import dataclasses

    def shown(sources):
        if isinstance(sources, list):
            return [{**entry, "path": shown(entry["path"])} if isinstance(entry, dict) else shown(entry)
                    for entry in sources]
        return sources if sources is None else data_name(sources)

    data = dataclasses.replace(recipe.data, train=shown(recipe.data.train), eval=shown(recipe.data.eval))
    model = dataclasses.replace(recipe.model, name_or_path=base)
    if model.adapter and not hub_id(model.adapter):
        model = dataclasses.replace(model, adapter="a local adapter")
    return dataclasses.replace(recipe, model=model, data=data, output_dir=Path(recipe.output_dir).name).to_yaml()


def evaluation_lines(source: saved_model.SavedModel) -> list[str]:
    """The card's evaluation section: `finetune eval` results kept in the run for this model, beside the base's
    on the same data."""
    from finetune.trained.evaluate import saved_results, shown_value

    if source.run is None:
        return []
    label = source.path.name
    records = saved_results(source.run)
    mine = {record["data"]: record for record in records if record["model"] == label}  # the newest per data
    if not mine:
        return []
    base = {record["data"]: record for record in records if record["model"] == "base"}
    lines = ["", "## Evaluation", "", "`finetune eval` on held-out data (greedy answers):", "",
             "| data | metric | this model | base model |", "|---|---|---|---|"]
    for data, record in mine.items():
        shown = f"{Path(data).name} ({record['examples']} examples)" if data else "lm-evaluation-harness"
        for metric, value in {**record["metrics"], **record.get("tasks", {})}.items():
            theirs = {**base.get(data, {}).get("metrics", {}), **base.get(data, {}).get("tasks", {})}.get(metric)
            lines.append(f"| {shown} | {metric} | {shown_value(metric, value)} | {shown_value(metric, theirs)} |")
    return lines


def gguf_converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py: in $LLAMA_CPP_DIR, or on PATH."""
    places = []
    if os.environ.get("LLAMA_CPP_DIR"):
        places.append(Path(os.environ["LLAMA_CPP_DIR"]) / "convert_hf_to_gguf.py")
    on_path = shutil.which("convert_hf_to_gguf.py")
    if on_path:
        places.append(Path(on_path))
    for place in places:
        if place.is_file():
            return place
    raise UserError("--gguf needs llama.cpp's converter (convert_hf_to_gguf.py), which was not found: set "
                    "LLAMA_CPP_DIR to a llama.cpp checkout (with `pip install -r requirements.txt` done there), or "
                    "put the script on PATH; or export without --gguf")


def _convert_to_gguf(converter: Path, out: Path, dtype: str) -> Path:
    target = out / f"model-{GGUF_TYPES[dtype]}.gguf"
    result = subprocess.run([sys.executable, str(converter), str(out), "--outfile", str(target),
                             "--outtype", GGUF_TYPES[dtype]], capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        raise CommandFailed(f"llama.cpp's converter failed: {last}; the checked export in {out} is intact")
    return target


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
