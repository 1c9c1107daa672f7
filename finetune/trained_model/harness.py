"""lm-evaluation-harness tasks for `finetune eval --tasks`: lm-eval's own, the toolkit's (finetune/eval_tasks) and
the user's task folders, run on the model as chat loaded it."""

from __future__ import annotations


from finetune.errors import UserError
from finetune.resources import eval_tasks_dir


def run_tasks(chat, tasks: list[str], include: list[str], batch_size: int, limit: int | None) -> dict[str, float]:
    """lm-evaluation-harness tasks on the loaded model (the base with the adapter on it), through its Python API,
    prompted through the chat template. Tasks are found among lm-eval's own, the toolkit's (eval_tasks/) and the
    folders in `include`. {task/metric: value}."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError("--tasks needs lm-evaluation-harness: pip install -e \".[eval]\"") from None
    manager = TaskManager(include_path=[str(eval_tasks_dir()), *include], verbosity="ERROR")
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise UserError(f"--tasks {unknown[0]}: lm-evaluation-harness knows no such task; add the folder of its "
                        "YAML definition with --include-tasks")
    lm = HFLM(pretrained=chat.model, tokenizer=chat.tokenizer, batch_size=batch_size)
    output = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                     apply_chat_template=bool(chat.tokenizer.chat_template), log_samples=False,
                                     verbosity="ERROR")
    scores = {}
    for task, values in output["results"].items():
        for key, value in values.items():
            metric, _, _filter = key.partition(",")
            if isinstance(value, (int, float)) and not metric.endswith("_stderr") and metric != "sample_len":
                scores[f"{task}/{metric}" + (f" ({_filter})" if _filter not in ("", "none") else "")] = value
    return scores
