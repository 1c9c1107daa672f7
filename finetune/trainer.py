"""TRL's SFTTrainer, counting real (non-padding) tokens and the tokens that carry loss, for progress.jsonl."""

from __future__ import annotations

import torch
from trl import SFTTrainer

from finetune.data.render import IGNORE


class Trainer(SFTTrainer):
    _real_tokens = 0
    _trained_tokens = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        real = inputs.pop("num_real_tokens", None)  # from PackedRowsCollator; not a model input
        if self.model.training:
            if real is None:
                real = inputs["attention_mask"].sum() if "attention_mask" in inputs else inputs["input_ids"].numel()
            trained = (inputs["labels"][..., 1:] != IGNORE).sum()
            counts = torch.stack([torch.as_tensor(real, device=trained.device), trained]).reshape(1, 2)
            real_sum, trained_sum = self.accelerator.gather_for_metrics(counts).sum(dim=0).tolist()
            self._real_tokens += int(real_sum)
            self._trained_tokens += int(trained_sum)
            self._metrics["train"]["real_tokens"] = [self._real_tokens]
            self._metrics["train"]["trained_tokens"] = [self._trained_tokens]
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
