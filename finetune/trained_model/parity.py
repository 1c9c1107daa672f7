"""`finetune export --check TARGET`: every place the model's chat template lives renders the prompts training did.

The reference is training's renderer: the recipe's tokenizer and template, with the recipe's system prompt put
first as training rows have it. Compared with it, on the same conversations (gguf.CONVERSATIONS, and one with
tools where the template has them), token for token:

    finetune chat       the target's saved tokenizer and template, as chat renders a conversation
    finetune serve      the same, from an OpenAI request's messages through the server's parsing
    vLLM template file  the file `serve --engine vllm` writes, rendered by transformers as vLLM does
    GGUF                each GGUF model in the target: its embedded template through llama-cpp-python's
                        formatter, tokenized by llama.cpp as its chat completion does
    Modelfile           the Ollama template, rendered by ollama.render_go (its SYSTEM put first, as Ollama
                        does), compared as text
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from finetune.data import formats
from finetune.errors import UserError
from finetune.trained_model import gguf, ollama, saved_model


@dataclass
class Place:
    name: str
    compared: int = 0
    differences: list[str] = field(default_factory=list)  # each with the conversation where it appears
    skipped: str | None = None  # why this place was not compared (absent from the target)


def check(target) -> list[Place]:
    from finetune.data.render import Renderer
    from finetune.models.loading import load_tokenizer
    from finetune.trained_model.chat import prompt, renderer_of

    folder = saved_model.locate(target)
    data = folder.recipe.data
    tokenizer = load_tokenizer(folder.recipe)
    training = Renderer(tokenizer, tokenizer.chat_template, data.template_date, data.loss_on, data.train_thinking,
                        data.template_kwargs)
    if training.template is None:
        raise UserError(f"{target}: the model has no chat template, so there is no template to compare")
    cases = gguf.conversations(training.template)
    expected = [_rendered(lambda: training.prompt_ids(formats.with_system_prompt(messages, data.system_prompt), tools))
                for messages, tools in cases]
    saved = saved_model.load_tokenizer(folder)
    renderer = renderer_of(folder, saved)

    def chatted(messages, tools):
        return prompt(renderer, data.system_prompt, messages, tools)

    def served(messages, tools):
        request = formats.prompt(messages, tools)
        return prompt(renderer, data.system_prompt, request["messages"], request["tools"])

    vllm = _vllm(folder, saved)
    places = [_compare(name, cases, expected, [_rendered(lambda: render(messages, tools)) for messages, tools in cases])
              for name, render in (("finetune chat", chatted), ("finetune serve", served), ("vLLM template file", vllm))]
    models = sorted(folder.path.glob("model-*.gguf"))
    places += [_compare(f"GGUF {model.name}", cases, expected, gguf.formatted(model, cases, training.template_kwargs))
               for model in models] or [
        Place("GGUF", skipped="no GGUF model in the target" + (" (an adapter GGUF holds no template: its base GGUF "
                                                                 "does)" if any(folder.path.glob("adapter-*.gguf"))
                                                                else ""))]
    places.append(_compare_modelfile(folder.path / "Modelfile", cases, training, saved, data.system_prompt))
    return places


def _rendered(render):
    """The rendering, or why the template refused it (a template may refuse a system turn: Gemma 2's)."""
    try:
        return render()
    except (formats.BadRow, UserError) as error:
        return f"refused: {error}"


def _compare(name: str, cases, expected, prompts) -> Place:
    """`prompts`: what the place renders for each case (token ids, or why it could not)."""
    place = Place(name, compared=len(cases))
    for (messages, tools), reference, got in zip(cases, expected, prompts):
        if got != reference:
            place.differences.append(_difference(messages, tools, reference, got))
    return place


def _difference(messages, tools, reference, got) -> str:
    said = f"{messages[-1]['content']!r}" + (" with tools" if tools else "")
    if isinstance(reference, str) or isinstance(got, str):
        return f"{said}: training {reference if isinstance(reference, str) else 'renders it'}, here " \
               f"{got if isinstance(got, str) else 'it renders'}"
    at = next((i for i, (a, b) in enumerate(zip(reference, got)) if a != b), min(len(reference), len(got)))
    return f"{said}: the prompts part at token {at} of {len(reference)} (training) and {len(got)} (here)"


def _vllm(folder: saved_model.SavedModel, tokenizer):
    from finetune.trained_model.served_models import parse_targets
    from finetune.trained_model.vllm_engine import vllm_command

    with tempfile.TemporaryDirectory() as scratch:
        template_file = Path(scratch) / "chat_template.jinja"
        vllm_command(parse_targets([str(folder.path)]), "127.0.0.1", 8000, template_file)
        template = template_file.read_text(encoding="utf-8")
    variables = folder.recipe.data.template_kwargs or {}

    def render(messages, tools):
        request = formats.prompt(messages, tools)  # vLLM passes messages as OpenAI's, through the same template
        text = tokenizer.apply_chat_template(request["messages"], tools=request["tools"], chat_template=template,
                                             add_generation_prompt=True, tokenize=False, **variables)
        return tokenizer(text, add_special_tokens=False)["input_ids"]  # vLLM's chat default

    return render


def _compare_modelfile(path: Path, cases, training, tokenizer, system_prompt: str | None) -> Place:
    place = Place("Modelfile")
    if not path.is_file():
        place.skipped = "no Modelfile in the target"
        return place
    text = path.read_text(encoding="utf-8")
    template = re.search(r'^TEMPLATE """(.*?)"""', text, re.S | re.M)
    system = re.search(r'^SYSTEM """(.*?)"""', text, re.S | re.M)
    added_bos = tokenizer.bos_token if gguf.adds_bos(tokenizer) else ""
    for messages, tools in cases:
        if tools:
            continue  # the Modelfile's template carries no tools (docs/chat-and-export.md)
        try:
            reference = training.render_text({"messages": formats.with_system_prompt(messages, system_prompt)},
                                             add_generation_prompt=True)
        except formats.BadRow:
            continue  # a conversation the training template refuses (the Modelfile was refused for such templates)
        place.compared += 1
        got = ollama.render_go(template.group(1), formats.with_system_prompt(messages, system and system.group(1)))
        if got != reference.removeprefix(added_bos):
            place.differences.append(f"{messages[-1]['content']!r}: training renders {reference!r}, the Modelfile "
                                     f"{got!r}")
    return place


def table(places: list[Place]) -> str:
    rows = ["| place | identical |", "|---|---|"]
    for place in places:
        rows.append(f"| {place.name} | " + (place.skipped if place.skipped else
                                             f"{place.compared - len(place.differences)} of {place.compared}") + " |")
    lines = [f"- {place.name}: {difference}" for place in places for difference in place.differences]
    return "\n".join(rows + ([""] + lines if lines else []))
