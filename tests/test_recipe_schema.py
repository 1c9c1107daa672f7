"""Recipes: every shipped YAML loads; bad settings get one clear message naming the file or override and the key."""

from __future__ import annotations

import pytest
import yaml

from finetune.errors import UserError
from finetune.recipe.schema import load_recipe, recipe_from_dict
from finetune.resources import accelerate_configs_dir, find_recipe, recipes_dir
from tests.conftest import REPO, write_recipe

MINIMAL = "model: {name_or_path: builtin:tiny-llama}\ndata: {train: builtin:greetings}\n"


def error_of(tmp_path, text: str, *overrides: str) -> str:
    path = write_recipe(tmp_path, text)
    with pytest.raises(UserError) as caught:
        load_recipe(path, list(overrides))
    return str(caught.value)


@pytest.mark.parametrize("path", sorted(REPO.joinpath("configs").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_loads(path):
    recipe = load_recipe(path)
    assert recipe.model.name_or_path and recipe.data.train
    assert recipe.train["max_length"] > 0
    assert recipe_from_dict(recipe.to_dict()).to_dict() == recipe.to_dict()  # what a checkpoint saves reloads


@pytest.mark.parametrize("path", sorted(REPO.joinpath("accelerate_configs").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_accelerate_config_loads_in_accelerate(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert config.num_processes >= 1
    assert config.compute_environment.value == "LOCAL_MACHINE"


def test_shipped_accelerate_configs_say_what_they_promise():
    configs = {p.stem: yaml.safe_load(p.read_text()) for p in accelerate_configs_dir().glob("*.yaml")}
    assert configs["ddp_8gpu"]["num_processes"] == 8 and configs["ddp_8gpu"]["mixed_precision"] == "bf16"
    assert configs["ddp_8gpu"]["distributed_type"] == "MULTI_GPU"
    assert configs["cpu_ddp_2proc"]["num_processes"] == 2
    assert configs["single_gpu"]["num_processes"] == 1


def test_shipped_recipe_found_by_name():
    assert find_recipe("quickstart") == recipes_dir() / "quickstart.yaml"
    assert find_recipe("llama-3.2-3b-lora") == recipes_dir() / "llama-3.2-3b-lora.yaml"  # dots in the name
    with pytest.raises(UserError, match="no shipped recipe of that name.*quickstart"):
        find_recipe("quickstrat")


def test_defaults_and_overrides(tmp_path):
    path = write_recipe(tmp_path, MINIMAL)
    recipe = load_recipe(path, ["train.learning_rate=1e-4", "lora.r=8", "train.save_strategy=no", "method=qlora"])
    assert recipe.train["learning_rate"] == 1e-4  # YAML reads 1e-4 as text; the field says float
    assert recipe.lora.r == 8 and recipe.method == "qlora"
    assert recipe.train["save_strategy"] == "no"  # YAML reads a bare no as false
    assert load_recipe(path, ["data.thinking_marker=####"]).data.thinking_marker == "####"  # not a YAML comment
    assert load_recipe(path, ["data.system_prompt=null"]).data.system_prompt is None
    assert recipe.train["packing"] is True and recipe.data.loss_on == "assistant"
    assert recipe.output_dir == "runs/recipe"
    assert load_recipe(path).train["learning_rate"] == 2e-4  # LoRA's default, not SFTConfig's 2e-5
    assert load_recipe(path, ["method=full"]).train["learning_rate"] == 2e-5


def test_unknown_key_in_file_names_file_key_and_closest(tmp_path):
    message = error_of(tmp_path, MINIMAL + "lora: {rank: 8}\n")
    assert "recipe.yaml" in message and "'lora.rank'" in message and "did you mean 'lora.r'" in message


def test_unknown_train_key_suggests_sftconfig_field(tmp_path):
    message = error_of(tmp_path, MINIMAL, "train.learning_rat=1e-4")
    assert "override 'train.learning_rat=1e-4'" in message and "did you mean 'train.learning_rate'" in message


def test_misplaced_key_suggests_its_section(tmp_path):
    assert "did you mean 'train.learning_rate'" in error_of(tmp_path, MINIMAL + "learning_rate: 1.0e-4\n")


def test_wrong_type_names_field_and_allowed(tmp_path):
    message = error_of(tmp_path, MINIMAL, "train.num_train_epochs=many")
    assert "train.num_train_epochs must be a number" in message and "'many'" in message
    assert "lora.r must be a whole number" in error_of(tmp_path, MINIMAL + "lora: {r: eight}\n")


def test_wrong_value_lists_choices(tmp_path):
    message = error_of(tmp_path, MINIMAL, "train.lr_scheduler_type=cosin")
    assert "train.lr_scheduler_type must be one of" in message and "cosine" in message
    assert "must be one of lora, qlora, full" in error_of(tmp_path, MINIMAL, "method=qlora4")
    assert "data.loss_on must be one of assistant, all" in error_of(tmp_path, MINIMAL, "data.loss_on=prompt")


def test_contradictions_are_explained(tmp_path):
    assert "method is full" in error_of(tmp_path, MINIMAL + "method: full\nlora: {r: 8}\n")
    message = error_of(tmp_path, MINIMAL, "data.eval=b.jsonl", "data.eval_fraction=0.1")
    assert "data.eval and data.eval_fraction" in message
    assert "train.bf16 and train.fp16" in error_of(tmp_path, MINIMAL, "train.bf16=true", "train.fp16=true")
    assert "train.eval_strategy needs eval data" in error_of(tmp_path, MINIMAL, "train.eval_strategy=steps")
    assert load_recipe(write_recipe(tmp_path, MINIMAL), ["train.eval_strategy=steps", "data.eval_fraction=0.1"])


def test_keys_owned_elsewhere_point_to_their_home(tmp_path):
    assert "data.loss_on" in error_of(tmp_path, MINIMAL, "train.assistant_only_loss=true")
    assert "top-level output_dir" in error_of(tmp_path, MINIMAL, "train.output_dir=x")
    assert "model.chat_template" in error_of(tmp_path, MINIMAL, "train.chat_template_path=x.jinja")


def test_logging_backends_checked(tmp_path):
    assert "not a logging back-end" in error_of(tmp_path, MINIMAL, "train.report_to=tensorbored")
    assert load_recipe(write_recipe(tmp_path, MINIMAL), ["train.report_to=tensorboard"]).train["report_to"]


def test_malformed_inputs(tmp_path):
    assert "not valid YAML" in error_of(tmp_path, "model: [unclosed\n")
    assert "model.name_or_path is required" in error_of(tmp_path, "data: {train: x.jsonl}\n")
    assert "write overrides as key.sub=value" in error_of(tmp_path, MINIMAL, "train.learning_rate")
    assert "is a value, not a section" in error_of(tmp_path, MINIMAL + "method: lora\n", "method.x=1")
    assert "override 'method.x=1': method must be one of" in error_of(tmp_path, MINIMAL, "method.x=1")
    assert "data.template_date must be a date" in error_of(tmp_path, MINIMAL, "data.template_date=yesterday")


def test_overrides_of_text_settings_are_taken_as_written(tmp_path):
    path = write_recipe(tmp_path, MINIMAL)
    for text in ("Reply in C# only #strict", "yes", "Answer: briefly", "[not a list]", "0.5"):
        assert load_recipe(path, [f"data.system_prompt={text}"]).data.system_prompt == text
    assert load_recipe(path, ["data.system_prompt=null"]).data.system_prompt is None
    # settings that are not text are still read as YAML
    recipe = load_recipe(path, ["lora.r=8", "train.num_train_epochs=2", "data.columns={instruction: q}"])
    assert recipe.lora.r == 8 and recipe.train["num_train_epochs"] == 2 and recipe.data.columns == {"instruction": "q"}


def test_yaml_merge_keys_load_and_keys_beside_them_win(tmp_path):
    text = MINIMAL + ("x-common: &common {learning_rate: 1.0e-3, max_length: 64, logging_steps: 5}\n"
                      "train: {<<: *common, logging_steps: 1}\n")
    recipe = load_recipe(write_recipe(tmp_path, text))
    assert recipe.train["learning_rate"] == 1e-3 and recipe.train["max_length"] == 64
    assert recipe.train["logging_steps"] == 1


def test_every_unknown_key_is_reported_at_once(tmp_path):
    message = error_of(tmp_path, "model: {name_or_path: builtin:tiny-llama, revison: main}\n"
                                 "data: {train: builtin:greetings, eval_fractoin: 0.1}\nlora: {rnak: 8}\n"
                                 "train: {learning_rat: 0.1}\n")
    assert message.startswith("4 unknown keys")
    for key, closest in (("model.revison", "model.revision"), ("data.eval_fractoin", "data.eval_fraction"),
                         ("lora.rnak", "lora.r"), ("train.learning_rat", "train.learning_rate")):
        assert f"'{key}'; did you mean '{closest}'?" in message, message
