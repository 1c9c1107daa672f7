"""Every row format becomes the same internal conversation; unusable rows say why."""

from __future__ import annotations

import pytest

from finetune.data.formats import BadRow, detect_format, normalize

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def test_messages_with_thinking_tools_and_all_roles():
    row = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "name": "get_weather", "content": "18C"},
            {"role": "assistant", "content": "18C and sunny.", "thinking": "The tool said 18C."},
        ],
        "tools": '[{"name": "get_weather", "parameters": {"type": "object"}}]',
    }
    assert detect_format(row, {}) == "messages"
    example = normalize(row, "messages", {}, None)
    assert [m["role"] for m in example["messages"]] == ["system", "developer", "user", "assistant", "tool", "assistant"]
    assert example["messages"][3] == {"role": "assistant", "content": "", "tool_calls": [CALL]}  # arguments parsed
    assert example["messages"][5]["thinking"] == "The tool said 18C."
    assert example["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_alpaca_with_input_system_and_column_mapping():
    row = {"task": {"text": "Add the numbers."}, "numbers": "2 and 3", "answer": "5", "system": "You add."}
    columns = {"instruction": "task.text", "input": "numbers", "output": "answer"}
    assert detect_format(row, columns) == "alpaca"
    assert normalize(row, "alpaca", columns, None)["messages"] == [
        {"role": "system", "content": "You add."},
        {"role": "user", "content": "Add the numbers.\n\n2 and 3"},
        {"role": "assistant", "content": "5"},
    ]
    nested = {"instruction": "Echo.", "instances": [{"input": "hi", "output": "hi"}]}
    mapped = normalize(nested, "alpaca", {"input": "instances.0.input", "output": "instances.0.output"}, None)
    assert mapped["messages"][0]["content"] == "Echo.\n\nhi"


def test_sharegpt_with_function_call_and_observation():
    row = {
        "conversations": [
            {"from": "human", "value": "Weather in Paris?"},
            {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
            {"from": "observation", "value": '{"temp": 18}'},
            {"from": "gpt", "value": "18C."},
        ],
        "tools": '[{"name": "get_weather"}]',
        "system": "Be brief.",
    }
    assert detect_format(row, {}) == "sharegpt"
    example = normalize(row, "sharegpt", {}, None)
    assert example["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": '{"temp": 18}'},
        {"role": "assistant", "content": "18C."},
    ]


def test_prompt_completion_text_and_conversational():
    row = {"prompt": "2+2=", "completion": "4"}
    assert detect_format(row, {}) == "prompt_completion"
    assert normalize(row, "prompt_completion", {}, None) == {
        "segments": [{"text": "2+2=", "train": False}, {"text": "4", "train": True}]
    }
    chat = {
        "prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                   {"role": "user", "content": "Bye"}],
        "completion": [{"role": "assistant", "content": "Goodbye"}],
    }
    messages = normalize(chat, "prompt_completion", {}, None)["messages"]
    assert [m.get("train", True) for m in messages] == [False, False, False, True]  # earlier answers are context


def test_text_and_system_prompt():
    assert normalize({"text": "Once upon"}, "text", {}, None) == {"segments": [{"text": "Once upon", "train": True}]}
    example = normalize({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]},
                        "messages", {}, "Be kind.")
    assert example["messages"][0] == {"role": "system", "content": "Be kind."}


def test_thinking_marker_splits_answers():
    row = {"question": "2+2?", "answer": "Two and two make four.\n#### 4"}
    example = normalize(row, "alpaca", {"instruction": "question", "output": "answer"}, None, thinking_marker="####")
    assert example["messages"][-1] == {"role": "assistant", "content": "4", "thinking": "Two and two make four."}
    unmarked = normalize({"instruction": "Hi", "output": "Hello"}, "alpaca", {}, None, thinking_marker="####")
    assert unmarked["messages"][-1] == {"role": "assistant", "content": "Hello"}


def test_unknown_format_is_none():
    assert detect_format({"question": "q", "answer": "a"}, {}) is None


@pytest.mark.parametrize(
    "row, fmt, reason",
    [
        ({"messages": []}, "messages", "empty conversation"),
        ({"messages": [{"content": "hi"}]}, "messages", "message 1 has no role"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "unknown role 'wizard'"),
        ({"messages": [{"role": "user", "content": 42}]}, "messages", "message 1 content is a number, not text"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "messages", "no assistant turn to learn from"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}, "messages",
         "assistant message is empty"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "sharegpt", "unknown role 'alien'"),
        ({"conversations": [{"from": "function_call", "value": "{oops"}]}, "sharegpt", "not valid JSON"),
        ({"instruction": "x"}, "alpaca", "no 'output' field"),
        ({"prompt": "x", "completion": [{"role": "assistant", "content": "y"}]}, "prompt_completion", "both be text"),
        ({"messages": "hello"}, "messages", "messages must be a list of turns"),
    ],
)
def test_bad_rows_say_why(row, fmt, reason):
    with pytest.raises(BadRow, match=reason):
        normalize(row, fmt, {}, None)


def test_llama_factory_v1_content_parts_with_reasoning():
    row = {"messages": [
        {"role": "user", "content": [{"type": "text", "value": "What is 2+2?"}]},
        {"role": "assistant", "content": [{"type": "reasoning", "value": "Two and two make four."},
                                          {"type": "text", "value": "4"}]}]}
    messages = normalize(row, "messages", {}, None)["messages"]
    assert messages == [{"role": "user", "content": "What is 2+2?"},
                        {"role": "assistant", "content": "4", "thinking": "Two and two make four."}]
