"""transformers (5.17): the private methods of the Trainer that the run's trainer overrides, each handing over to a
method of the class it is mixed into (training/trainers.py says what each does), and what else a run needs of
transformers' internals. The Trainer offers callbacks, but a callback cannot choose the sampler, skip the
fast-forward of a resumed epoch, undo a checkpoint half written, or restore an optimizer state to several CPU
processes."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import transformers.trainer

from finetune.hooks import check_pin

HOOKS = ("Trainer._get_train_sampler", "Trainer._run_epoch", "trainer.skip_first_batches",
         "Trainer._maybe_log_save_evaluate", "Trainer._save_checkpoint", "Trainer._get_output_dir",
         "Trainer._save_optimizer_and_scheduler", "Trainer._load_optimizer_and_scheduler", "Trainer._save",
         "Trainer.set_initial_training_values", "GptOssModel.forward's masks", "trainer_utils' resume warning")
check_pin("transformers", "5.17.0", HOOKS)


class TrainerHooks:
    """Mixed in before transformers' Trainer (or a TRL trainer built on it)."""

    def _get_train_sampler(self, train_dataset=None):
        # The Trainer builds its data loader itself: the only way in for a sampler of our own.
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        sampler = self.training_order(dataset)
        return sampler if sampler is not None else super()._get_train_sampler(train_dataset)

    def _run_epoch(self, **kwargs):
        # Resuming inside an epoch, the Trainer draws and drops every batch before the checkpoint's, calling the
        # module's skip_first_batches by name, with no setting to turn it off; our sampler starts at the right batch
        # instead, so for that epoch the call hands the data loader back as it is.
        resuming = kwargs["resume_from_checkpoint"] is not None and kwargs["epoch"] == kwargs["epochs_trained"]
        done = kwargs["steps_trained_in_current_epoch"] if resuming else 0
        if not done or not self.start_epoch_at(kwargs["epoch"], done):
            return super()._run_epoch(**kwargs)
        with _batches_not_skipped():
            return super()._run_epoch(**kwargs)

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, *args, **kwargs):
        # Every process passes here once per optimizer step, with the step's loss and gradient norm, before the step
        # is logged and saved: callbacks get neither the loss tensor nor a say in the save.
        self.before_log_and_save(tr_loss, grad_norm)
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, *args, **kwargs)
        self.after_log_and_save()

    def _save_checkpoint(self, model, trial):
        # The checkpoint is written here, where a failed write can still be undone on every process.
        folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
        self.save_checkpoint_whole(folder, lambda: super(TrainerHooks, self)._save_checkpoint(model, trial))

    def _save_optimizer_and_scheduler(self, output_dir):
        # The test faults stop a run here, in the middle of writing a checkpoint.
        self.before_optimizer_saved(Path(output_dir))
        super()._save_optimizer_and_scheduler(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Where the Trainer restores the optimizer: several CPU processes need another map_location, and the
        # learning rate of a run made longer is planned again.
        if checkpoint is None or not self.load_optimizer_state(Path(checkpoint)):
            super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.after_optimizer_loaded()

    def _save(self, output_dir=None, state_dict=None):
        # Every save of the model (checkpoints and final/) ends here.
        super()._save(output_dir, state_dict)
        self.after_model_saved(Path(output_dir or self.args.output_dir))

    def planned_steps(self) -> int:
        """The optimizer steps the run trains in all, as the Trainer plans them (max_steps, or its epochs): its
        undocumented set_initial_training_values is where it counts them."""
        return self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]


def hide_resume_arguments_warning() -> None:
    """Keep out the warning transformers' trainer_utils logs when a resumed run's batch split or steps differ from
    its checkpoint's: the resume plan checked them (the global batch stays) and said what changed in a note of its
    own. The warning has no switch of its own; it is known by its text."""
    logging.getLogger("transformers.trainer_utils").addFilter(_not_the_resume_arguments_warning)


def _not_the_resume_arguments_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Warning: The following arguments do not match")


def isolate_packed_examples(model) -> None:
    """Keep packed examples from attending to each other in GPT-OSS.

    transformers (5.17) builds the attention masks of most models from position_ids, so examples packed in one row
    (positions restarting at 0) see only themselves; GptOssModel.forward leaves position_ids out of its mask
    calls, and under eager or sdpa attention every example would attend to the ones before it. A hook on the
    decoder builds the masks from position_ids and hands them in, as `generate` does with precomputed masks.
    Upstream: https://github.com/huggingface/transformers/pull/39997 (open) passes position_ids there."""
    if model.config.model_type != "gpt_oss":
        return
    import torch
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    def with_masks(decoder, args, kwargs):
        positions = kwargs.get("position_ids")
        if positions is None or kwargs.get("attention_mask") is not None or kwargs.get("past_key_values") is not None:
            return None
        shape_only = torch.empty(*positions.shape, 0, dtype=decoder.embed_tokens.weight.dtype, device=positions.device)
        mask = dict(config=decoder.config, inputs_embeds=shape_only, attention_mask=None, past_key_values=None,
                    position_ids=positions)
        kwargs["attention_mask"] = {"full_attention": create_causal_mask(**mask),
                                    "sliding_attention": create_sliding_window_causal_mask(**mask)}
        return args, kwargs

    model.get_decoder().register_forward_pre_hook(with_masks, with_kwargs=True)


@contextlib.contextmanager
def _batches_not_skipped():
    skip = transformers.trainer.skip_first_batches
    transformers.trainer.skip_first_batches = lambda dataloader, num_batches=0: dataloader
    try:
        yield
    finally:
        transformers.trainer.skip_first_batches = skip
