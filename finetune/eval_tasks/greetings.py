"""The data of the finetune_greetings task: 100 prompts of the quickstart's task with words its training data
never has, shipped with the package so the task runs without a download."""

from pathlib import Path


def load(**kwargs):
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(Path(__file__).parent / "greetings.jsonl")})
