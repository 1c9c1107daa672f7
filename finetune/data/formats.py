"""Every supported row format becomes one internal example, right after loading.

A chat example is `{"messages": [...], "tools": [...] | None}`. Each message has `role` (system, developer, user,
assistant or tool) and `content` (text); assistant messages may carry `thinking` and `tool_calls`
(`[{"type": "function", "function": {"name": ..., "arguments": {...}}}]`), tool messages a `name`. An assistant
message with `"train": False` is context only (the prompt side of a prompt/completion row).

A plain-text example (raw `text`, or a text prompt/completion, which TRL also leaves untemplated) is
`{"segments": [{"text": ..., "train": bool}, ...]}`.

A preference pair (stages dpo and kto) is `{"chosen": EXAMPLE, "rejected": EXAMPLE}`: the same prompt with each
answer, both chat or both plain-text examples as above, the prompt marked as context. An answer labelled for KTO
is `{"completion": EXAMPLE, "label": bool}`. Preference rows come as:

    preference            prompt (messages or text) or messages, with chosen and rejected (messages or text); without
                          a prompt, chosen and rejected are whole conversations that share it (TRL's implicit prompt)
    sharegpt_preference   conversations, with chosen and rejected turns ({from, value}), as LLaMA-Factory's data
    hh                    chosen and rejected as whole "\n\nHuman: ... \n\nAssistant: ..." transcripts (Anthropic HH)
    kto                   prompt and completion (messages or text) with a boolean label

`normalize` raises `BadRow` with the reason when a row cannot be used; the pipeline adds file and row number.
"""

from __future__ import annotations

import json
import re
from typing import Any

from finetune.recipe.sections import PREFERENCE_FORMATS

ROLES = ("system", "developer", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}


class BadRow(Exception):
    """This row cannot be trained on; the message says why."""


def detect_format(row: dict[str, Any], columns: dict[str, str], preference: bool = False) -> str | None:
    """The format whose fields the row has (after the column mapping), or None. `preference`: the preference
    formats (stages dpo and kto)."""

    def has(name: str) -> bool:
        return _lookup(row, columns.get(name, name)) is not None

    if preference:
        if has("chosen") and has("rejected"):
            if has("conversations"):
                return "sharegpt_preference"
            if has("prompt") or has("messages") or isinstance(_lookup(row, columns.get("chosen", "chosen")), list):
                return "preference"
            return "hh"
        if has("prompt") and has("completion") and has("label"):
            return "kto"
        return None
    if has("messages"):
        return "messages"
    if has("conversations"):
        return "sharegpt"
    if has("instruction") and has("output"):
        return "alpaca"
    if has("prompt") and has("completion"):
        return "prompt_completion"
    if has("text"):
        return "text"
    return None


def normalize(row: dict[str, Any], fmt: str, columns: dict[str, str], system_prompt: str | None,
              thinking_marker: str | None = None) -> dict[str, Any]:
    def field(name: str, required: bool = True) -> Any:
        source = columns.get(name, name)
        value = _lookup(row, source)
        if value is None and required:
            mapped = f" (mapped from {name!r})" if source != name else ""
            raise BadRow(f"{source!r} is null{mapped}" if source in row else f"no {source!r} field{mapped}")
        return value

    if fmt in PREFERENCE_FORMATS:
        return _preference(field, row, fmt, system_prompt, thinking_marker)
    if fmt == "messages":
        messages = [_message(m, i) for i, m in enumerate(_nonempty_list(field("messages"), "messages"), 1)]
        example = {"messages": messages, "tools": _tools(row.get("tools"))}
    elif fmt == "sharegpt":
        turns = _nonempty_list(field("conversations"), "conversations")
        messages = [_sharegpt_message(turn, i) for i, turn in enumerate(turns, 1)]
        if isinstance(row.get("system"), str) and row["system"] and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": row["system"]})
        example = {"messages": messages, "tools": _tools(row.get("tools"))}
    elif fmt == "alpaca":
        instruction, extra, output = _text(field("instruction"), "instruction"), field("input", False), field("output")
        extra = _text(extra, "input") if extra is not None else ""
        messages = [{"role": "user", "content": f"{instruction}\n\n{extra}" if extra else instruction}]
        if isinstance(row.get("system"), str) and row["system"]:
            messages.insert(0, {"role": "system", "content": row["system"]})
        messages.append({"role": "assistant", "content": _text(output, "output")})
        example = {"messages": messages, "tools": None}
    elif fmt == "prompt_completion":
        prompt, completion = field("prompt"), field("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            return {"segments": [{"text": prompt, "train": False}, {"text": completion, "train": True}]}
        if not isinstance(prompt, list) or not isinstance(completion, list):
            raise BadRow("prompt and completion must both be text, or both be lists of messages")
        context = [{**_message(m, i), "train": False} for i, m in enumerate(prompt, 1)]
        answer = [_message(m, len(prompt) + i) for i, m in enumerate(completion, 1)]
        example = {"messages": context + answer, "tools": _tools(row.get("tools"))}
    elif fmt == "text":
        return {"segments": [{"text": _text(field("text"), "text"), "train": True}]}
    else:
        raise ValueError(f"unknown format {fmt!r}")
    return _conversation(example, system_prompt, thinking_marker)


def prompt(messages: Any, tools: Any = None) -> dict[str, Any]:
    """A conversation to answer (a chat request), normalized as training rows are, so that the chat template sees it
    as it saw them: text content, reasoning as `thinking`, tool-call arguments as objects, tools in OpenAI's form."""
    return {"messages": [_message(m, i) for i, m in enumerate(_nonempty_list(messages, "messages"), 1)],
            "tools": _tools(tools)}


def with_system_prompt(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """The messages with the recipe's system prompt first, where they have none (as every training row has it)."""
    if system_prompt and messages and messages[0]["role"] not in ("system", "developer"):
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


def _conversation(example: dict[str, Any], system_prompt: str | None, thinking_marker: str | None) -> dict[str, Any]:
    example["messages"] = with_system_prompt(example["messages"], system_prompt)
    if thinking_marker:
        example["messages"] = [_split_thinking(m, thinking_marker) for m in example["messages"]]
    if not any(m["role"] == "assistant" and m.get("train", True) for m in example["messages"]):
        raise BadRow("no assistant turn to learn from")
    _check_order(example["messages"])
    return example


def _preference(field, row: dict[str, Any], fmt: str, system_prompt: str | None,
                thinking_marker: str | None) -> dict[str, Any]:
    """A preference pair, or a labelled answer (kto), from a row of a preference format."""
    tools = _tools(row.get("tools"))

    def answer(prompt: list | str, completion: Any, name: str) -> dict[str, Any]:
        """The prompt with one answer: a chat example, or plain text when prompt and answer are both text."""
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion:
                raise BadRow(f"{name} is empty")
            return {"segments": [{"text": prompt, "train": False}, {"text": completion, "train": True}]}
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        elif isinstance(completion, dict):
            completion = [completion]
        if not isinstance(completion, list) or not completion:
            raise BadRow(f"{name} must be text, a message or a list of messages, not {_kind(completion)}")
        context = [{**m, "train": False} for m in prompt]
        if fmt == "sharegpt_preference":
            answers = [_sharegpt_message(turn, len(prompt) + i) for i, turn in enumerate(completion, 1)]
        else:
            answers = [_message(m, len(prompt) + i) for i, m in enumerate(completion, 1)]
        if answers[0]["role"] != "assistant":
            raise BadRow(f"{name} must begin with an assistant message, not {answers[0]['role']}")
        example = {"messages": context + answers, "tools": tools}
        return _conversation(example, system_prompt, thinking_marker)

    if fmt == "kto":
        label = field("label")
        if not isinstance(label, bool):
            raise BadRow(f"label must be true or false, not {_kind(label)}")
        return {"completion": answer(_prompt(field("prompt")), field("completion"), "completion"), "label": label}
    if fmt == "hh":
        chosen, rejected = _transcript(field("chosen"), "chosen"), _transcript(field("rejected"), "rejected")
        prompt, chosen, rejected = _shared_prompt(chosen, rejected)
    elif fmt == "sharegpt_preference":
        turns = _nonempty_list(field("conversations"), "conversations")
        prompt = [_sharegpt_message(turn, i) for i, turn in enumerate(turns, 1)]
        if isinstance(row.get("system"), str) and row["system"]:
            prompt.insert(0, {"role": "system", "content": row["system"]})
        chosen, rejected = field("chosen"), field("rejected")
    else:
        chosen, rejected = field("chosen"), field("rejected")
        given = _lookup(row, "prompt") if _lookup(row, "prompt") is not None else _lookup(row, "messages")
        if given is None:  # whole conversations sharing the prompt
            chosen = [_message(m, i) for i, m in enumerate(_nonempty_list(chosen, "chosen"), 1)]
            rejected = [_message(m, i) for i, m in enumerate(_nonempty_list(rejected, "rejected"), 1)]
            prompt, chosen, rejected = _shared_prompt(chosen, rejected)
        else:
            prompt = _prompt(field("prompt") if _lookup(row, "prompt") is not None else field("messages"))
    return {"chosen": answer(prompt, chosen, "chosen"), "rejected": answer(prompt, rejected, "rejected")}


def _prompt(value: Any) -> list[dict[str, Any]] | str:
    if isinstance(value, str):
        return value
    return [_message(m, i) for i, m in enumerate(_nonempty_list(value, "prompt"), 1)]


HH_TURN = re.compile(r"\n\n(Human|Assistant): ?")


def _transcript(text: Any, name: str) -> list[dict[str, str]]:
    """An Anthropic HH transcript ("\n\nHuman: ...\n\nAssistant: ...") as messages."""
    text = _text(text, name)
    parts = HH_TURN.split(text)
    if parts[0].strip() or len(parts) < 5:
        raise BadRow(f"{name} is not a transcript of \"\\n\\nHuman: ...\\n\\nAssistant: ...\" turns")
    return [{"role": "user" if speaker == "Human" else "assistant", "content": said.strip()}
            for speaker, said in zip(parts[1::2], parts[2::2])]


def _shared_prompt(chosen: list[dict], rejected: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen answer, rejected answer) of two conversations that differ only in their last answer."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    while shared and chosen[shared - 1]["role"] == "assistant":  # the answers start with the assistant's turn
        shared -= 1
    if not shared or chosen[shared]["role"] != "assistant" or rejected[shared:shared + 1] == [] \
            or rejected[shared]["role"] != "assistant":
        raise BadRow("chosen and rejected do not share a prompt followed by the assistant's answer")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _check_order(messages: list[dict[str, Any]]) -> None:
    """Roles in an order a chat template can render and a model can learn from."""
    for index, message in enumerate(messages, 1):
        role, before = message["role"], messages[index - 2] if index > 1 else None
        if role in ("system", "developer") and before is not None and before["role"] not in ("system", "developer"):
            raise BadRow(f"message {index}: a {role} message comes after the conversation began; put it first")
        if role == "tool" and (before is None or not (before["role"] == "tool" or before.get("tool_calls"))):
            raise BadRow(f"message {index}: a tool result without a tool call before it (an assistant message "
                         "with tool_calls)")
    if messages[-1]["role"] == "user":
        raise BadRow(f"the conversation ends with a user message that no assistant message answers; remove it "
                     f"(message {len(messages)})")


def _split_thinking(message: dict[str, Any], marker: str) -> dict[str, Any]:
    """An answer written as 'reasoning MARKER answer' becomes thinking and content (GSM8K: '... #### 72')."""
    if message["role"] != "assistant" or "thinking" in message or marker not in message["content"]:
        return message
    thinking, _, answer = message["content"].rpartition(marker)
    return {**message, "thinking": thinking.strip(), "content": answer.strip()}


def _lookup(row: dict[str, Any], path: str) -> Any:
    """`row[path]`, where a dotted path walks into nested fields and list indices (e.g. instances.0.input)."""
    if path in row:
        return row[path]
    value: Any = row
    for part in path.split("."):
        if isinstance(value, dict):
            value = value.get(part)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def _nonempty_list(value: Any, name: str) -> list:
    if not isinstance(value, list):
        raise BadRow(f"{name} must be a list of turns, not {_kind(value)}")
    if not value:
        raise BadRow(f"empty conversation ({name} is an empty list)")
    return value


def _text(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(part, dict) for part in value):  # OpenAI-style content parts
        kinds = {str(part.get("type")) for part in value}
        if kinds <= {"text"}:
            return "".join(_part_text(part) for part in value)
        media = sorted(kinds - {"text"})
        raise BadRow(f"{what} has {', '.join(media)} parts: only text is trained here (text-only models); "
                     "keep the text parts, or leave such rows out")
    raise BadRow(f"{what} is {_kind(value)}, not text")


def _part_text(part: dict[str, Any]) -> str:
    """A content part's text: OpenAI's parts have `text`, LLaMA-Factory's (v1) `value`."""
    return str(part.get("text", part.get("value", "")))


def _reasoning_parts(content: Any) -> tuple[Any, str | None]:
    """Content parts less the reasoning ones (`{"type": "reasoning", ...}`, LLaMA-Factory v1), and their text."""
    if not isinstance(content, list) or not any(isinstance(part, dict) and part.get("type") == "reasoning"
                                                for part in content):
        return content, None
    reasoning = [part for part in content if isinstance(part, dict) and part.get("type") == "reasoning"]
    return [part for part in content if part not in reasoning], "".join(_part_text(part) for part in reasoning)


def _kind(value: Any) -> str:
    return {type(None): "missing", bool: "a boolean", int: "a number", float: "a number", dict: "an object",
            list: "a list"}.get(type(value), type(value).__name__)


def _message(message: Any, index: int) -> dict[str, Any]:
    where = f"message {index}"
    if not isinstance(message, dict):
        raise BadRow(f"{where} is {_kind(message)}, not an object with role and content")
    role = message.get("role")
    if role is None:
        raise BadRow(f"{where} has no role")
    if role not in ROLES:
        raise BadRow(f"{where} has unknown role {role!r} (expected one of {', '.join(ROLES)})")
    content = message.get("content")
    tool_calls = message.get("tool_calls")
    if content is None and role == "assistant" and tool_calls:
        content = ""
    elif content is None and "content" in message:
        raise BadRow(f"{where} content is null")
    content, reasoning = _reasoning_parts(content)
    out: dict[str, Any] = {"role": role, "content": _text(content, f"{where} content")}
    thinking = message.get("thinking", message.get("reasoning_content", reasoning))
    if thinking is not None:
        if role != "assistant":
            raise BadRow(f"{where}: only assistant messages can have thinking")
        out["thinking"] = _text(thinking, f"{where} thinking")
    if tool_calls:
        if role != "assistant":
            raise BadRow(f"{where}: only assistant messages can have tool_calls")
        if not isinstance(tool_calls, list):
            raise BadRow(f"{where}: tool_calls must be a list")
        out["tool_calls"] = [_tool_call(call, where) for call in tool_calls]
    for key in ("name", "tool_call_id"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if role == "assistant" and not out["content"] and not tool_calls:
        raise BadRow(f"{where}: assistant message is empty")
    return out


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRow(f"{where}: a tool call needs a function name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise BadRow(f"{where}: tool call arguments are not valid JSON") from None
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _sharegpt_message(turn: Any, index: int) -> dict[str, Any]:
    where = f"turn {index}"
    if not isinstance(turn, dict) or "from" not in turn:
        raise BadRow(f"{where} has no 'from' (ShareGPT turns are {{from, value}})")
    role = SHAREGPT_ROLES.get(turn["from"])
    if role is None:
        raise BadRow(f"{where} has unknown role {turn['from']!r} (expected one of {', '.join(SHAREGPT_ROLES)})")
    value = _text(turn.get("value"), f"{where} value")
    if turn["from"] == "function_call":
        try:
            call = json.loads(value)
        except json.JSONDecodeError:
            raise BadRow(f"{where}: function_call value is not valid JSON") from None
        return {"role": "assistant", "content": "", "tool_calls": [_tool_call(call, where)]}
    if role == "assistant" and not value:
        raise BadRow(f"{where}: assistant message is empty")
    return {"role": role, "content": value}


def _tools(tools: Any) -> list | None:
    if tools is None or tools == "":
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise BadRow("tools is not valid JSON") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise BadRow("tools must be a list of function definitions")
    # Chat templates expect the OpenAI form {"type": "function", "function": {name, description, parameters}}.
    return [tool if "function" in tool else {"type": "function", "function": tool} for tool in tools] or None
