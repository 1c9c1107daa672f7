"""Chat with a trained model: the library behind `finetune chat`, and behind the panel through `ChatWorker`.

Prompts are rendered exactly as in training: the chat template saved with the model (the training one), the
recipe's template variables (GPT-OSS's reasoning effort) and its fixed template date. Generation stops at the
model's real end tokens: the end-of-turn token the template puts after an assistant turn (Llama 3.2 `<|eot_id|>`,
ChatML `<|im_end|>`, GPT-OSS `<|return|>`), GPT-OSS's `<|call|>`, and its `<|end|>` when it closes a final-channel
message (an `<|end|>` after the analysis channel only ends the reasoning), and the end tokens of the model's own
generation config (Phi-3's `<|end|>` beside its end of text). GPT-OSS replies are split into the reasoning (analysis
channel) and the answer; so are replies that open with a `<think>` block (Qwen 3), where the template writes one.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import re
import threading
from dataclasses import dataclass, field
from typing import Iterator

from finetune.errors import UserError

HARMONY_MESSAGE = re.compile(
    r"<\|channel\|>(?P<channel>\w+)[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>(?P<text>.*?)"
    r"(?:<\|end\|>|<\|return\|>|<\|call\|>|$)",
    re.S,
)
THINK_BLOCK = re.compile(r"\s*<think>\n?(?P<thinking>.*?)(?:\n?</think>\s*(?P<answer>.*)|$)", re.S)


@dataclass
class Sampling:
    max_new_tokens: int = 512
    temperature: float = 0.7  # 0: greedy
    top_p: float = 0.95
    seed: int | None = None


@dataclass
class Piece:
    """A streamed piece of a reply: text of the reasoning or of the answer."""

    kind: str  # "thinking" | "answer"
    text: str


@dataclass
class Reply:
    answer: str = ""
    thinking: str = ""
    ended_by: str | None = None  # the end token that stopped it; None: max_new_tokens ran out
    token_ids: list[int] = field(default_factory=list)


class Chat:
    """A trained model, loaded once, that answers conversations (lists of {role, content[, thinking]})."""

    def __init__(self, path, base_model: str | None = None, base: bool = False):
        """`base`: chat with the model the run started from, through the same template (for comparisons)."""
        from finetune.trained_model import saved_model

        self.folder = saved_model.locate(path)
        tokenizer = saved_model.load_tokenizer(self.folder)
        load = saved_model.load_original if base else saved_model.load_model
        self._bind(load(self.folder, base_model), tokenizer, renderer_of(self.folder, tokenizer),
                   self.folder.recipe.data.system_prompt)

    @classmethod
    def of(cls, model, tokenizer, renderer, system_prompt: str | None = None) -> "Chat":
        """A Chat with a model that is loaded already (the one being trained, for samples during training)."""
        chat = cls.__new__(cls)
        chat.folder = None
        chat._bind(model, tokenizer, renderer, system_prompt)
        return chat

    def _bind(self, model, tokenizer, renderer, system_prompt: str | None = None) -> None:
        self.model, self.tokenizer, self.renderer, self.system_prompt = model, tokenizer, renderer, system_prompt
        self.harmony = "<|channel|>" in tokenizer.get_vocab()
        self.think_blocks = renderer.template is not None and "<think>" in renderer.template
        self.end_ids = end_token_ids(tokenizer, renderer) | configured_end_ids(model.generation_config)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None, continuing: bool = False) -> list[int]:
        """The prompt for the model's turn; `continuing`: the last (assistant) message is the answer's start."""
        return prompt(self.renderer, self.system_prompt, messages, tools, continuing)

    def stream(self, messages: list[dict], sampling: Sampling = Sampling()) -> Iterator[Piece | Reply]:
        """Pieces of the reply as they are generated, then the whole Reply."""
        import torch
        from transformers import StoppingCriteriaList

        from finetune.trained_model.streaming import FinalMessageEnd, TokenQueue

        prompt = torch.tensor([self.prompt_ids(messages)], device=self.model.device)
        streamer = TokenQueue()
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        settings = dict(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=sampling.max_new_tokens,
            do_sample=sampling.temperature > 0, eos_token_id=sorted(self.end_ids),
            pad_token_id=self.tokenizer.pad_token_id, streamer=streamer,
            stopping_criteria=StoppingCriteriaList([FinalMessageEnd(self.ended_by, prompt.shape[1])]
                                                   if self.harmony else []),
        )
        if sampling.temperature > 0:
            settings.update(temperature=sampling.temperature, top_p=sampling.top_p)
        failure: list[BaseException] = []

        def generate():
            try:
                with torch.inference_mode():
                    self.model.generate(**settings)
            except BaseException as error:  # handed to the reading side
                failure.append(error)
                streamer.end()

        worker = threading.Thread(target=generate, daemon=True)
        worker.start()
        generated: list[int] = []
        shown = Reply()
        while (new := streamer.queue.get()) is not None:
            generated.extend(new)
            current = self.parse(generated, final=False)
            for kind in ("thinking", "answer"):
                before, after = getattr(shown, kind), getattr(current, kind)
                if len(after) > len(before) and after.startswith(before):
                    yield Piece(kind, after[len(before):])
                    setattr(shown, kind, after)
        worker.join()
        if failure:
            raise failure[0]
        yield self.parse(generated, final=True)

    def reply(self, messages: list[dict], sampling: Sampling = Sampling()) -> Reply:
        *_, whole = self.stream(messages, sampling)
        return whole

    def replies(self, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 16,
                synced: bool = False) -> list[Reply]:
        """Greedy replies to prompts (token ids, e.g. from `prompt_ids`), `batch_size` at a time: left-padded
        batches through generate with its KV cache, each reply ending at the model's end tokens as in `stream`.
        `synced`: every process of a process group generates, and each goes on until all are done (a sharded
        model gathers its weights in every forward, on every process)."""
        import torch
        from transformers import StoppingCriteriaList

        from finetune.trained_model.streaming import FinalMessageEnd

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.end_ids)
        replies = []
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start:start + batch_size]
            width = max(len(prompt) for prompt in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in batch], device=self.model.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=self.model.device)
            with torch.inference_mode():
                output = self.model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                    eos_token_id=sorted(self.end_ids), pad_token_id=pad, use_cache=True, synced_gpus=synced,
                    stopping_criteria=StoppingCriteriaList([FinalMessageEnd(self.ended_by, width)]
                                                           if self.harmony else []),
                )
            for row in output[:, width:].tolist():
                replies.append(self.parse(self._through_end(row), final=True))
        return replies

    def _through_end(self, generated: list[int]) -> list[int]:
        """A batch row's reply: its tokens up to and including the first end token (finished rows are padded)."""
        for length in range(1, len(generated) + 1):
            token = generated[length - 1]
            if (token in self.end_ids or self.harmony) and self.ended_by(generated[:length]) is not None:
                return generated[:length]
        return generated

    def parse(self, generated: list[int], final: bool) -> Reply:
        """The reply these generated tokens make (`final`: all of it; else held back at a partial character)."""
        reply = Reply(token_ids=list(generated), ended_by=self.ended_by(generated) if final else None)
        if not self.harmony:
            text = self._text(generated, special=False)
            block = THINK_BLOCK.match(text) if self.think_blocks else None
            if block:
                reply.thinking = _stable(block["thinking"], final)
                text = block["answer"] or ""
            reply.answer = _stable(text, final)
            return reply
        text = self._text(generated, special=True)
        parts = {"thinking": [], "answer": []}
        for message in HARMONY_MESSAGE.finditer(text):
            parts["thinking" if message["channel"] == "analysis" else "answer"].append(message["text"])
        if "<|channel|>" not in text:  # a model that has not learned the format: show what it wrote
            parts["answer"].append(self._text(generated, special=False))
        reply.thinking = _stable("\n\n".join(parts["thinking"]), final)
        reply.answer = _stable("\n\n".join(parts["answer"]), final)
        return reply

    def _text(self, generated: list[int], special: bool) -> str:
        return self.tokenizer.decode(generated, skip_special_tokens=not special, clean_up_tokenization_spaces=False)

    def ended_by(self, generated: list[int]) -> str | None:
        """The end token that closes the reply, if the last token is one (GPT-OSS's <|end|> only after a final
        message: after the analysis channel the answer is still to come)."""
        if not generated:
            return None
        last = self.tokenizer.convert_ids_to_tokens(generated[-1])
        if generated[-1] in self.end_ids:
            return last
        if self.harmony and last == "<|end|>":
            channels = re.findall(r"<\|channel\|>(\w+)", self._text(generated, special=True))
            return last if channels and channels[-1] == "final" else None
        return None


def prompt(renderer, system_prompt: str | None, messages: list[dict], tools: list[dict] | None = None,
           continuing: bool = False) -> list[int]:
    """A conversation's prompt as training rendered its rows: the recipe's system prompt first where it has none."""
    from finetune.data.formats import BadRow, with_system_prompt

    try:
        return renderer.prompt_ids(with_system_prompt(messages, system_prompt), tools, continuing)
    except BadRow as error:
        raise UserError(f"the conversation cannot be rendered: {error}") from None


def renderer_of(folder, tokenizer):
    """Prompts as the saved model's training rendered them: its chat template, template date and variables."""
    from finetune.data.render import Renderer

    data = folder.recipe.data
    return Renderer(tokenizer, tokenizer.chat_template, data.template_date, template_kwargs=data.template_kwargs)


def _stable(text: str, final: bool) -> str:
    """Hold back a trailing partial character (bytes of a multi-byte character still to come)."""
    return text if final else text.rstrip("\ufffd")


def end_token_ids(tokenizer, renderer) -> set[int]:
    """The tokens that end the model's turn: the special token the template puts after an assistant turn (the last
    trained one; a template whose trained span stops before it, at the text, adds nothing), the tokenizer's end of
    sequence, and GPT-OSS's end-of-reply and tool-call tokens."""
    ends = set()
    if renderer.template is not None:  # without one, the model was trained on text that ends with eos
        _, labels = renderer.encode({"messages": [{"role": "user", "content": "Hello"},
                                                  {"role": "assistant", "content": "Hi"}]})
        last = [label for label in labels if label != -100][-1]
        if last in tokenizer.all_special_ids or last in tokenizer.get_added_vocab().values():
            ends.add(last)
    if tokenizer.eos_token_id is not None:
        ends.add(tokenizer.eos_token_id)
    vocabulary = tokenizer.get_vocab()
    ends.update(vocabulary[token] for token in ("<|return|>", "<|call|>") if token in vocabulary)
    return ends


def configured_end_ids(generation_config) -> set[int]:
    """The end tokens a generation config lists (one id, a list, or none)."""
    listed = generation_config.eos_token_id if generation_config is not None else None
    return set() if listed is None else {listed} if isinstance(listed, int) else set(listed)


class ChatWorker:
    """A Chat in its own process, so the caller (the panel) never loads torch or a model.

    `stream` works as Chat.stream; a failure to load becomes a UserError with the worker's message."""

    def __init__(self, path, base_model: str | None = None, base: bool = False):
        context = multiprocessing.get_context("spawn")
        self._requests = context.Queue()
        self._answers = context.Queue()
        self._process = context.Process(target=_serve, daemon=True,
                                        args=(str(path), base_model, base, self._requests, self._answers))
        self._process.start()
        try:
            self._receive()
        except BaseException:
            self.close()
            raise

    def stream(self, messages: list[dict], sampling: Sampling = Sampling()) -> Iterator[Piece | Reply]:
        self._requests.put((messages, sampling))
        while True:
            item = self._receive()
            yield item
            if isinstance(item, Reply):
                return

    def _receive(self):
        while True:
            try:
                kind, detail = self._answers.get(timeout=1)
            except queue.Empty:
                if not self._process.is_alive():
                    raise RuntimeError(f"the chat worker exited (status {self._process.exitcode})") from None
                continue
            if kind == "error":
                raise UserError(detail)
            if kind == "failure":
                raise RuntimeError(f"the chat worker failed: {detail}")
            return detail

    def reply(self, messages: list[dict], sampling: Sampling = Sampling()) -> Reply:
        *_, whole = self.stream(messages, sampling)
        return whole

    def alive(self) -> bool:
        return self._process.is_alive()

    def close(self) -> None:
        if self._process.is_alive():
            self._requests.put(None)
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _serve(path: str, base_model: str | None, base: bool, requests, answers) -> None:
    def failed(error: BaseException) -> tuple[str, str]:
        return ("error", str(error)) if isinstance(error, UserError) else ("failure", f"{type(error).__name__}: {error}")

    try:
        chat = Chat(path, base_model, base)
    except Exception as error:
        answers.put(failed(error))
        return
    answers.put(("ready", None))
    parent = os.getppid()
    while True:
        try:
            request = requests.get(timeout=2)
        except queue.Empty:
            if os.getppid() != parent:  # the process that started this one died without closing it
                return
            continue
        if request is None:
            return
        try:
            for item in chat.stream(*request):
                answers.put(("item", item))
        except Exception as error:
            answers.put(failed(error))
