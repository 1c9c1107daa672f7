"""TRL's SFTTrainer, counting real (non-padding) tokens and the tokens that carry loss, for progress.jsonl."""

from __future__ import annotations

import torch
from trl import SFTTrainer

from finetune.data.render import IGNORE
from finetune.data.sampler import SimilarLengthSampler


class Trainer(SFTTrainer):
    _real_tokens = 0
    _trained_tokens = 0

    def __init__(self, *args, similar_lengths: bool = True, **kwargs):
        self.similar_lengths = similar_lengths
        super().__init__(*args, **kwargs)

    def _get_train_sampler(self, train_dataset=None):
        if not self.similar_lengths:
            return super()._get_train_sampler(train_dataset)
        import pyarrow.compute as pc

        dataset = train_dataset if train_dataset is not None else self.train_dataset
        lengths = pc.list_value_length(dataset.with_format("arrow")[:]["input_ids"]).to_pylist()
        global_batch = self.args.per_device_train_batch_size * self.args.world_size * self.args.gradient_accumulation_steps
        return SimilarLengthSampler(lengths, global_batch, self.args.data_seed or self.args.seed)

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
        result = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if self.model.training:
            # TRL counts a (rows x width) batch without attention_mask as `width` tokens; report the real count.
            self._total_train_tokens = self._real_tokens
            self._metrics["train"]["num_tokens"] = [self._real_tokens]
            self._metrics["train"]["trained_tokens"] = [self._trained_tokens]
        return result
