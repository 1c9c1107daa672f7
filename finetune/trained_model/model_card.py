"""The model card an export (and a run logged to MLflow) carries: README.md with the Hub's metadata, what was
trained, on what, how, its evaluation beside the base model's, and how to load it. Rendered from
finetune/templates/model_card.md.jinja with huggingface_hub's ModelCard; it never shows a path of this machine."""

from __future__ import annotations

import json
from pathlib import Path

from finetune import hub
from finetune.data import eval_sets, integrity
from finetune.recipe.train_section import GLOBAL_BATCH
from finetune.run_folder import CONFIG_NAME, DATA_CHECKS_NAME, checkpoint_step, read_rows
from finetune.trained_model import gguf, saved_model


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
    """The names of the recipe's training sources, a mixture's entries included (`{path: ..., rows: N}`); of data
    prepared by `finetune prepare` without them, its folder."""
    train = recipe.data.train or recipe.data.prepared
    entries = train if isinstance(train, list) else [train]
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


def evaluation_set_name(name: str) -> str:
    """A data.decontaminate set as the card names it: lm-eval tasks by name, data as data_name names it."""
    return name if name.startswith(eval_sets.LM_EVAL) else data_name(name)


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
    cached = hub.cached_repo_id(folder)
    if cached:
        return cached
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


METHOD_WORDS = {"full": "A full", "lora": "A LoRA", "qlora": "A QLoRA (LoRA on a 4-bit NF4 base)"}
CARD_TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "model_card.md.jinja"
CARD_TRAIN_KEYS = ("learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
                   "gradient_accumulation_steps", "max_length", "packing", "lr_scheduler_type", "warmup_steps", "seed")


def write_card(source: saved_model.SavedModel, staging: Path, title: str, merged: bool, dtype: str = "bfloat16",
               license: str | None = None, attention: str | None = None, gguf_report: dict | None = None) -> None:
    """README.md with the Hub's metadata: what was trained, on what, how, and how to use it."""
    from huggingface_hub import ModelCard, ModelCardData

    from finetune import builtin

    recipe = source.recipe
    origin = base_origin(recipe.model.name_or_path)
    base = origin or "a local model"  # never this machine's path
    license = license or base_license(source.base_model()) or "other"
    data = ModelCardData(
        base_model=hub_id(origin) if origin else None, datasets=hub_datasets(recipe) or None, license=license,
        library_name="transformers" if merged else "peft", pipeline_tag="text-generation",
        tags=["finetune", "trl", recipe.stage, *([] if merged else ["lora"]),
              *(["qlora"] if recipe.method == "qlora" else [])],
    )
    exported = (f", exported merged into the base in {dtype}." if merged and source.is_adapter else
                f", exported in {dtype}." if merged else ": the adapter alone.")
    card = ModelCard.from_template(
        data, template_path=CARD_TEMPLATE, title=title, what=METHOD_WORDS[recipe.method],
        base=_quoted(base, origin), trainer=TRAINERS[recipe.stage], exported=exported, rows=training_rows(source),
        evaluation=evaluation_rows(source), merged=merged,
        loadable_base=builtin.resolve_model(origin) if origin else "BASE",  # builtins are local folders
        config_name=CONFIG_NAME, recipe=_shown_recipe(recipe, base).rstrip(), license=license,
        loading=f', attn_implementation="{attention}"' if attention else "",
        gguf=gguf_report and {"file": gguf_report["file"], "checked": gguf.summary(gguf_report)})
    card.save(staging / "README.md")


def training_rows(source: saved_model.SavedModel) -> list[tuple[str, object]]:
    """The card's training table: base, stage, method, data, the main settings and the final losses."""
    recipe = source.recipe
    origin = base_origin(recipe.model.name_or_path)
    rows = [("base model", _quoted(origin or "a local model", origin))]
    if recipe.stage != "sft" or recipe.model.adapter:
        options = ", ".join(f"{k} {v}" for k, v in recipe.stage_section.items() if k != "rewards")
        rewards = ", ".join(r["function"] for r in recipe.grpo["rewards"]) if recipe.stage == "grpo" else ""
        continued = "; continued an adapter trained before (model.adapter)" if recipe.model.adapter else ""
        rows.append(("stage", recipe.stage + (f" ({options})" if options else "")
                     + (f"; rewards {rewards}" if rewards else "") + continued))
    lora = recipe.lora
    targets = (f", parameters {', '.join(lora.target_parameters)}" if lora.target_parameters else "")
    rows.append(("method", recipe.method + (f" (r {lora.r}, alpha {lora.alpha}, targets {lora.target_modules}{targets})"
                                            if recipe.method != "full" else "")))
    rows.append(("data", data_names(recipe)))
    checks = source.run and source.run / DATA_CHECKS_NAME
    if checks and checks.is_file():
        found = json.loads(checks.read_text(encoding="utf-8"))
        rows.append(("data checks", integrity.summary(found, evaluation_set_name)))
    rows.append(("loss on", f"{recipe.data.loss_on} turns; reasoning (`thinking`) trained: "
                            f"{'yes' if recipe.data.train_thinking else 'no'}"))
    rows += _settings(recipe)
    losses = final_losses(source)
    for name in ("train_loss", "eval_loss"):
        shown = f"{losses[name]:.4f} (step {losses[name + '_step']})" if name in losses else "not recorded"
        rows.append((f"final {name.replace('_', ' ')}", shown))
    return rows


def _settings(recipe) -> list[tuple[str, object]]:
    """The main training settings as the run's trainer had them (TRL's defaults where the recipe left one); a global
    batch as the recipe gives it, since the run split it over its processes."""
    settings = {key: recipe.train_setting(key) for key in CARD_TRAIN_KEYS}
    if recipe.train_setting(GLOBAL_BATCH):
        del settings["gradient_accumulation_steps"]
        settings = {GLOBAL_BATCH: recipe.train_setting(GLOBAL_BATCH), **settings}
    if recipe.auto_micro_batch:
        settings["per_device_train_batch_size"] = "auto (the largest that fits)"
    return list(settings.items())


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

    data = dataclasses.replace(recipe.data, train=shown(recipe.data.train), eval=shown(recipe.data.eval),
                               prepared=shown(recipe.data.prepared),
                               decontaminate=[evaluation_set_name(name) for name in recipe.data.decontaminate])
    model = dataclasses.replace(recipe.model, name_or_path=base)
    if model.adapter and not hub_id(model.adapter):
        model = dataclasses.replace(model, adapter="a local adapter")
    return dataclasses.replace(recipe, model=model, data=data, output_dir=Path(recipe.output_dir).name).to_yaml()


def evaluation_rows(source: saved_model.SavedModel) -> list[tuple[str, str, str, str]]:
    """The card's evaluation table, (data, metric, this model, base model): `finetune eval` results kept in the run
    for this model, beside the base's on the same data."""
    from finetune.trained_model.evaluate import saved_results, shown_value

    if source.run is None:
        return []
    label = source.path.name
    records = saved_results(source.run)
    mine = {record["data"]: record for record in records if record["model"] == label}  # the newest per data
    base = {record["data"]: record for record in records if record["model"] == "base"}
    rows = []
    for data, record in mine.items():
        shown = f"{Path(data).name} ({record['examples']} examples)" if data else "lm-evaluation-harness"
        theirs = {**base.get(data, {}).get("metrics", {}), **base.get(data, {}).get("tasks", {})}
        for metric, value in {**record["metrics"], **record.get("tasks", {})}.items():
            rows.append((shown, metric, shown_value(metric, value), shown_value(metric, theirs.get(metric))))
    return rows
