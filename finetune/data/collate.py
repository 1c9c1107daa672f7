"""Batches of packed rows for attention implementations without variable-length kernels (sdpa, eager).

Each packed row stays a row of the batch; position_ids restart at every example, and transformers turns that into a
block-diagonal causal mask, so examples never attend to each other. Flattening the whole batch into one sequence
(TRL's padding-free collator) is right for FlashAttention, but costs (batch x length)^2 attention elsewhere.
Short rows are padded with a separate pad segment, which nothing attends to and which carries no loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from finetune.data.render import IGNORE


@dataclass
class PackedRowsCollator:
    pad_token_id: int

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(example["input_ids"]) for example in examples)
        input_ids, labels, positions = [], [], []
        for example in examples:
            pad = width - len(example["input_ids"])
            lengths = list(example["seq_lengths"]) + ([pad] if pad else [])
            row_labels = list(example["labels"]) + [IGNORE] * pad
            start = 0
            for length in lengths:
                row_labels[start] = IGNORE  # never predict one example's first token from the one before
                start += length
            input_ids.append(list(example["input_ids"]) + [self.pad_token_id] * pad)
            labels.append(row_labels)
            positions.append([p for length in lengths for p in range(length)])
        real = sum(len(example["input_ids"]) for example in examples)
        return {
            "input_ids": torch.tensor(input_ids),
            "labels": torch.tensor(labels),
            "position_ids": torch.tensor(positions),
            "num_real_tokens": torch.tensor(real),
        }
