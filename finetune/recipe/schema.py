"""The recipe: one typed configuration tree loaded from YAML, with `key.sub=value` overrides.

    stage:    sft | dpo | kto | grpo: which of TRL's trainers (stage_sections.py); sft by default
    model:    what to load (ModelSection)
    method:   lora | qlora | full
    lora:     the adapter (LoraSection), for lora and qlora
    data:     what to train on and how to render it (DataSection)
    train:    any training argument of the stage's TRL config (learning_rate, num_train_epochs, ...; for sft every
              SFTConfig field) over the toolkit's defaults, checked in train_section.py
    dpo, kto, grpo: the stage's own settings (DPOConfig's beta, loss_type, ...; grpo.rewards), for that stage
    eval:     what evaluations show besides the loss: answers to held-out prompts (EvalSection)
    mlflow:   where and how runs that report to MLflow are tracked (MlflowSection)
    output_dir: the run folder

Everything here is checked before a model or dataset loads: unknown keys (with the closest valid key), types,
allowed values and contradictions all raise `UserError` naming the file or override and the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from finetune import mlflow_store
from finetune.errors import UserError
from finetune.recipe import sections, stage_sections, train_section
from finetune.recipe.sections import DataSection, EvalSection, LoraSection, MlflowSection, ModelSection
from finetune.recipe.typecheck import coerce
from finetune.recipe.yaml_files import read_mapping
from finetune.resources import find_recipe

Method = Literal["lora", "qlora", "full"]


@dataclass
class Recipe:
    stage: Literal["sft", "dpo", "kto", "grpo"] = field(
        default="sft", metadata={"help": "sft (supervised), dpo or kto (preferences), grpo (rewards)."}
    )
    model: ModelSection = field(default_factory=ModelSection)
    method: Method = field(default="lora", metadata={"help": "lora, qlora (LoRA on a 4-bit base) or full."})
    lora: LoraSection = field(default_factory=LoraSection)
    data: DataSection = field(default_factory=DataSection)
    train: dict[str, Any] = field(default_factory=dict, metadata={"help": "Fields of TRL's SFTConfig."})
    dpo: dict[str, Any] = field(default_factory=dict, metadata={"help": "DPOConfig's own fields (stage dpo)."})
    kto: dict[str, Any] = field(default_factory=dict, metadata={"help": "KTOConfig's own fields (stage kto)."})
    grpo: dict[str, Any] = field(default_factory=dict, metadata={"help": "GRPOConfig's own fields and rewards "
                                                                         "(stage grpo)."})
    eval: EvalSection = field(default_factory=EvalSection)
    mlflow: MlflowSection = field(default_factory=MlflowSection)
    output_dir: str | None = field(default=None, metadata={"help": "Run folder; default runs/<recipe name>."})

    def to_dict(self) -> dict[str, Any]:
        resolved = dataclasses.asdict(self)
        if self.method == "full" or self.model.adapter:
            del resolved["lora"]  # no new adapter: its settings would only mislead
        for stage in stage_sections.STAGES[1:]:
            if stage != self.stage:
                del resolved[stage]
        return resolved

    @property
    def stage_section(self) -> dict[str, Any]:
        return getattr(self, self.stage) if self.stage != "sft" else {}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    @functools.cached_property
    def trainer(self):
        """The trainer section resolved once: the stage's TRL config (SFTConfig, DPOConfig, ...) that the recipe
        gives, its values over TRL's defaults and what TRL's own checks derive (as for loss_type). Read it through
        `train_setting`; the run builds its own from `trainer_config` with what it decides on the machine."""
        return self.trainer_config(use_cpu=True)

    def train_setting(self, key: str) -> Any:
        """train.KEY as the run's trainer uses it: the recipe's value, else the resolved config's. Every reader of a
        trainer setting goes through here (or `precision`), so that none supplies a default of its own."""
        value = getattr(self.trainer, key) if hasattr(self.trainer, key) else self.train.get(key)
        return value.value if isinstance(value, enum.Enum) else value  # transformers' strategy and optimizer names

    @property
    def precision(self) -> Literal["bf16", "fp16", "fp32"] | None:
        """What train.bf16 and train.fp16 choose; None where neither is set: the device's own (the run trains in
        bf16 where the hardware has it, fp16 on CUDA cards without it, fp32 on the CPU). TRL's config would say bf16
        for a recipe that sets neither, whatever the device, so this one rule is the toolkit's."""
        if self.train.get("bf16"):
            return "bf16"
        if self.train.get("fp16"):
            return "fp16"
        return "fp32" if "bf16" in self.train or "fp16" in self.train else None

    def eval_strategy(self, has_eval: bool) -> str:
        """When the run evaluates: train.eval_strategy, else with eval data every train.eval_steps where given, else
        at each epoch's end; never without eval data."""
        if "eval_strategy" in self.train:
            return self.train_setting("eval_strategy")
        return "no" if not has_eval else "steps" if "eval_steps" in self.train else "epoch"

    def trainer_config(self, **runtime: Any):
        """The config the stage's trainer gets (SFTConfig, DPOConfig, ...): train.* and the stage's section, plus
        what the toolkit decides at run time (e.g. use_cpu, and the micro-batch and accumulation steps from
        `batch_split`)."""
        return stage_sections.trainer_config(self, train_section.sft_values(self.train), runtime)

    @property
    def auto_micro_batch(self) -> bool:
        return self.train.get("per_device_train_batch_size") == train_section.AUTO

    def batch_split(self, processes: int, micro_batch: int | None = None) -> tuple[int, int]:
        """(per-device micro-batch, accumulation steps) on `processes`. With train.global_batch_size the global
        batch is fixed and the accumulation follows; `micro_batch` is the one chosen for `auto`."""
        micro = micro_batch or self.train_setting("per_device_train_batch_size")
        if train_section.GLOBAL_BATCH not in self.train:
            return micro, self.train_setting("gradient_accumulation_steps")
        total = self.train[train_section.GLOBAL_BATCH]
        if total % (micro * processes):
            raise UserError(
                f"train.global_batch_size {total} is not a whole number of micro-batches of {micro} rows on "
                f"{processes} process{'es' if processes > 1 else ''}; choose a global batch that is a multiple of "
                f"{micro * processes}, or another train.per_device_train_batch_size")
        return micro, total // (micro * processes)


SECTIONS = {"model": ModelSection, "lora": LoraSection, "data": DataSection, "eval": EvalSection,
            "mlflow": MlflowSection}


def load_recipe(recipe: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a recipe file (or the name of a shipped recipe), apply overrides, validate, fill defaults."""
    path = find_recipe(recipe)
    raw = read_mapping(path, "recipe", "model:, data:, train:, ...")
    # x-... keys hold what YAML anchors name (`x-common: &common {...}`, then `train: {<<: *common}`), as in Compose
    raw = {key: value for key, value in raw.items() if not str(key).startswith("x-")}
    raw.setdefault("output_dir", str(Path("runs") / path.stem))
    if isinstance(raw.setdefault("mlflow", {}), dict):
        raw["mlflow"].setdefault("experiment", path.stem)
    origins: dict[str, str] = {}
    for override in overrides:
        key, value = _parse_override(override)
        _set_dotted(raw, key, value, override)
        origins[key] = f"override {override!r}"
    return _build(raw, str(path), origins)


def recipe_from_dict(raw: dict[str, Any], where: str = "config") -> Recipe:
    """Rebuild a saved, resolved recipe (e.g. a checkpoint's finetune.yaml) with the same checks, except those
    about this machine's training set-up (a logging back-end that is not installed here does not matter)."""
    return _build(raw, where, {}, for_training=False)


NULLS = ("null", "Null", "NULL", "~")


def _parse_override(override: str) -> tuple[str, Any]:
    """(key, value): the value read as YAML, except for a text setting, whose value is the text as written (YAML
    would cut `Reply in C# only #strict` at its comment and read `yes` as true and `a: b` as a mapping)."""
    key, sep, text = override.partition("=")
    if not sep or not key or " " in key:
        raise UserError(f"override {override!r}: write overrides as key.sub=value, e.g. train.learning_rate=1e-4")
    if _takes_text(key):
        return key, None if text in NULLS else text
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        value = text
    if value is None and text.strip() not in NULLS:
        value = text  # YAML reads `####` as a comment; on the command line it is the text
    return key, value


def _takes_text(dotted: str) -> bool:
    """Whether the setting is text (str, or str or null)."""
    section, _, leaf = dotted.partition(".")
    if not leaf:
        annotation = _hints(Recipe).get(section)
    elif "." in leaf:
        return False
    elif section in SECTIONS:
        annotation = _hints(SECTIONS[section]).get(leaf)
    elif section == "train":
        annotation = train_section.sft_fields().get(leaf)
    elif section in stage_sections.STAGES[1:]:
        annotation = stage_sections.section_fields(section).get(leaf)
    else:
        return False
    return annotation is str or (typing.get_origin(annotation) in (typing.Union, types.UnionType)
                                 and set(typing.get_args(annotation)) == {str, type(None)})


def _set_dotted(raw: dict, key: str, value: Any, override: str) -> None:
    *parents, leaf = key.split(".")
    node = raw
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"override {override!r}: {'.'.join(parents[: i + 1])} is a value, not a section")
        node = child
    node[leaf] = value


def _build(raw: dict[str, Any], where: str, origins: dict[str, str], for_training: bool = True) -> Recipe:
    def origin(key: str) -> str:
        """The override that set `key` (or a key inside it), else the recipe file."""
        if key in origins:
            return origins[key]
        return next((text for set_key, text in origins.items() if set_key.startswith(key + ".")), where)

    _reject_all_unknown(raw, origin)
    _reject_unknown(raw, Recipe, "", origin)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Recipe):
        if f.name not in raw:
            continue
        if f.name in SECTIONS:
            section = raw[f.name] if raw[f.name] is not None else {}
            if not isinstance(section, dict):
                raise UserError(f"{origin(f.name)}: {f.name} is a section of keys, not {section!r}")
            values[f.name] = _build_section(section, SECTIONS[f.name], f.name, origin)
        elif f.name in ("train", *stage_sections.STAGES[1:]):
            values[f.name] = raw[f.name] if raw[f.name] is not None else {}
            if not isinstance(values[f.name], dict):
                raise UserError(f"{origin(f.name)}: {f.name} is a section of keys, not {values[f.name]!r}")
        else:
            values[f.name] = coerce(raw[f.name], _hints(Recipe)[f.name], f.name, origin(f.name))
    recipe = Recipe(**values)
    _fill_from_adapter(recipe, origin)
    _check_required(recipe, where)
    _check_contradictions(recipe, raw, origin)
    has_eval = bool(recipe.data.eval or recipe.data.eval_fraction)
    for stage in stage_sections.STAGES[1:]:
        if getattr(recipe, stage) and stage != recipe.stage:
            raise UserError(f"{origin(stage)}: {stage} settings are given but the stage is {recipe.stage}; set "
                            f"stage: {stage}, or remove the {stage} section")
    if recipe.stage != "sft":
        setattr(recipe, recipe.stage, stage_sections.resolve_section(recipe.stage, recipe.stage_section, origin, _suggest))
    recipe.train = train_section.resolve(recipe.train, recipe.method, has_eval, recipe.output_dir, origin, _suggest,
                                         for_training, recipe.stage, recipe.stage_section)
    if for_training and mlflow_store.reports_to_mlflow(recipe.train_setting("report_to")):
        mlflow_store.check_store(recipe.output_dir, recipe.mlflow.tracking_uri, origin("train.report_to"))
    return recipe


def _build_section(section: dict, cls: type, prefix: str, origin) -> Any:
    _reject_unknown(section, cls, prefix + ".", origin)
    hints = _hints(cls)
    return cls(**{k: coerce(v, hints[k], f"{prefix}.{k}", origin(f"{prefix}.{k}")) for k, v in section.items()})


def _reject_unknown(section: dict, cls: type, prefix: str, origin) -> None:
    known = [f.name for f in dataclasses.fields(cls)]
    for key in section:
        if key not in known:
            dotted = prefix + str(key)
            raise UserError(f"{origin(dotted)}: unknown key {dotted!r}{_suggest(dotted)}")


def _reject_all_unknown(raw: dict, origin) -> None:
    """Several keys that no section knows are reported together (one alone gets its section's own message)."""
    keys = _all_keys()
    given = [str(key) for key in raw if key not in SECTIONS and key != "train" and key not in stage_sections.STAGES[1:]]
    for section in (*SECTIONS, "train", *stage_sections.STAGES[1:]):
        if isinstance(raw.get(section), dict):
            given += [f"{section}.{key}" for key in raw[section]]
    unknown = [key for key in given if key not in keys and key.removeprefix("train.") not in train_section.NOT_USED]
    if len(unknown) > 1:
        raise UserError(f"{len(unknown)} unknown keys, fix them all and run again:" + "".join(
            f"\n  {origin(key)}: {key!r}{_suggest(key)}" for key in unknown))


@functools.cache
def _all_keys() -> tuple[str, ...]:
    keys = [f.name for f in dataclasses.fields(Recipe)]
    for name, cls in SECTIONS.items():
        keys += [f"{name}.{f.name}" for f in dataclasses.fields(cls)]
    keys += [f"train.{name}" for name in [*train_section.sft_fields(), train_section.GLOBAL_BATCH]]
    return tuple(keys + stage_sections.section_keys())


def _suggest(dotted: str) -> str:
    """'; did you mean X?' with the closest valid key, comparing whole keys and then the last component."""
    keys = _all_keys()
    match = difflib.get_close_matches(dotted, keys, n=1, cutoff=0.6)
    if not match:
        leaf = dotted.rsplit(".", 1)[-1]
        leaves = {key.rsplit(".", 1)[-1]: key for key in keys}
        close = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.75)
        match = [leaves[close[0]]] if close else []
    return f"; did you mean {match[0]!r}?" if match else ""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fill_from_adapter(recipe: Recipe, origin) -> None:
    """model.adapter: the adapter folder it names (a run's final/), checked; name_or_path defaults to its base."""
    if not recipe.model.adapter:
        return
    import json

    where = origin("model.adapter")
    folder = Path(recipe.model.adapter)
    if (folder / "final").is_dir():
        folder = folder / "final"
    config = folder / "adapter_config.json"
    if not config.is_file():
        raise UserError(f"{where}: model.adapter {recipe.model.adapter} is not a LoRA adapter (no "
                        f"{config}); give a run folder that has final/, one of its checkpoints, or an adapter folder")
    recipe.model.adapter = str(folder)
    if not recipe.model.name_or_path:
        recipe.model.name_or_path = json.loads(config.read_text(encoding="utf-8")).get("base_model_name_or_path")


def _check_required(recipe: Recipe, where: str) -> None:
    if not recipe.model.name_or_path:
        raise UserError(f"{where}: model.name_or_path is required (a Hub id, a local folder or builtin:tiny-llama)")
    if not recipe.data.train and not recipe.data.prepared:
        raise UserError(f"{where}: data.train is required (a file, a folder, or a Hub dataset name), or "
                        "data.prepared (a folder finetune prepare wrote)")


def _check_contradictions(recipe: Recipe, raw: dict, origin) -> None:
    if recipe.method == "full" and raw.get("lora"):
        raise UserError(
            f"{origin('lora')}: lora settings are given but method is full, which trains every weight and has no "
            "adapter; remove the lora section or set method=lora"
        )
    if recipe.model.adapter and (recipe.method == "full" or raw.get("lora")):
        key = "method" if recipe.method == "full" else "lora"
        raise UserError(f"{origin(key)}: model.adapter continues training that LoRA adapter, with its own settings; "
                        + ("set method lora (or qlora)" if key == "method" else "remove the lora section"))
    preference = recipe.stage in stage_sections.PREFERENCE_STAGES
    if recipe.data.format != "auto" and (recipe.data.format in sections.PREFERENCE_FORMATS) != preference:
        raise UserError(f"{origin('data.format')}: data.format {recipe.data.format} is not data for stage "
                        f"{recipe.stage}; " + (f"stage {recipe.stage} takes {', '.join(sections.PREFERENCE_FORMATS)}"
                                               if preference else "it is preference data, for stage dpo or kto"))
    if recipe.stage != "sft" and recipe.data.loss_on == "all":
        raise UserError(f"{origin('data.loss_on')}: stage {recipe.stage} scores answers only; remove data.loss_on")
    if recipe.data.eval and recipe.data.eval_fraction:
        raise UserError(
            f"{origin('data.eval_fraction')}: data.eval and data.eval_fraction both choose the eval split; keep one"
        )
    if not 0.0 <= recipe.data.eval_fraction < 1.0:
        raise UserError(f"{origin('data.eval_fraction')}: data.eval_fraction must be at least 0 and below 1")
    if not 0.0 < recipe.data.near_duplicate_threshold <= 1.0:
        raise UserError(f"{origin('data.near_duplicate_threshold')}: data.near_duplicate_threshold is a Jaccard "
                        "similarity: above 0 and at most 1")
    if not 0.0 <= recipe.data.contamination_max_share <= 1.0:
        raise UserError(f"{origin('data.contamination_max_share')}: data.contamination_max_share is a share of the "
                        "train rows: from 0 to 1")
    for name in ("r", "alpha"):
        if getattr(recipe.lora, name) <= 0:
            raise UserError(f"{origin('lora.' + name)}: lora.{name} must be a positive whole number")
    if not 0 <= recipe.lora.dropout < 1:
        raise UserError(f"{origin('lora.dropout')}: lora.dropout must be at least 0 and below 1")
    for index, entry in enumerate(recipe.data.train if isinstance(recipe.data.train, list) else []):
        _check_mixture_entry(entry, f"data.train[{index}]", origin("data.train"))
    if recipe.data.num_proc is not None and recipe.data.num_proc <= 0:
        raise UserError(f"{origin('data.num_proc')}: data.num_proc must be a positive whole number")
    if recipe.data.max_rows is not None and recipe.data.max_rows <= 0:
        raise UserError(f"{origin('data.max_rows')}: data.max_rows must be a positive whole number")
    if recipe.eval.samples < 0 or recipe.eval.max_new_tokens < 1:
        key = "eval.samples" if recipe.eval.samples < 0 else "eval.max_new_tokens"
        raise UserError(f"{origin(key)}: {key} must be {'at least 0' if key == 'eval.samples' else 'at least 1'}")
    try:
        from datetime import date

        date.fromisoformat(recipe.data.template_date)
    except ValueError:
        raise UserError(f"{origin('data.template_date')}: data.template_date must be a date as YYYY-MM-DD") from None


MIXTURE_SHARES = ("rows", "fraction", "weight")


def _check_mixture_entry(entry, key: str, where: str) -> None:
    """A mixture entry: {path, and at most one of rows (a count), fraction (of the source), weight (its share of
    the weighted sources' rows)}."""
    if not isinstance(entry, dict):
        return
    unknown = [name for name in entry if name not in ("path", *MIXTURE_SHARES)]
    if unknown or not isinstance(entry.get("path"), str):
        raise UserError(f"{where}: {key} takes path: and one of {', '.join(MIXTURE_SHARES)}"
                        + (f"; {unknown[0]!r} is not one of them" if unknown else "; its path: is missing"))
    shares = [name for name in MIXTURE_SHARES if name in entry]
    if len(shares) > 1:
        raise UserError(f"{where}: {key} sets both {shares[0]} and {shares[1]}; keep one")
    for name in shares:
        value = entry[name]
        whole = name == "rows"
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) or not value > 0 \
                or not math.isfinite(value):
            raise UserError(f"{where}: {key}.{name} must be a positive {'whole ' if whole else ''}number, "
                            f"got {value!r}")


