"""The trainers of the preference and reward stages: TRL's, bound to the run folder like SFT's (RunFolderTrainer).

Their data comes prepared by the pipeline (data/stage_rows.py), already tokenized with exact masks: DPO and KTO
take it as is instead of tokenizing again. With an adapter (LoRA, QLoRA) TRL's reference model is the same model
with the adapter switched off (or, for an adapter trained before, a frozen copy of that adapter): never a second
copy of the weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from trl import DPOTrainer, GRPOTrainer, KTOTrainer

from finetune.sft_trainer import RunFolderTrainer, RunTrainer


class _SavedWithoutReference:
    """TRL keeps the reference of an adapter trained before as a frozen copy named "ref", which PEFT would save beside
    the trained one: the model and its checkpoints keep the trained adapter only (a resumed run copies the reference
    again from model.adapter)."""

    def _save(self, output_dir=None, state_dict=None):
        super()._save(output_dir, state_dict)
        shutil.rmtree(Path(output_dir or self.args.output_dir) / "ref", ignore_errors=True)


class DpoRunTrainer(_SavedWithoutReference, RunFolderTrainer, DPOTrainer):
    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset  # prompt_ids, chosen_ids, rejected_ids


class KtoRunTrainer(_SavedWithoutReference, RunFolderTrainer, KTOTrainer):
    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if not self.calculate_KL:
            return dataset

        def mismatched(batch):
            # KTO's KL term: each prompt with another row's answer, as TRL pairs them (the batch shifted by one)
            batch["KL_completion_ids"] = [batch["completion_ids"][-1]] + batch["completion_ids"][:-1]
            return batch

        return dataset.map(mismatched, batched=True, batch_size=args.per_device_train_batch_size)


class GrpoRunTrainer(RunFolderTrainer, GRPOTrainer):
    pass


def build(stage: str, *, data_collator, renderer, reward_functions, reference, **kwargs):
    """The stage's trainer. `reference`: DPO's and KTO's reference model, None where TRL needs none. kwargs: those of
    RunFolderTrainer and of TRL's trainers that every stage takes."""
    if stage == "sft":
        return RunTrainer(data_collator=data_collator, **kwargs)
    kwargs["similar_lengths"] = False  # TRL's own order (GRPO's groups of generations need its sampler)
    if stage == "dpo":
        return DpoRunTrainer(ref_model=reference, **kwargs)
    if stage == "kto":
        return KtoRunTrainer(ref_model=reference, **kwargs)
    trainer = GrpoRunTrainer(reward_funcs=reward_functions, **kwargs)
    trainer.chat_template = renderer.template  # prompts rendered as the data was, on the same fixed date
    trainer.chat_template_kwargs = renderer.template_kwargs
    return trainer
