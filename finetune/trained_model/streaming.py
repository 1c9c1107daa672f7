"""What chat hands to transformers' `generate`: a streamer that passes on token ids as they are generated, and the
stop at the end of GPT-OSS's final message. Imported only where a model generates (it imports torch)."""

from __future__ import annotations

import queue
from collections.abc import Callable

import torch
from transformers import StoppingCriteria
from transformers.generation import BaseStreamer


class TokenQueue(BaseStreamer):
    """The reading side gets each step's new token ids as a list from `queue`, then None at the end."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:  # generate hands over the prompt first
            self.queue.put(value.reshape(-1).tolist())
        self._prompt_seen = True

    def end(self) -> None:
        self.queue.put(None)


class FinalMessageEnd(StoppingCriteria):
    """Per row: stop once the tokens after `width` (the prompt) end a final message; GPT-OSS's <|end|> also closes
    its reasoning, so the end token alone cannot say."""

    def __init__(self, ended_by: Callable[[list[int]], object], width: int):
        self.ended_by, self.width = ended_by, width

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.tensor([self.ended_by(row[self.width:].tolist()) is not None for row in input_ids],
                            dtype=torch.bool, device=input_ids.device)
