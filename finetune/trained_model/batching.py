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
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # ... times the number of times it was
    top_logprobs: int | None = None  # None: no logprobs; else each token's and the N likeliest at its position
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    finished: str | None = None

    def __post_init__(self):
        self.generator = _generator(self.seed)  # here, so that a seed it cannot take fails this request alone

    def finish(self, reason: str) -> None:
        if self.finished is None:
            self.finished = reason
            if reason == "cancelled":
                log.info("a client left: its answer stopped after %d of up to %d tokens", len(self.generated),
                         self.max_new_tokens)
            try:
                self.deliver(None, reason)
            except Exception:  # noqa: BLE001  (its caller is gone; the others go on)
                log.exception("a request's caller could not be told that its answer ended")

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
                self._generate_isolated(batch)
            if closing:
                return

    def _generate_isolated(self, batch: list[Request]) -> None:
        """A fault while generating fails the request it belongs to, never its batch-mates: after a failed batch
        each unfinished request goes on alone from the tokens it has."""
        try:
            self._generate(batch)
            return
        except Exception:  # noqa: BLE001  (the thread serves the next batch)
            if len(batch) == 1:
                log.exception("generation failed for a request")
                batch[0].finish("error")
                return
            log.exception("generation failed for a batch of %d requests; each goes on alone", len(batch))
        for request in batch:
            if request.finished is None:
                self._generate_isolated([request])

    def _generate(self, batch: list[Request]) -> None:
        """Generate the batch's rows, each from its prompt and what it has generated so far."""
        inputs = [request.prompt + request.generated for request in batch]
        width = max(len(row) for row in inputs)
        device = self.model.device
        ids = torch.tensor([[self.pad] * (width - len(row)) + row for row in inputs], device=device)
        mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in inputs], device=device)
        rows = _Rows(batch)
        settings = {"adapter_names": [request.adapter for request in batch]} if self.adapters else {}
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids, attention_mask=mask,
                generation_config=GenerationConfig(
                    do_sample=False, max_new_tokens=max(r.max_new_tokens - len(r.generated) for r in batch),
                    pad_token_id=self.pad,
                    eos_token_id=[], use_cache=True),  # [], not None (which takes the model's): _Rows ends each row
                logits_processor=LogitsProcessorList([_RowSampling(batch)]),
                stopping_criteria=StoppingCriteriaList([rows]), **settings)
        for request in batch:
            request.finish("length")


class _RowSampling(LogitsProcessor):
    """Each row's next token as its own request samples it (penalties on what it generated; greedy at temperature
    0, else temperature and top_p, from the request's own random generator), handed to generate's greedy search as
    the only token left: a row's sample does not depend on which other rows share its batch. Records each token's
    log-probability under the model where the request asked for logprobs."""

    def __init__(self, batch: list[Request]):
        self.batch = batch

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        tokens = torch.empty(len(self.batch), dtype=torch.long, device=scores.device)
        for row, request in enumerate(self.batch):
            logits = scores[row].float()
            if request.generated and (request.presence_penalty or request.frequency_penalty):
                counts = torch.bincount(torch.tensor(request.generated), minlength=logits.numel())[:logits.numel()]
                logits = logits - request.frequency_penalty * counts.to(logits) \
                    - request.presence_penalty * (counts > 0).to(logits)
            tokens[row] = logits.argmax() if request.temperature == 0 else _sample(logits, request)
            if request.top_logprobs is not None and request.finished is None:
                logprobs = torch.log_softmax(scores[row].float(), dim=-1)
                top = logprobs.topk(request.top_logprobs) if request.top_logprobs else None
                request.logprobs.append((int(tokens[row]), float(logprobs[tokens[row]]),
                                         list(zip(top.indices.tolist(), top.values.tolist())) if top else []))
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens[:, None], 0)


def _sample(logits: torch.Tensor, request: Request) -> torch.Tensor:
    probabilities = torch.softmax(logits / request.temperature, dim=-1)
    if request.top_p < 1:
        ordered, order = probabilities.sort(descending=True)
        outside = ordered.cumsum(-1) - ordered > request.top_p  # the smallest set above top_p stays
        probabilities = probabilities.scatter(0, order, ordered.masked_fill(outside, 0))
    return torch.multinomial(probabilities, 1, generator=request.generator)[0]


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
                try:  # its caller's callbacks: a fault there ends this row only
                    request.deliver(token, None)
                    reason = request.reason_to_stop()
                except Exception:  # noqa: BLE001
                    log.exception("a request failed while its tokens were handed over")
                    reason = "error"
                if reason is not None:
                    request.finish(reason)
            done.append(request.finished is not None)
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)
