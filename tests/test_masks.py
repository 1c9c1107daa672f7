"""Exact loss masks: the tokens that carry loss decode to exactly the assistant turns and their end-of-turn token.

Checked with the toolkit's own tokenizer and, when ../shared/assets is present, with the real Llama 3.2 Instruct
and GPT-OSS tokenizers (Llama's official template has no generation markers: masks come from its prefixes).
"""

from __future__ import annotations

import pytest

from finetune.data import formats, sources
from finetune.data.formats import BadRow, normalize
from finetune.data.render import Renderer, training_template
from tests.conftest import asset, trained_spans

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
MULTI_TURN = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "name": "get_weather", "content": "18C"},
        {"role": "assistant", "content": "18C and sunny.", "thinking": "The tool said 18C."},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Current weather.",
                                                "parameters": {"type": "object"}}}],
}
ROWS = {  # one multi-turn row per format, in the format's own shape
    "messages": MULTI_TURN,
    "sharegpt": {"conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there"},
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": "18C"}, {"from": "gpt", "value": "18C and sunny."}],
        "tools": '[{"name": "get_weather", "description": "Current weather.", "parameters": {"type": "object"}}]'},
    "alpaca": {"instruction": "Add.", "input": "2 and 3", "output": "5"},
    "prompt_completion": {
        "prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
                   {"role": "user", "content": "Say bye"}],
        "completion": [{"role": "assistant", "content": "Goodbye"}]},
}


def spans(tokenizer, row, fmt, loss_on="assistant", template=None):
    renderer = Renderer(tokenizer, template or training_template(tokenizer, tokenizer.chat_template), "2024-07-26",
                        loss_on)
    ids, labels = renderer.encode(normalize(row, fmt, {}, None))
    return trained_spans(tokenizer, ids, labels)


BUILTIN_EXPECTED = {
    "messages": ["Hello there<|im_end|>",
                 '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>',
                 "<think>The tool said 18C.</think>\n18C and sunny.<|im_end|>"],
    "sharegpt": ["Hello there<|im_end|>",
                 '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>',
                 "18C and sunny.<|im_end|>"],
    "alpaca": ["5<|im_end|>"],
    "prompt_completion": ["Goodbye<|im_end|>"],
}
LLAMA_TOOL_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
LLAMA_EXPECTED = {
    "messages": ["Hello there<|eot_id|>", LLAMA_TOOL_CALL, "18C and sunny.<|eot_id|>"],  # no thinking in Llama
    "sharegpt": ["Hello there<|eot_id|>", LLAMA_TOOL_CALL, "18C and sunny.<|eot_id|>"],
    "alpaca": ["5<|eot_id|>"],
    "prompt_completion": ["Goodbye<|eot_id|>"],
}
GPTOSS_CALL = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
GPTOSS_EXPECTED = {
    "messages": ["<|channel|>final<|message|>Hello there<|end|>", GPTOSS_CALL,
                 "<|channel|>analysis<|message|>The tool said 18C.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>18C and sunny.<|return|>"],
    "sharegpt": ["<|channel|>final<|message|>Hello there<|end|>", GPTOSS_CALL,
                 "<|channel|>final<|message|>18C and sunny.<|return|>"],
    "alpaca": ["<|channel|>final<|message|>5<|return|>"],
    "prompt_completion": ["<|channel|>final<|message|>Goodbye<|return|>"],
}


@pytest.mark.parametrize("fmt", ROWS)
def test_builtin_tokenizer_masks(builtin_tokenizer, fmt):
    assert spans(builtin_tokenizer, ROWS[fmt], fmt) == BUILTIN_EXPECTED[fmt]


@pytest.mark.parametrize("fmt", ROWS)
def test_llama_3_2_masks(llama_tokenizer, fmt):
    assert spans(llama_tokenizer, ROWS[fmt], fmt) == LLAMA_EXPECTED[fmt]


@pytest.mark.parametrize("fmt", ROWS)
def test_gpt_oss_masks(gptoss_tokenizer, fmt):
    assert spans(gptoss_tokenizer, ROWS[fmt], fmt) == GPTOSS_EXPECTED[fmt]


def test_text_formats(builtin_tokenizer, llama_tokenizer):
    for tokenizer in (builtin_tokenizer, llama_tokenizer):
        eos = tokenizer.eos_token
        assert spans(tokenizer, {"prompt": "Q: 2+2=", "completion": " 4"}, "prompt_completion") == [f" 4{eos}"]
        text = spans(tokenizer, {"text": "Once upon a time."}, "text")
        assert len(text) == 1 and text[0].endswith(f"Once upon a time.{eos}")


def test_loss_on_all_trains_every_token(builtin_tokenizer):
    renderer = Renderer(builtin_tokenizer, builtin_tokenizer.chat_template, "2024-07-26", "all")
    ids, labels = renderer.encode(normalize(MULTI_TURN, "messages", {}, None))
    assert labels == ids


def test_template_date_is_fixed(llama_tokenizer):
    renderer = Renderer(llama_tokenizer, llama_tokenizer.chat_template, "2024-07-26")
    assert "Today Date: 26 Jul 2024" in renderer.render_text(normalize(ROWS["alpaca"], "alpaca", {}, None))


def test_chat_template_from_a_file(tmp_path):
    from finetune.errors import UserError
    from finetune.models.loading import load_tokenizer
    from finetune.recipe.schema import load_recipe

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text("model: {name_or_path: builtin:tiny-llama}\ndata: {train: builtin:greetings}\n")
    tokenizer = load_tokenizer(load_recipe(recipe_file, [f"model.chat_template={template}"]))
    assert spans(tokenizer, ROWS["alpaca"], "alpaca") == ["5<|im_end|>"]
    assert Renderer(tokenizer, tokenizer.chat_template, "2024-07-26").render_text(
        normalize(ROWS["alpaca"], "alpaca", {}, None)) == "[user] Add.\n\n2 and 3<|im_end|>\n[assistant] 5<|im_end|>\n"
    with pytest.raises(UserError, match="model.chat_template: .*missing.jinja does not exist"):
        load_tokenizer(load_recipe(recipe_file, [f"model.chat_template={tmp_path / 'missing.jinja'}"]))


def test_a_llama_tokenizer_decodes_its_text_without_transformers_warning(tmp_path, capfd):
    """Llama 3.2's tokenizer_config asks for clean_up_tokenization_spaces, which transformers ignores for a BPE
    tokenizer and warns about at a process's first decode: `finetune chat`, `serve` and `eval` printed it. Loaded
    for a recipe or from a saved model, the tokenizer decodes the same text, and nothing is printed."""
    from transformers.utils import logging

    from finetune.models.loading import load_tokenizer
    from finetune.recipe.schema import load_recipe
    from finetune.trained_model.saved_model import SavedModel
    from finetune.trained_model.saved_model import load_tokenizer as load_saved_tokenizer

    folder = asset("tokenizers/llama-3.2-instruct")
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(f"model: {{name_or_path: {folder}}}\ndata: {{train: builtin:greetings}}\n")
    recipe = load_recipe(recipe_file)
    for tokenizer in (load_tokenizer(recipe), load_saved_tokenizer(SavedModel(folder, recipe, is_adapter=False))):
        logging.warning_once.cache_clear()  # a warning said before in this process would be said again
        ids = tokenizer("Hello , world !")["input_ids"]
        assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello , world !"
        assert "clean_up_tokenization_spaces" not in capfd.readouterr().err


def test_turn_tokens_that_swallow_the_newline_after_them_still_mask_exactly():
    """Phi-3's tokenizer strips the whitespace after its turn tokens (rstrip): "<|end|>\\n<|user|>" is two tokens,
    not three. A stand-in with that property (Llama 3.2's vocabulary, Phi-3's turn tokens and official template)
    trains each answer through its <|end|>, and the last through the end of text, as TRL's marked variant says."""
    from importlib.resources import files

    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(asset("tokenizers/llama-3.2-instruct"))
    turns = [AddedToken(token, rstrip=True, special=True, normalized=False)
             for token in ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")]
    tokenizer.add_special_tokens({"additional_special_tokens": [*turns, "<|endoftext|>"], "eos_token": "<|endoftext|>"})
    tokenizer.chat_template = (files("trl") / "chat_templates" / "phi3.jinja").read_text()
    talk = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "Say bye"},
            {"role": "assistant", "content": "Goodbye"}]
    renderer = Renderer(tokenizer, training_template(tokenizer, tokenizer.chat_template), "2024-07-26")
    ids, labels = renderer.encode({"messages": talk})
    assert tokenizer.convert_ids_to_tokens(ids[4:6]) == ["<|end|>", "<|user|>"]  # the newline between: swallowed
    assert trained_spans(tokenizer, ids, labels) == ["Hello there<|end|>", "Goodbye<|end|><|endoftext|>"]


def test_template_without_stable_prefixes_is_a_bad_row(gptoss_tokenizer):
    """GPT-OSS's official template drops earlier turns' reasoning: without markers no exact mask exists."""
    with pytest.raises(BadRow, match="renders the conversation through this turn differently"):
        spans(gptoss_tokenizer, MULTI_TURN, "messages", template=gptoss_tokenizer.chat_template)


THINKING = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "thinking": "Two and two."},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6", "thinking": "Three and three."},
]}


@pytest.mark.parametrize("train_thinking", [True, False])
def test_harmony_multi_turn_with_thinking(gptoss_tokenizer, train_thinking):
    """GPT-OSS keeps only the last turn's reasoning (analysis channel); earlier turns end in <|end|>, the last in
    <|return|>. Without train_thinking the last turn is trained exactly as if it had no reasoning."""
    renderer = Renderer(gptoss_tokenizer, training_template(gptoss_tokenizer, gptoss_tokenizer.chat_template),
                        "2024-07-26", train_thinking=train_thinking, template_kwargs={"reasoning_effort": "high"})
    example = normalize(THINKING, "messages", {}, None)
    ids, labels = renderer.encode(example)
    last = "<|channel|>final<|message|>6<|return|>"
    if train_thinking:
        last = "<|channel|>analysis<|message|>Three and three.<|end|><|start|>assistant" + last
    assert trained_spans(gptoss_tokenizer, ids, labels) == ["<|channel|>final<|message|>4<|end|>", last]
    text = renderer.render_text(example)
    assert "Reasoning: high" in text and "Two and two." not in text  # earlier reasoning is dropped by the template


@pytest.mark.parametrize("train_thinking", [True, False])
def test_thinking_in_other_templates(builtin_tokenizer, train_thinking):
    renderer = Renderer(builtin_tokenizer, builtin_tokenizer.chat_template, "2024-07-26", train_thinking=train_thinking)
    ids, labels = renderer.encode(normalize(THINKING, "messages", {}, None))
    think = "<think>{}</think>\n" if train_thinking else ""
    assert trained_spans(builtin_tokenizer, ids, labels) == [
        think.format("Two and two.") + "4<|im_end|>", think.format("Three and three.") + "6<|im_end|>"]


def test_gsm8k_rationale_as_harmony_analysis(gptoss_tokenizer):
    """GSM8K answers are 'rationale #### number': the rationale becomes the analysis channel, the number the answer."""
    renderer = Renderer(gptoss_tokenizer, training_template(gptoss_tokenizer, gptoss_tokenizer.chat_template),
                        "2024-07-26")
    columns = {"instruction": "question", "output": "answer"}
    checked = 0
    for _, row in sources.resolve(str(asset("datasets/gsm8k/train.jsonl")), "data.train").rows():
        rationale, number = (part.strip() for part in row["answer"].rsplit("####", 1))
        ids, labels = renderer.encode(normalize(row, "alpaca", columns, None, thinking_marker="####"))
        assert trained_spans(gptoss_tokenizer, ids, labels) == [
            f"<|channel|>analysis<|message|>{rationale}<|end|>"
            f"<|start|>assistant<|channel|>final<|message|>{number}<|return|>"]
        checked += 1
        if checked == 200:
            break


DATASETS = {
    "gsm8k/train.jsonl": {"instruction": "question", "output": "answer"},
    "self-instruct/user_oriented_instructions.jsonl": {"input": "instances.0.input", "output": "instances.0.output"},
    "sharegpt-fastchat/dummy_conversation.json": {},
    "glaive-toolcall/glaive_toolcall_en_demo.json": {},
}


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("which", ["llama", "gptoss"])
def test_real_datasets_real_templates(dataset, which, request):
    """On real rows, every assistant turn is trained exactly: its text and its end token, nothing else."""
    tokenizer = request.getfixturevalue(f"{which}_tokenizer")
    renderer = Renderer(tokenizer, training_template(tokenizer, tokenizer.chat_template), "2024-07-26")
    checked = 0
    for _, row in sources.resolve(str(asset(f"datasets/{dataset}")), "data.train").rows():
        columns = DATASETS[dataset]
        example = normalize(row, formats.detect_format(row, columns), columns, None)
        ids, labels = renderer.encode(example)
        answers = [m for m in example["messages"] if m["role"] == "assistant"]
        got = trained_spans(tokenizer, ids, labels)
        assert len(got) == len(answers)
        for index, (span, message) in enumerate(zip(got, answers)):
            last = index == len(answers) - 1
            if message.get("tool_calls"):
                assert message["tool_calls"][0]["function"]["name"] in span
                assert span.endswith("<|eot_id|>" if which == "llama" else "<|call|>")
            elif which == "llama":
                assert span == message["content"].strip() + "<|eot_id|>"  # the template trims content
            else:
                end = "<|return|>" if last else "<|end|>"
                assert span == f"<|channel|>final<|message|>{message['content']}{end}"
        checked += 1
        if checked == 150:
            break
    assert checked > 0
