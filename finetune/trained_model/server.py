"""`finetune serve`: an OpenAI-compatible API (`POST /v1/chat/completions`, `GET /v1/models`, `GET /health`) over
trained models, answering as each was trained.

A conversation is rendered as training rendered it (the target's saved chat template, template variables and
date), generation stops at the model's real end tokens, and GPT-OSS's analysis channel comes back apart, as
`reasoning_content`. Concurrent requests on one model are generated in batches (batching.py). A bad request gets
OpenAI's error body and a 4xx status, and the server goes on.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException

from finetune.data import formats
from finetune.errors import UserError
from finetune.trained_model.served_models import MAX_REQUEST_MB

DEFAULT_MAX_TOKENS = 4096  # when a request gives none (and the context leaves more)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # image_url, input_audio, file: refused by Message, saying so
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id: normalized as training data
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def text_only(cls, content):
        for part in content if isinstance(content, list) else []:
            if part.type != "text":
                raise ValueError(f"{part.type} parts are not supported: the models served here read text only; "
                                 "send the content as text")
            if part.text is None:
                raise ValueError("a text part needs its text")
        return content


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields that change nothing here (user, logprobs: false)
    model: str
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    tools: list[dict] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)  # OpenAI's int64; each of n choices samples from seed + i
    n: int = Field(1, ge=1, le=16)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says (benchmarks)

    @model_validator(mode="after")
    def implemented(self):
        """Fields that would change the answer and that this server does not implement: refused, never ignored."""
        extra = self.model_extra or {}
        refused = {
            "response_format": (extra.get("response_format") or {"type": "text"}).get("type", "text") != "text"
            if isinstance(extra.get("response_format"), dict) else extra.get("response_format") is not None,
            "logit_bias": bool(extra.get("logit_bias")),
            "tool_choice": extra.get("tool_choice") not in (None, "auto", "none"),
            "functions": extra.get("functions") is not None or extra.get("function_call") is not None,
            "modalities": extra.get("modalities") not in (None, ["text"]) or extra.get("audio") is not None,
            "prediction": extra.get("prediction") is not None,
        }
        for field, asked in refused.items():
            if asked:
                raise ValueError(f"{field} is not implemented by finetune serve; leave it out (answers are plain "
                                 "text from the model's chat template, stopped at its end tokens)")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class RequestError(Exception):
    """A request the server refuses: OpenAI's error body with `status`."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code, self.param, self.kind = status, code, param, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


@dataclass
class Served:
    """One served name: its model's batcher, its adapter there, and the chat that renders and parses for it."""
    chat: object  # trained.chat.Chat bound to the loaded model
    batcher: object  # batching.Batcher of the loaded model
    adapter: str
    context: int  # positions the model takes, prompt and answer together
    created: int


def build_app(served: dict[str, Served], api_key: str | None = None, max_request_mb: float = MAX_REQUEST_MB):
    app = FastAPI(title="finetune serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_BodyLimit, limit=int(max_request_mb * 2**20))

    @app.exception_handler(RequestError)
    async def refused(_, error: RequestError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_, error: RequestValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())[1:])
        if first.get("type") == "json_invalid":
            return RequestError(400, "the request body is not valid JSON").response()
        said = str(first.get("msg")).removeprefix("Value error, ")
        return RequestError(400, f"{where}: {said}" if where else said, param=where or None).response()

    @app.exception_handler(HTTPException)
    async def http_error(_, error: HTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return RequestError(error.status_code, str(error.detail), kind=kind).response()

    async def authorized(request: Request) -> None:
        """A dependency rather than a middleware: Starlette's HTTP middleware would hide a client's disconnect from
        the stream it reads."""
        given = request.headers.get("authorization", "")
        if api_key and not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise RequestError(401, "missing or wrong API key: send it as 'Authorization: Bearer KEY'",
                               code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    def unknown(name: str) -> RequestError:
        return RequestError(404, f"the model {name!r} is not served here; GET /v1/models lists {', '.join(served)}",
                            code="model_not_found", param="model")

    def described(name: str) -> dict:
        return {"id": name, "object": "model", "created": served[name].created, "owned_by": "finetune"}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [described(name) for name in served]}

    @v1.get("/models/{name:path}")
    async def model(name: str):
        if name not in served:
            raise unknown(name)
        return described(name)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        entry = served.get(body.model)
        if entry is None:
            raise unknown(body.model)
        completion = await _Completion(entry, body).start()
        if body.stream:
            return StreamingResponse(completion.events(), media_type="text/event-stream")
        return await completion.whole(request)

    app.include_router(v1)
    return app


class _BodyLimit:
    """Refuse a request body over `limit` bytes with 413: by its Content-Length, or, sent without one, once that much
    has come (what came is held and handed on when the body ends below the limit). An ASGI middleware of its own:
    Starlette's HTTP middleware would hide a client's disconnect from streams."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit():
            if int(length) > self.limit:
                await _drain(receive, {"more_body": True})
                return await self._refuse(send)
            return await self.app(scope, receive, send)
        held, seen = [], 0
        while True:
            message = await receive()
            held.append(message)
            seen += len(message.get("body", b""))
            if seen > self.limit:
                await _drain(receive, message)
                return await self._refuse(send)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replayed():
            return held.pop(0) if held else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, send) -> None:
        response = RequestError(413, f"the request body is over {self.limit / 2**20:g} MiB: send a shorter "
                                     "conversation (the server's --max-request-mb sets the limit)",
                                code="request_too_large")
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": response.response().body})


async def _drain(receive, message: dict) -> None:
    """Read the rest of a body and drop it: a client still sending would see its connection reset instead of the
    413. Nothing of it is kept or parsed."""
    while message.get("more_body"):
        message = await receive()


class _Completion:
    """One request's choices: its rows submitted to the batcher, their tokens read back as they come."""

    def __init__(self, entry: Served, body: ChatCompletionRequest):
        self.entry, self.body = entry, body
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    async def start(self) -> _Completion:
        """Render and tokenize the conversation off the event loop (a long prompt takes seconds, during which other
        clients' streams and /health must go on), then submit a row per choice."""
        from finetune.trained_model.batching import Request as Row

        body, entry = self.body, self.entry
        self.prompt, self.continuing = await asyncio.to_thread(self._prompt_ids)
        room = entry.context - len(self.prompt)
        asked = body.max_completion_tokens or body.max_tokens
        if room <= 0 or (asked is not None and asked > room):
            raise RequestError(400, f"the prompt is {len(self.prompt):,} tokens and the model takes {entry.context:,} "
                                    f"in all: {'no room is left' if room <= 0 else f'at most {room:,} new tokens'}",
                               code="context_length_exceeded", param="messages")
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        chat = entry.chat
        self.rows = []
        for index in range(body.n):
            def deliver(token, reason, index=index):
                loop.call_soon_threadsafe(self.queue.put_nowait, (index, token, reason))

            self.rows.append(Row(
                list(self.prompt), asked or min(room, DEFAULT_MAX_TOKENS), deliver,
                _never_ended if body.ignore_eos else chat.ended_by,
                lambda ids: chat.tokenizer.decode(ids, skip_special_tokens=True), entry.adapter, body.temperature,
                body.top_p, None if body.seed is None else body.seed + index, body.stops,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                top_logprobs=(body.top_logprobs or 0) if body.logprobs else None))
        self.shown = [{"reasoning_content": "", "content": ""} for _ in self.rows]
        self.reported = [0] * body.n  # tokens whose logprobs a stream has sent
        self.finish: list[str | None] = [None] * body.n
        for row in self.rows:
            entry.batcher.submit(row)
        return self

    def _prompt_ids(self) -> tuple[list[int], bool]:
        """The prompt's tokens, and whether it continues the conversation's last (assistant) message: a prefill that
        the answer goes on from, as vLLM's continue_final_message, rather than a new turn after it."""
        try:
            conversation = formats.prompt([message.model_dump(exclude_none=True) for message in self.body.messages],
                                          self.body.tools)
            continuing = conversation["messages"][-1]["role"] == "assistant"
            return self.entry.chat.prompt_ids(conversation["messages"], conversation["tools"], continuing), continuing
        except (formats.BadRow, UserError) as error:
            raise RequestError(400, str(error), param="messages") from None

    def cancel(self) -> None:
        for row in self.rows:
            row.cancelled.set()

    async def whole(self, request: Request) -> JSONResponse:
        try:
            while None in self.finish:
                try:
                    index, _, reason = await asyncio.wait_for(self.queue.get(), timeout=1)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return JSONResponse({}, status_code=499)
                    continue
                if reason is not None:
                    self.finish[index] = self._finish_reason(reason)
        finally:
            self.cancel()  # rows already finished ignore it
        choices = []
        for index in range(len(self.rows)):
            message = {"role": "assistant", **self._texts(index, final=True)}
            if not message["reasoning_content"]:
                del message["reasoning_content"]
            choice = {"index": index, "message": message, "finish_reason": self.finish[index]}
            if self.body.logprobs:
                choice["logprobs"] = {"content": self._logprobs(index, 0)}
            choices.append(choice)
        return JSONResponse({"id": self.id, "object": "chat.completion", "created": self.created,
                             "model": self.body.model, "choices": choices, "usage": self._usage()})

    async def events(self):
        """Server-sent events as OpenAI streams them: a role, then text deltas, each choice's finish reason, the usage
        when asked for, and [DONE]. A client that goes away cancels its rows; the others go on."""
        try:
            for index in range(len(self.rows)):
                yield self._chunk(index, {"role": "assistant", "content": ""})
            while None in self.finish:
                index, _, reason = await self.queue.get()
                if reason is not None:
                    self.finish[index] = self._finish_reason(reason)
                delta = self._delta(index, final=reason is not None)
                if delta:
                    yield self._chunk(index, delta, logprobs=self._new_logprobs(index))
                if reason is not None:
                    yield self._chunk(index, {}, self.finish[index])
            if self.body.stream_options and self.body.stream_options.include_usage:
                yield _event({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                              "model": self.body.model, "choices": [], "usage": self._usage()})
            yield "data: [DONE]\n\n"
        finally:
            self.cancel()

    def _finish_reason(self, reason: str) -> str:
        if reason == "error":
            raise RequestError(500, "generation failed; the server log says why", kind="server_error")
        return "length" if reason == "length" else "stop"

    def _texts(self, index: int, final: bool) -> dict[str, str]:
        """The choice's reasoning and answer so far: the answer cut before a stop string, and while it streams held
        back by what could still become one."""
        row = self.rows[index]
        reply = self.entry.chat.parse(row.generated, final=final)
        answer = reply.answer
        for stop in self.body.stops:
            if stop in answer:
                answer, final = answer[:answer.index(stop)], True
        if not final and self.body.stops:
            hold = max(len(stop) for stop in self.body.stops) - 1
            answer = answer[:max(0, len(answer) - hold)]
        return {"reasoning_content": reply.thinking, "content": answer}

    def _delta(self, index: int, final: bool) -> dict[str, str]:
        delta = {}
        for key, text in self._texts(index, final).items():
            before = self.shown[index][key]
            if len(text) > len(before) and text.startswith(before):
                delta[key] = text[len(before):]
                self.shown[index][key] = text
        return delta

    def _chunk(self, index: int, delta: dict, finish_reason: str | None = None, logprobs: list | None = None) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason}
        if logprobs is not None:
            choice["logprobs"] = {"content": logprobs}
        return _event({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                       "model": self.body.model, "choices": [choice]})

    def _new_logprobs(self, index: int) -> list | None:
        """The logprobs of the tokens generated since the stream's last chunk (None: not asked for)."""
        if not self.body.logprobs:
            return None
        start, self.reported[index] = self.reported[index], len(self.rows[index].logprobs)
        return self._logprobs(index, start)

    def _logprobs(self, index: int, start: int) -> list[dict]:
        """OpenAI's logprobs entries of a choice's tokens from `start`: each token's log-probability under the model
        (before temperature, top_p and penalties), and the top_logprobs most likely tokens at its position."""
        tokenizer = self.entry.chat.tokenizer

        def entry(token: int, logprob: float) -> dict:
            text = tokenizer.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return [{**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
                for token, logprob, top in self.rows[index].logprobs[start:]]

    def _usage(self) -> dict:
        completion = sum(len(row.generated) for row in self.rows)
        return {"prompt_tokens": len(self.prompt), "completion_tokens": completion,
                "total_tokens": len(self.prompt) + completion}


def _never_ended(generated: list[int]) -> None:
    return None


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def load_served(targets) -> dict[str, Served]:
    """The targets (served_models.parse_targets) in memory: each base once, a batcher per loaded model."""
    from finetune.trained_model import saved_model, served_models
    from finetune.trained_model.batching import Batcher
    from finetune.trained_model.chat import Chat, renderer_of

    by_name = {target.name: target for target in targets}
    served = {}
    for loaded in served_models.load(targets):
        batcher = None
        for name, adapter in loaded.adapters.items():
            folder = by_name[name].folder
            tokenizer = saved_model.load_tokenizer(folder)
            chat = Chat.of(loaded.model, tokenizer, renderer_of(folder, tokenizer), folder.recipe.data.system_prompt)
            if batcher is None:
                pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(chat.end_ids)
                batcher = Batcher(loaded.model, pad, loaded.has_adapters)
            context = loaded.model.config.get_text_config().max_position_embeddings
            served[name] = Served(chat, batcher, adapter, context, int(time.time()))
    return served


def serve(arguments: list[str], host: str, port: int, api_key: str | None, max_request_mb: float) -> int:
    """Check the targets, load the models, and answer until interrupted."""
    import logging

    import uvicorn

    from finetune.trained_model import served_models

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("finetune.serve").addHandler(handler)
    logging.getLogger("finetune.serve").setLevel(logging.INFO)

    targets = served_models.parse_targets(arguments)
    served = load_served(targets)
    for target in targets:
        sharing = [name for name, entry in served.items() if entry.batcher is served[target.name].batcher]
        if len(sharing) == 1:
            print(f"serving {target.name}: {target.given}", flush=True)
        elif target.name == sharing[0]:
            print(f"serving {', '.join(sharing)} on one base model ({target.folder.base_model()})", flush=True)
    where = f"[{host}]" if ":" in host else host
    print(f"OpenAI-compatible API on http://{where}:{port}/v1 (models: GET /v1/models)"
          + ("; clients send the API key as their bearer token" if api_key else ""), flush=True)
    uvicorn.run(build_app(served, api_key, max_request_mb), host=host, port=port, log_level="warning")
    return 0
