"""Render examples to token ids and labels, with exact loss masks.

Chat examples go through the chat template. An assistant turn's trained tokens start where the rendering of the
conversation before it, with the generation prompt, ends: exactly what the model sees at inference before it writes.
They end with the turn's end-of-turn token: where the rendering of the conversation up to and including the turn
ends, for templates whose renderings of a growing conversation are prefixes of each other (Llama 3.2's official
template, for one), or where the template's `{% generation %}` block ends, for templates that have those markers
(TRL ships marked variants of templates that are not prefix-stable, such as GPT-OSS's, and we use them).
Every prefix is checked against the full rendering; a conversation the template renders inconsistently is a bad row,
never a silently wrong mask.

With `train_thinking` off, a turn's reasoning (`thinking`, e.g. GPT-OSS's analysis channel) is context, not target:
the part of the turn that is absent when the turn is rendered without its reasoning carries no loss. Templates that
read reasoning as `reasoning_content` (Qwen 3's, among others) get it under that name too.

Templates see a fixed date (`strftime_now`), so renders, masks and the cache do not change with the clock; other
template variables (GPT-OSS's `reasoning_effort`) come from `template_kwargs`.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from datetime import date
from typing import Any

from finetune.data.formats import BadRow

IGNORE = -100


def training_template(tokenizer, template: str) -> str:
    """The template to render training data with: the given one, or TRL's marked variant of it when TRL has one."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if has_generation_markers(template):
        return template
    original = tokenizer.chat_template
    tokenizer.chat_template = template
    try:
        return get_training_chat_template(tokenizer) or template
    except ValueError:  # TRL has no variant for it: we rely on its prefixes
        return template
    finally:
        tokenizer.chat_template = original


class Renderer:
    def __init__(self, tokenizer, template: str | None, template_date: str, loss_on: str = "assistant",
                 train_thinking: bool = True, template_kwargs: dict | None = None):
        from trl.chat_template_utils import has_generation_markers

        self.tokenizer = tokenizer
        self.template = template
        self.has_markers = template is not None and has_generation_markers(template)
        self.loss_on = loss_on
        self.train_thinking = train_thinking
        self._added_text = {token: text for text, token in tokenizer.get_added_vocab().items()}
        self._special_ids = set(self._added_text)
        self._backend = _plain_backend(tokenizer)
        self._reasoning_content = template is not None and "reasoning_content" in template
        self._settings = (template_date, loss_on, train_thinking, template_kwargs)  # a sibling renderer's
        fixed = date.fromisoformat(template_date)
        self._template_kwargs = {**(template_kwargs or {}), "strftime_now": fixed.strftime}
        self._special_tokens = tokenizer.special_tokens_map  # (bos_token and the like, which templates read)

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """The template's variables, the fixed date among them."""
        return dict(self._template_kwargs)

    def encode(self, example: dict[str, Any]) -> tuple[list[int], list[int]]:
        """Token ids and labels (the id where the token carries loss, else -100)."""
        if "segments" in example:
            return self._encode_text(example["segments"])
        if self.template is None:
            raise BadRow("the tokenizer has no chat template; set model.chat_template to a .jinja file")
        return self._encode_chat(example["messages"], example.get("tools"))

    def render_text(self, example: dict[str, Any], add_generation_prompt: bool = False) -> str:
        """The example as the model sees it, as text."""
        if "segments" in example:
            return "".join(segment["text"] for segment in example["segments"])
        return self.tokenizer.apply_chat_template(
            self._as_template_reads(example["messages"]), tools=example.get("tools"), chat_template=self.template,
            tokenize=False, add_generation_prompt=add_generation_prompt, **self._template_kwargs,
        )

    def _as_template_reads(self, messages: list[dict]) -> list[dict]:
        if not self._reasoning_content:
            return messages
        return [{**m, "reasoning_content": m["thinking"]} if m.get("thinking") else m for m in messages]

    def prompt_ids(self, messages: list[dict], tools: list | None = None, continuing: bool = False) -> list[int]:
        """The conversation so far with the generation prompt: what the model sees before it writes its turn.
        `continuing`: the last message is the assistant's turn begun, rendered without its end, to go on from."""
        if continuing:
            return list(self._tokens(messages, tools, continue_final_message=True)["input_ids"])
        return list(self._tokens(messages, tools, add_generation_prompt=True)["input_ids"])

    def _tokens(self, messages: list[dict], tools: list | None, add_generation_prompt: bool = False,
                with_mask: bool = False, **options) -> dict[str, list[int]]:
        return self._apply_template(messages, tools, add_generation_prompt, tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=with_mask, **options)

    def _text(self, messages: list[dict], tools: list | None, add_generation_prompt: bool = False,
              template: str | None = None) -> str:
        return self._apply_template(messages, tools, add_generation_prompt, tokenize=False, template=template)

    def _apply_template(self, messages: list[dict], tools: list | None, add_generation_prompt: bool,
                        tokenize: bool, template: str | None = None, **options):
        """The conversation through the chat template. Text is rendered as apply_chat_template renders it (the
        template sees the tokenizer's special tokens and our variables) without its work around each call: a row
        renders several of its prefixes."""
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            if not tokenize:
                return render_jinja_template(
                    [self._as_template_reads(messages)], tools=tools, chat_template=template or self.template,
                    add_generation_prompt=add_generation_prompt, **self._special_tokens, **self._template_kwargs,
                )[0][0]
            return self.tokenizer.apply_chat_template(
                self._as_template_reads(messages), tools=tools, chat_template=template or self.template,
                add_generation_prompt=add_generation_prompt, tokenize=True, **options, **self._template_kwargs,
            )
        except Exception as error:  # jinja's raise_exception and template errors: the row, not the program
            raise BadRow(f"the chat template cannot render it: {error}") from None

    def _encode_chat(self, messages: list[dict], tools: list | None,
                     turn_ends: set[int] | None = None) -> tuple[list[int], list[int]]:
        """`turn_ends`: the tokens that end an answer, for a template whose renderings of a conversation's prefixes
        do not show where one ends (the answer ends at the first of them)."""
        own = self.tokenizer.chat_template
        if self.has_markers and own not in (None, self.template) and \
                self._text(messages, tools) != self._text(messages, tools, template=own):
            return self._by_the_models_own_template(messages, tools)
        if self.loss_on == "all":
            ids = list(self._tokens(messages, tools)["input_ids"])
            return ids, list(ids)
        full = self._rendered(messages, tools)
        ids = full.ids
        if self.has_markers:
            with_mask = self._tokens(messages, tools, with_mask=True)
            if list(with_mask["input_ids"]) != ids:
                raise BadRow("the chat template's generation markers change how the conversation is tokenized")
            marked = with_mask["assistant_masks"]
        labels = [IGNORE] * len(ids)
        for index, message in enumerate(messages):
            if message["role"] != "assistant" or message.get("train") is False:
                continue
            if index == 0:
                raise BadRow("message 1: the conversation starts with the assistant; an answer is learned from "
                             "what comes before it, so start with a user message (or a system prompt)")
            start = self._prefix_length(full, messages[:index], tools, index, add_generation_prompt=True)
            if self.has_markers:
                if start >= len(ids) or not marked[start]:
                    raise BadRow(f"message {index + 1}: the template's generation block does not cover the answer")
                end = start
                while end < len(ids) and marked[end]:
                    end += 1
            elif turn_ends:
                end = next((i + 1 for i in range(start, len(ids)) if ids[i] in turn_ends), len(ids))
            elif index == len(messages) - 1:  # the conversation through its last turn is the full rendering
                end = len(ids)
            else:
                end = self._prefix_length(full, messages[: index + 1], tools, index)
            end = self._through_end_of_turn(ids, start, end)
            if message.get("thinking") and not self.train_thinking:
                start = self._after_thinking(ids, messages, tools, index, start)
            labels[start:end] = ids[start:end]
        if all(label == IGNORE for label in labels):
            raise BadRow("no assistant tokens after rendering")
        return ids, labels

    def _by_the_models_own_template(self, messages: list[dict], tools: list | None) -> tuple[list[int], list[int]]:
        """A conversation that TRL's marked variant renders other than the model's own template does.

        The variant of a template that drops the reasoning of turns before the last user message (Qwen 3's) gives
        every turn a reasoning block, so that it is prefix-stable; at inference the model never sees those blocks.
        Such a conversation is rendered as the model's template renders it, and its answers before the last user
        message are context: trained there, without the reasoning the model would write, they would teach it to
        answer without. The answers after it carry loss: each from where its prompt ends (checked as for any
        template) through the first token that ends an answer in the marked variant (Qwen 3's <|im_end|>)."""
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        context = [{**m, "train": False} if i < last_user and m["role"] == "assistant" else m
                   for i, m in enumerate(messages)]
        marked = self._tokens(messages, tools, with_mask=True)
        ids, mask = list(marked["input_ids"]), marked["assistant_masks"]
        span_ends = [i for i in range(len(ids)) if mask[i] and (i + 1 == len(ids) or not mask[i + 1])]
        turn_ends = {next((ids[j] for j in range(i, -1, -1) if ids[j] in self._special_ids), None) for i in span_ends}
        turn_ends.discard(None)
        return self._own_renderer._encode_chat(context, tools, turn_ends)

    @functools.cached_property
    def _own_renderer(self) -> Renderer:
        """A renderer of the model's own template with this one's settings, made once (not per row)."""
        return Renderer(self.tokenizer, self.tokenizer.chat_template, *self._settings)

    def _after_thinking(self, ids: list[int], messages: list[dict], tools: list | None, index: int, start: int) -> int:
        """Where the turn's reasoning ends: from there on, the rendering without the reasoning agrees with the full
        one. The turn then carries loss exactly as it would have without reasoning. (Templates that drop the
        reasoning of this turn render it identically, and nothing is masked.)"""
        plain = dict(messages[index])
        del plain["thinking"]
        without = list(self._tokens([*messages[:index], plain, *messages[index + 1:]], tools)["input_ids"])
        shared = min(_common_prefix(ids[::-1], without[::-1]), len(without) - start)
        return max(start, len(ids) - shared)

    def _through_end_of_turn(self, ids: list[int], start: int, end: int) -> int:
        """Drop template glue after the turn's end token (ChatML's newline after <|im_end|>): never generated."""
        while end > start + 1 and ids[end - 2] in self._special_ids and not self.tokenizer.decode(ids[end - 1]).strip():
            end -= 1
        return end

    def _rendered(self, messages: list[dict], tools: list | None) -> _Rendered:
        text = self._text(messages, tools)
        if self._backend:
            ids = self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids  # (no offsets kept)
            added = [at for at, token in enumerate(ids) if token in self._special_ids]
            starts, ends = [], []
            for at in added:  # the backend splits the text at the first occurrence of an added token's text
                starts.append(text.index(self._added_text[ids[at]], ends[-1] if ends else 0))
                ends.append(starts[-1] + len(self._added_text[ids[at]]))
        else:
            encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(encoding["input_ids"])
            added = [at for at, token in enumerate(ids) if token in self._special_ids]
            starts, ends = zip(*[encoding["offset_mapping"][at] for at in added]) if added else ((), ())
        return _Rendered(text, ids, added, list(starts), list(ends))

    def _prefix_length(self, full: _Rendered, messages: list[dict], tools: list | None, index: int,
                       add_generation_prompt: bool = False) -> int:
        """How many of the full conversation's tokens the rendering of `messages` is: exactly its tokens, which
        must be the first ones of the full conversation's.

        Tokenizers split text at added (special) tokens first and tokenize each piece on its own, so the prefix's
        tokens are the full text's tokens up to the prefix's last added token, followed by the tokens of the rest
        of the prefix from that added token on: only that rest is tokenized here."""
        text = self._text(messages, tools, add_generation_prompt)
        last_added = bisect.bisect_right(full.added_ends, len(text)) - 1  # the prefix's last added token
        cut, first = (full.added_starts[last_added], full.added[last_added]) if last_added >= 0 else (0, 0)
        tail = self._ids(text[cut:])
        if not full.text.startswith(text) or full.ids[first:first + len(tail)] != list(tail):
            side = "before" if add_generation_prompt else "through"
            raise BadRow(
                f"message {index + 1}: the chat template renders the conversation {side} this turn differently "
                "from the full conversation, so its loss mask cannot be derived; use a template with "
                "{% generation %} markers (model.chat_template)"
            )
        return first + len(tail)

    def _ids(self, text: str) -> list[int]:
        if not text:
            return []
        if self._backend:
            return self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _encode_text(self, segments: list[dict]) -> tuple[list[int], list[int]]:
        """Raw text: the segments joined, then the end-of-sequence token, trained where their segment is."""
        tokenizer = self.tokenizer
        text = "".join(segment["text"] for segment in segments)
        ids = tokenizer(text, add_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
        if self.loss_on == "all" or all(segment["train"] for segment in segments):
            return ids, list(ids)
        labels = [IGNORE] * len(ids)
        consumed = ""
        for segment in segments:
            # Where a segment starts is where the tokenization of the text before it stops agreeing with the whole.
            start = _common_prefix(ids, tokenizer(consumed, add_special_tokens=True)["input_ids"]) if consumed else 0
            consumed += segment["text"]
            end = _common_prefix(ids, tokenizer(consumed, add_special_tokens=True)["input_ids"])
            if segment is segments[-1]:
                end = len(ids)
            if segment["train"]:
                labels[start:end] = ids[start:end]
        return ids, labels


def _plain_backend(tokenizer):
    """The `tokenizers` Tokenizer behind a fast tokenizer, where calling it tokenizes as calling the tokenizer does
    (no truncation or padding set on it, special tokens split or not alike) and each added token is exactly its text
    where it stands in the text (none strips the spaces beside it, matches whole words only, or is matched in
    normalized text): a conversation's prefixes are tokenized many times per row, the wrapper's work per call costs
    more than a short prefix's tokens, and the added tokens' places are then found without tracking every token's
    offsets. None where it would not tokenize alike."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation or backend.padding or \
            backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False)):
        return None
    if any(added.lstrip or added.rstrip or added.single_word or (added.normalized and backend.normalizer)
           for added in backend.get_added_tokens_decoder().values()):
        return None
    return backend


@dataclass
class _Rendered:
    """A conversation rendered as text and tokenized, with its added (special) tokens: their places among the
    tokens, and where each starts and ends in the text."""
    text: str
    ids: list[int]
    added: list[int]
    added_starts: list[int]
    added_ends: list[int]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
