"""Many chat requests at once on one loaded model: requests wait in a queue, and those waiting when the model is free
are generated together as one left-padded batch through transformers' `generate`. Each row keeps what its request
asked for: its adapter (PEFT's mixed-adapter batches: several fine-tunes and their base in one forward), sampling
(temperature, top_p, a seed of its own), its stops and length; its tokens reach its caller as they are generated,
and a caller that goes away stops its row while the others go on.

The batch is formed when the model is free (a request that arrives meanwhile waits for the next one), not token by
token as transformers' continuous batching does: that scheduler runs one model with one set of weights, and the rows
here may each need another adapter. Imported only where a model generates (it imports torch).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

BASE = "__base__"  # PEFT's name for "no adapter" in a mixed batch
MAX_BATCH = 32
# A batch's first request waits for those that clients sent at the same moment (each takes the server a few
# milliseconds to read and render): while another comes within GATHER_S, for at most MAX_GATHER_S in all.
GATHER_S, MAX_GATHER_S = 0.01, 0.05
log = logging.getLogger("finetune.serve")


@dataclass
class Request:
    """One row of a batch. `deliver` is called on the generation thread with each new token id, then with None and
    the reason it ended ("stop": an end token or a stop string, "length": max_new_tokens, "cancelled")."""

    prompt: list[int]
    max_new_tokens: int
    deliver: Callable[[int | None, str | None], None]
    ended_by: Callable[[list[int]], object]  # the end token that closes these tokens, or None
    decode: Callable[[list[int]], str]
    adapter: str = BASE
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: list[int] = field(default_factory=list)
    finished: str | None = None

    def finish(self, reason: str) -> None:
        if self.finished is None:
            self.finished = reason
            if reason == "cancelled":
                log.info("a client left: its answer stopped after %d of up to %d tokens", len(self.generated),
                         self.max_new_tokens)
            self.deliver(None, reason)

    def reason_to_stop(self) -> str | None:
        if self.cancelled.is_set():
            return "cancelled"
        if self.generated and self.ended_by(self.generated) is not None:
            return "stop"
        if self.stop and any(text in self.decode(self.generated) for text in self.stop):
            return "stop"
        return "length" if len(self.generated) >= self.max_new_tokens else None


class Batcher:
    """A generation thread for one model: `submit` queues a request; `close` ends the thread after its batch."""

    def __init__(self, model, pad_token_id: int, adapters: bool):
        self.model, self.pad, self.adapters = model, pad_token_id, adapters
        self._waiting: queue.Queue[Request | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="finetune-generation", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> None:
        self._waiting.put(request)

    def close(self) -> None:
        self._waiting.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while (first := self._waiting.get()) is not None:
            batch, gathered_by = [first], time.monotonic() + MAX_GATHER_S
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._waiting.get(timeout=max(0.0, min(GATHER_S, gathered_by - time.monotonic()))))
                except queue.Empty:
                    break
            closing = None in batch
            for request in batch:
                if request is not None and request.cancelled.is_set():  # its client left while it waited
                    request.finish("cancelled")
            batch = [request for request in batch if request is not None and request.finished is None]
            if batch:
                try:
                    self._generate(batch)
                except Exception:  # noqa: BLE001  (each caller gets its end; the thread serves the next batch)
                    log.exception("generation failed for a batch of %d requests", len(batch))
                    for request in batch:
                        request.finish("error")
            if closing:
                return

    def _generate(self, batch: list[Request]) -> None:
        width = max(len(request.prompt) for request in batch)
        device = self.model.device
        ids = torch.tensor([[self.pad] * (width - len(r.prompt)) + r.prompt for r in batch], device=device)
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=device)
        rows = _Rows(batch)
        settings = {"adapter_names": [request.adapter for request in batch]} if self.adapters else {}
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids, attention_mask=mask,
                generation_config=GenerationConfig(
                    do_sample=False, max_new_tokens=max(r.max_new_tokens for r in batch), pad_token_id=self.pad,
                    eos_token_id=[], use_cache=True),  # [], not None (which takes the model's): _Rows ends each row
                logits_processor=LogitsProcessorList([_RowSampling(batch)]),
                stopping_criteria=StoppingCriteriaList([rows]), **settings)
        for request in batch:
            request.finish("length")


class _RowSampling(LogitsProcessor):
    """Each row's next token as its own request samples it (greedy at temperature 0; else temperature and top_p, from
    the request's own random generator when it gave a seed), handed to generate's greedy search as the only token
    left: a row's sample does not depend on which other rows share its batch."""

    def __init__(self, batch: list[Request]):
        self.batch = batch
        self.generators = [_generator(request.seed) for request in batch]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        tokens = scores.argmax(dim=-1)
        for row, request in enumerate(self.batch):
            if request.temperature > 0:
                probabilities = torch.softmax(scores[row].float() / request.temperature, dim=-1)
                if request.top_p < 1:
                    ordered, order = probabilities.sort(descending=True)
                    outside = ordered.cumsum(-1) - ordered > request.top_p  # the smallest set above top_p stays
                    probabilities = probabilities.scatter(0, order, ordered.masked_fill(outside, 0))
                tokens[row] = torch.multinomial(probabilities, 1, generator=self.generators[row])
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens[:, None], 0)


def _generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


class _Rows(StoppingCriteria):
    """Called by generate after each step's tokens join the batch: hands each row's new token to its request, and
    stops a row whose request is done (a finished row's later tokens go nowhere)."""

    def __init__(self, batch: list[Request]):
        self.batch = batch

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = []
        for request, token in zip(self.batch, input_ids[:, -1].tolist()):
            if request.finished is None:
                request.generated.append(token)
                request.deliver(token, None)
                if (reason := request.reason_to_stop()) is not None:
                    request.finish(reason)
            done.append(request.finished is not None)
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)
