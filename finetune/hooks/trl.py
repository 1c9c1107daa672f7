"""TRL's trainers (1.14): what the run's trainers set inside them. TRL has no setting for a token count that knows
packed rows' padding, for taking already-tokenized preference data as it is, or for GRPO's prompt template beside
the tokenizer's."""

from __future__ import annotations

from finetune.hooks import check_pin

HOOKS = ("SFTTrainer._total_train_tokens", "SFTTrainer._metrics", "DPOTrainer._prepare_dataset",
         "KTOTrainer._prepare_dataset", "GRPOTrainer.chat_template")
check_pin("trl", "1.14.2", HOOKS)


def report_tokens(trainer, real: int, trained: int) -> None:
    """The logged token counts: TRL counts a (rows x width) batch without attention_mask as width tokens each row."""
    trainer._total_train_tokens = real
    trainer._metrics["train"]["num_tokens"] = [real]
    trainer._metrics["train"]["trained_tokens"] = [trained]


class PreparedData:
    """Mixed in before DPOTrainer or KTOTrainer: the data comes tokenized with exact masks (data/stage_rows.py), and
    TRL would tokenize it again in _prepare_dataset; the class it is mixed into says what it adds (`prepared`)."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return self.prepared(dataset, args)


def render_prompts_with(trainer, template: str, template_kwargs: dict) -> None:
    """GRPO renders its prompts with `chat_template` (set from the tokenizer in its __init__): the run's template
    and template variables instead, so prompts render as the data was."""
    trainer.chat_template = template
    trainer.chat_template_kwargs = template_kwargs
