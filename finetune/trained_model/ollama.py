"""An Ollama Modelfile for a GGUF export, its TEMPLATE derived from the run's own chat template.

The training template is rendered around marker texts to find what it writes between two messages. Where that
depends only on the two roles (ChatML, Llama 3, Gemma, Phi-3 and Mistral templates do), Ollama's Go template can
say it: one literal per transition (start → system, start → user, system → user, user → assistant, assistant →
user) and the generation prompt after the last message. The derived template is rendered back, by a renderer of
exactly the Go template subset it uses, on test conversations and compared with the training renderer; a template
it cannot express gets no Modelfile, and the export says why (the conversation where they part).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jinja2 import TemplateError

from finetune.data.formats import BadRow


class Inexpressible(Exception):
    """The training template cannot be written as an Ollama template; the message says why."""

MARKERS = {"system": "qzqSYSTEMqzq", "user": "qzqUSERqzq", "user2": "qzqAGAINqzq", "assistant": "qzqANSWERqzq"}
CHECKED = [
    [{"role": "user", "content": "Hello there!"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is the sea?"}],
    [{"role": "user", "content": "I am Ann."}, {"role": "assistant", "content": "Nice to meet you, Ann!"},
     {"role": "user", "content": "Shout ahoy."}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Écris « bonjour » 🙂"}],
]


@dataclass
class Transitions:
    start_system: str
    start_user: str
    system_user: str
    user_assistant: str
    assistant_user: str
    tail: str  # after the last (user) message: its end and the generation prompt


def modelfile(gguf_file: str, render, end_tokens: list[str], system_prompt: str | None, context: int,
              added_bos: str = "") -> str:
    """The Modelfile text; `render(messages)` is the training renderer's text with the generation prompt.
    `added_bos`: the BOS text the runtime puts before every prompt itself (the tokenizer adds it), which the
    template must then not write again."""
    def prompt(messages: list[dict]) -> str:
        try:
            text = render(messages)
        except (TemplateError, BadRow, ValueError) as error:  # Gemma 2's: "System role not supported"
            raise Inexpressible(f"the chat template refuses a conversation an Ollama chat can send "
                                f"({[m['role'] for m in messages]}): {error}") from None
        return text.removeprefix(added_bos) if added_bos else text

    template = go_template(derive(prompt))
    for messages in CHECKED:
        expected, got = prompt(messages), render_go(template, messages)
        if got != expected:
            raise Inexpressible(f"what the chat template writes between messages depends on more than their "
                                f"roles: for {messages[-1]['content']!r} it renders {expected!r}, the Ollama "
                                f"template {got!r}")
    lines = [f"FROM ./{gguf_file}", f'TEMPLATE """{template}"""']
    if trims(prompt):
        lines.insert(0, "# The training template trims each message's leading and trailing whitespace, which an Ollama "
                        "template cannot:\n# messages without it get the training prompt exactly.")
    lines += [f"PARAMETER stop {_quoted(token)}" for token in end_tokens]
    lines.append(f"PARAMETER num_ctx {context}")
    if system_prompt:
        lines.append(f'SYSTEM """{system_prompt}"""')
    return "\n".join(lines) + "\n"


def derive(render) -> Transitions:
    user, again, system, answer = (MARKERS[k] for k in ("user", "user2", "system", "assistant"))
    alone = render([{"role": "user", "content": user}])
    with_system = render([{"role": "system", "content": system}, {"role": "user", "content": user}])
    turns = render([{"role": "user", "content": user}, {"role": "assistant", "content": answer},
                    {"role": "user", "content": again}])
    try:
        start_user, tail = _split(alone, [user])
        start_system, system_user, _ = _split(with_system, [system, user])
        _, user_assistant, assistant_user, _ = _split(turns, [user, answer, again])
    except ValueError:
        raise Inexpressible("the chat template does not write message texts once each, as given") from None
    return Transitions(start_system, start_user, system_user, user_assistant, assistant_user, tail)


def trims(render) -> bool:
    """Whether the template strips the whitespace around a message's text (Llama 3's and Gemma 3's do)."""
    padded = f"  {MARKERS['user']}\n"
    return padded not in render([{"role": "user", "content": padded}])


def _split(text: str, markers: list[str]) -> list[str]:
    """The text between the markers, in order (each exactly once)."""
    pieces = []
    for marker in markers:
        if text.count(marker) != 1:
            raise ValueError(marker)
        before, text = text.split(marker)
        pieces.append(before)
    return pieces + [text]


def go_template(t: Transitions) -> str:
    """One line of Go template: no trim markers, so every literal is kept as the template wrote it."""
    for piece in vars(t).values():
        if "{{" in piece or '"""' in piece:
            raise Inexpressible("the chat template writes '{{' or '\"\"\"', which a Modelfile's template cannot hold")
    return ('{{ $prev := "" }}{{ range .Messages }}'
            f'{{{{ if and (eq $prev "") (eq .Role "system") }}}}{t.start_system}'
            f'{{{{ else if eq $prev "" }}}}{t.start_user}'
            f'{{{{ else if eq .Role "user" }}}}{{{{ if eq $prev "system" }}}}{t.system_user}'
            f'{{{{ else }}}}{t.assistant_user}{{{{ end }}}}'
            f'{{{{ else }}}}{t.user_assistant}{{{{ end }}}}'
            '{{ .Content }}{{ $prev = .Role }}{{ end }}' + t.tail)


ACTION = re.compile(r"\{\{ (.*?) \}\}")


def render_go(template: str, messages: list[dict]) -> str:
    """Render `template` as Go's text/template does, for the subset go_template writes: a `$prev` variable,
    `range .Messages`, nested if / else if / else on `eq` and `and`, `.Content` and `.Role`."""
    parts = ACTION.split(template)  # literal, action, literal, action, ...
    out, variables = [], {}

    def value(term: str, message: dict):
        if term.startswith('"'):
            return term.strip('"')
        if term == "$prev":
            return variables["$prev"]
        return message[term.removeprefix(".").lower()]

    def condition(text: str, message: dict) -> bool:
        text = text.strip()
        if text.startswith("and "):
            return all(condition(inner, message) for inner in re.findall(r"\(([^()]*)\)", text))
        _, left, right = text.split(" ")
        return value(left, message) == value(right, message)

    def run(start: int, message: dict | None, emit: bool) -> int:
        """Run parts from `start` until an `end`/`else` at this level; returns the index of that part."""
        i = start
        while i < len(parts):
            part = parts[i]
            if i % 2 == 0:
                if emit:
                    out.append(part)
                i += 1
                continue
            if part in ("end",) or part.startswith("else"):
                return i
            if part.startswith("range "):
                body = i + 1
                for each in messages:
                    stop = run(body, each, emit)
                i = stop if messages else run(body, None, False)
            elif part.startswith("if "):
                taken, branch = False, part[3:]
                while True:
                    chosen = emit and not taken and condition(branch, message)
                    i = run(i + 1, message, chosen)
                    taken = taken or chosen
                    if parts[i] == "end":
                        break
                    branch = parts[i][len("else if "):] if parts[i].startswith("else if ") else 'eq "" ""'
            elif ":=" in part or " = " in part:
                name, _, term = re.split(r"\s*(:?=)\s*", part)
                if emit:
                    variables[name] = value(term, message)
            elif part == ".Content":
                if emit:
                    out.append(message["content"])
            else:
                raise ValueError(f"not in the subset: {part}")
            i += 1
        return i

    run(0, None, True)
    return "".join(out)


def _quoted(token: str) -> str:
    return '"' + token.replace("\\", "\\\\").replace('"', '\\"') + '"'
