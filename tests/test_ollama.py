"""The Ollama Modelfile's template, derived from each family's real chat template and rendered back by the Go
template subset it uses (no Ollama binary here), against the training renderer."""

from __future__ import annotations

import pytest

from finetune.data.render import Renderer
from finetune.trained_model import ollama

FAMILIES = ["qwen2.5", "qwen3", "gemma2", "gemma3", "mistral", "phi3", "llama3.2", "gpt-oss"]
LONGER = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Salut !"}, {"role": "user", "content": "And the sea?"},
          {"role": "assistant", "content": "La mer."}, {"role": "user", "content": "Two\n\nlines, 🙂"}]
# Templates that strip each message's surrounding whitespace (Mistral's stand-in is Llama 3.2's template)
TRIMMING = {"gemma3", "llama3.2", "mistral"}


def test_the_go_subset_renders_as_go_does():
    """Go's text/template: variables assigned in a range keep their value across iterations; an `else if` chain
    takes its first true branch; no trim markers, so literals keep their whitespace."""
    template = ('{{ $prev := "" }}{{ range .Messages }}[{{ if eq $prev "" }}first '
                '{{ else if and (eq .Role "user") (eq $prev "assistant") }}again {{ else }}other {{ end }}'
                '{{ .Role }}={{ .Content }}]\n{{ $prev = .Role }}{{ end }}end')
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    with pytest.raises(ValueError, match="not in the subset: .Role"):
        ollama.render_go(template, messages)
    template = template.replace("{{ .Role }}=", "")
    assert ollama.render_go(template, messages) == "[first s]\n[other u]\n[other a]\n[again v]\nend"
    assert ollama.render_go(template, []) == "end"


def family_renderer(family: str):
    from transformers import AutoTokenizer

    from tests.conftest import asset, family_tokenizer

    if family in ("llama3.2", "gpt-oss"):
        folder = "llama-3.2-instruct" if family == "llama3.2" else family
        tokenizer = AutoTokenizer.from_pretrained(asset(f"tokenizers/{folder}"))
    else:
        tokenizer = family_tokenizer(family)
    return tokenizer, Renderer(tokenizer, tokenizer.chat_template, "2026-01-01")


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_template_becomes_an_ollama_template_that_renders_the_training_prompt(family):
    tokenizer, renderer = family_renderer(family)

    def render(messages):
        return renderer.render_text({"messages": messages}, add_generation_prompt=True)

    bos = tokenizer.bos_token if tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id] else ""
    if family == "gemma2":  # its template raises on a system message, which an Ollama chat can send
        with pytest.raises(ollama.Inexpressible, match="System role not supported"):
            ollama.modelfile("model.gguf", render, ["<end_of_turn>"], None, 2048, bos)
        return
    text = ollama.modelfile("model.gguf", render, ["<x>", 'say "hi"'], "Be brief.", 2048, bos)
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert lines[0] == "FROM ./model.gguf" and lines[-4:] == [
        'PARAMETER stop "<x>"', 'PARAMETER stop "say \\"hi\\""', "PARAMETER num_ctx 2048", 'SYSTEM """Be brief."""']
    template = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    assert ollama.render_go(template, LONGER) == render(LONGER).removeprefix(bos)  # a conversation not checked
    assert text.startswith("# The training template trims") == (family in TRIMMING)


def test_a_template_that_depends_on_more_than_roles_gets_no_modelfile():
    numbered = "{% for m in messages %}{{ loop.index }}. {{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"

    def render(messages):
        from jinja2 import Template

        return Template(numbered).render(messages=messages)

    with pytest.raises(ollama.Inexpressible, match="depends on more than their roles"):
        ollama.modelfile("model.gguf", render, [], None, 512)
