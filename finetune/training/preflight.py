"""The one check before a run: everything that can be found wrong without loading weights, in the order a user
fixes it. `finetune validate`, `finetune train` (before it launches processes, with accelerate or Ray) and every
training process at its start call `check`, so whatever a training process would refuse, validate refuses first,
with the same message."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

from finetune.data.pipeline import PreparedData, prepare
from finetune.models import backends
from finetune.models.loading import check_attention, check_token_ids, load_tokenizer, model_config
from finetune.plan import memory_plan
from finetune.recipe import stage_sections
from finetune.recipe.train_section import check_device_options, trains_on_cpu
from finetune.run_folder import check_free, check_writable, read_rows
from finetune.training import resuming


@dataclass(frozen=True)
class Launch:
    """What the launch says about the processes that will train."""
    processes: int = 1
    distributed_type: str = "NO"  # accelerate's: NO, MULTI_GPU, FSDP, DEEPSPEED, ...
    use_cpu: bool = False  # the launch itself asks for the CPU (Ray without GPUs)

    @classmethod
    def of(cls, settings: dict | None) -> Launch:
        """From an accelerate config read as a mapping (or Ray's equivalent); None: one process."""
        settings = settings or {}
        return cls(memory_plan.launch_of(settings).processes, str(settings.get("distributed_type") or "NO"),
                   bool(settings.get("use_cpu")))


@dataclass
class Checked:
    backend: str
    why: str  # the line that says which backend and why
    tokenizer: object
    model_type: str
    data: PreparedData
    resume: resuming.ResumePoint | None = None
    notes: list[str] = field(default_factory=list)  # what a resumed run continues with, said by the run


def check(recipe, launch: Launch, resume: bool | str = False, validating: bool = False, say=None,
          one_at_a_time=contextlib.nullcontext) -> Checked:
    """Raises a UserError for the first thing to fix; else the backend, tokenizer and prepared (cached) data.
    `validating`: an existing run in output_dir is a note, not a refusal. `say` (print, for one) gets the backend line
    as soon as it is known. `one_at_a_time`: a context in which the processes of a launch load the tokenizer and
    prepare the data, the first process of each machine before the others (they then read its cache)."""
    import torch

    model_type = functools.partial(backends.model_type_of, recipe.model.name_or_path, recipe.model.revision)
    backend, why = backends.resolve(recipe.model.backend, recipe.stage, recipe.train, launch.distributed_type,
                                    model_type)
    if say:
        say(why, flush=True)
    cuda = torch.cuda.is_available() and not launch.use_cpu and not trains_on_cpu(recipe.train)
    check_device_options(recipe.train, cuda=cuda)
    stage_sections.check_device_options(recipe, cuda=cuda)
    recipe.batch_split(launch.processes, 1 if recipe.auto_micro_batch else None)
    backends.check_launch(backend, launch.distributed_type)
    point, notes = None, []
    if resume:
        point, notes = resuming.plan(recipe, resume, launch.processes)
    elif validating and read_rows(recipe.output_dir):
        notes = [f"output_dir {recipe.output_dir} holds a run already; `finetune train` continues it with --resume, "
                 "or needs another output_dir"]
    else:
        check_free(recipe.output_dir)
    check_writable(recipe.output_dir)
    with one_at_a_time():
        tokenizer = load_tokenizer(recipe)
        config = model_config(recipe)  # a model that cannot load is found before the data is read
        check_token_ids(tokenizer, config)
        check_attention(recipe, config)
        backends.check_packing(backend, config.model_type, recipe.train_setting("packing"))
        data = prepare(recipe, tokenizer, tokenizer.chat_template)
    return Checked(backend, why, tokenizer, config.model_type, data, point, notes)
