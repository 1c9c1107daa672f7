"""The families people fine-tune besides Llama and GPT-OSS, each proven on the toolkit's paths: Qwen 2.5 and 3 (the
real Qwen tokenizer), Gemma 2 and 3, Mistral and Phi-3 (Llama 3.2's vocabulary with the family's turn tokens as a
stand-in: their real tokenizers are not in the shared assets), each with its official chat template as TRL ships it,
and tiny random-initialized models of their architectures (finetune/models/architectures.py)."""

from __future__ import annotations

import pytest

from finetune.data.formats import BadRow
from finetune.data.render import Renderer, training_template
from tests.conftest import family_tokenizer, trained_spans

FAMILIES = ["qwen2.5", "qwen3", "gemma2", "gemma3", "mistral", "phi3"]
DATE = "2026-01-01"

TALK = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5."},
        {"role": "user", "content": "And doubled?"}, {"role": "assistant", "content": "10."}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
TOOL_TALK = [{"role": "user", "content": "Add 2 and 3."},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
             {"role": "tool", "name": "add", "content": "5"},
             {"role": "assistant", "content": "It is 5."}]


def spans(renderer: Renderer, messages: list[dict], tools: list | None = None) -> tuple[list[int], list[str]]:
    ids, labels = renderer.encode({"messages": messages, **({"tools": tools} if tools else {})})
    return ids, trained_spans(renderer.tokenizer, ids, labels)


@pytest.mark.parametrize("family", FAMILIES)
def test_assistant_masks_match_the_official_templates_marked_variant(family):
    """Our masks from the official template's prefixes equal those of TRL's variant with {% generation %} markers
    (which the pipeline renders with where TRL has one): each answer and its end-of-turn token, nothing else."""
    tokenizer = family_tokenizer(family)
    official = tokenizer.chat_template
    marked = training_template(tokenizer, official)
    assert (marked != official) == (family != "mistral")  # TRL marks every family here but Mistral's stand-in
    end = {"qwen2.5": "<|im_end|>", "qwen3": "<|im_end|>", "gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>",
           "phi3": "<|end|>", "mistral": "<|eot_id|>"}[family]
    cases = [(TALK, None)] + ([(TOOL_TALK, TOOLS)] if family.startswith("qwen") else [])
    for messages, tools in cases:
        by_markers = spans(Renderer(tokenizer, marked, DATE), messages, tools)
        if family in ("qwen3", "phi3"):  # not prefix-stable: Qwen 3 drops earlier reasoning (below), Phi-3 ends
            with pytest.raises(BadRow, match="renders the conversation"):  # with an end of text its prefixes lack
                Renderer(tokenizer, official, DATE).encode({"messages": messages, "tools": tools})
        else:
            assert spans(Renderer(tokenizer, official, DATE), messages, tools) == by_markers
        ids, trained = by_markers
        assert tokenizer.decode(ids) == Renderer(tokenizer, official, DATE).render_text(  # as the model sees it
            {"messages": messages, "tools": tools})
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        answers = [m["content"] for i, m in enumerate(messages) if m["role"] == "assistant"
                   and (family != "qwen3" or i > last_user)]  # Qwen 3's earlier answers are context (test below)
        if family == "phi3":  # the end of text after the last turn is in its generation block
            trained[-1] = trained[-1].removesuffix("\n" + tokenizer.eos_token)
        assert len(trained) == len(answers) and all(span.endswith(end) for span in trained), trained
        # Qwen 3 writes an empty reasoning block before an answer given without reasoning, as it generates one
        assert trained[-1].removeprefix("<think>\n\n</think>\n\n").removesuffix(end).strip() == answers[-1]


def test_qwen3_trains_the_last_turns_reasoning_while_its_template_drops_earlier_turns():
    """Qwen 3's template renders an earlier turn's reasoning only while that turn is the last: its renderings of a
    growing conversation are not prefixes of each other, so masks come from TRL's marked variant; the last turn's
    reasoning is trained, and an earlier one's is not there to train."""
    tokenizer = family_tokenizer("qwen3")
    talk = [TALK[0], {**TALK[1], "thinking": "Two plus three."}, TALK[2], {**TALK[3], "thinking": "Five twice."}]
    with pytest.raises(BadRow, match="renders the conversation"):
        Renderer(tokenizer, tokenizer.chat_template, DATE).encode({"messages": talk})
    renderer = Renderer(tokenizer, training_template(tokenizer, tokenizer.chat_template), DATE)
    ids, trained = spans(renderer, talk)
    assert tokenizer.decode(ids) == Renderer(tokenizer, tokenizer.chat_template, DATE).render_text({"messages": talk})
    assert "Two plus three." not in tokenizer.decode(ids)
    assert trained == ["<think>\nFive twice.\n</think>\n\n10.<|im_end|>"]  # the earlier answer is context
    _, without = spans(Renderer(tokenizer, renderer.template, DATE, train_thinking=False), talk)
    assert without == ["</think>\n\n10.<|im_end|>"]  # the reasoning is context; closing it is the answer's start
