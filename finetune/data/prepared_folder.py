"""A folder of prepared data, and what produced it.

    train/               the training rows: Arrow shards (000000.arrow, ...), in order, memory-mapped when read
    eval/                the eval rows, when there is an eval split
    report.json          what happened to the data: rows, tokens, bad rows, lengths, one marked example
    eval_examples.json   the first held-out examples, normalized (the prompts of eval.samples)
    prepared.json        what produced the folder: its data, settings, tokenizer, template and code (INPUTS)

A folder is complete when it has prepared.json: everything is written into a staging folder beside it, which takes
the folder's name in one rename, so a preparation killed half-way is never read as complete (its staging folder is
removed by the next preparation of the same folder).

Why Arrow shards and not MDS: training reads rows by index from memory-mapped files, so each DDP process takes
exactly the rows the sampler gives it (the map-style order, batches of similar lengths, unchanged), memory holds
the pages in use rather than the dataset, and a resumed run starts at its batch without reading the batches before
it. A streaming format (Mosaic's MDS) reads in shard order and resumes through its own position, which would give
other batches than the map-style path and another resume mechanism to keep exact; it would also be one more
dependency for what datasets already does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.data import eval_sets
from finetune.errors import UserError

INPUTS = "prepared.json"
REPORT = "report.json"
EVAL_EXAMPLES = "eval_examples.json"
FORMAT = 1  # of the folder; a folder of another format is prepared again
NOT_SETTINGS = ("train", "eval", "prepared", "num_proc")  # the data itself, where it is, and how fast it is made


@dataclass
class PreparedData:
    train: Any  # datasets.Dataset
    eval: Any | None
    report: dict[str, Any]
    eval_examples: list[dict] = dataclasses.field(default_factory=list)  # the first held-out examples, normalized


def inputs_of(recipe, tokenizer, template: str | None, train_sources: list, eval_sources: list) -> dict[str, Any]:
    """What the prepared rows depend on, each part as it is compared: the data files' contents (with each mixture
    entry's share), the recipe's data settings, the tokenizer, the template, and the code that prepares."""
    from importlib.metadata import version

    entries = recipe.data.train if isinstance(recipe.data.train, list) else [recipe.data.train]
    shares = [{key: entry[key] for key in ("rows", "fraction", "weight") if key in entry} if isinstance(entry, dict)
              else {} for entry in entries]
    data = {key: value for key, value in dataclasses.asdict(recipe.data).items() if key not in NOT_SETTINGS}
    code = [path.read_text(encoding="utf-8") for path in sorted(Path(__file__).parent.glob("*.py"))]
    return {
        "format": FORMAT,
        "data": {"train": [{"contents": source.fingerprint(), **share} for source, share in zip(train_sources, shares)],
                 "eval": [{"contents": source.fingerprint()} for source in eval_sources]},
        "decontaminate": [eval_sets.fingerprint(spec) for spec in recipe.data.decontaminate],
        "settings": {**{f"data.{key}": value for key, value in data.items()},
                     "train.max_length": recipe.train_setting("max_length"),
                     "train.packing": recipe.train_setting("packing"), "train.seed": recipe.train_setting("seed"),
                     "stage": recipe.stage},
        "tokenizer": {"sha256": _sha256([tokenizer.backend_tokenizer.to_str(), tokenizer.special_tokens_map])},
        "template": {"sha256": _sha256(template)},
        "code": {"sha256": _sha256(code),
                 # rendering and masks (transformers, tokenizers), packing and training templates (trl), the format
                 # on disk (datasets)
                 "libraries": {name: version(name) for name in ("trl", "transformers", "tokenizers", "datasets")}},
        "about": {"tokenizer": recipe.model.name_or_path},  # for messages: the same tokenizer may load from elsewhere
    }


def key_of(inputs: dict[str, Any]) -> str:
    return _sha256(_compared(inputs))[:24]


def matches(found: dict[str, Any] | None, inputs: dict[str, Any]) -> bool:
    """Whether a folder prepared from `found` holds the rows `inputs` would give."""
    return found is not None and _compared(found) == _compared(inputs)


def _compared(inputs: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in inputs.items() if key != "about"}


def _sha256(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def differences(prepared: dict[str, Any], now: dict[str, Any], with_data: bool) -> list[str]:
    """What differs between the inputs a folder was prepared from and the recipe's now, one line each, in the
    recipe's words; the data files only `with_data` (the recipe names them)."""
    lines = []
    if prepared.get("format") != now["format"]:
        return [f"it is a prepared folder of format {prepared.get('format')}, this finetune reads format "
                f"{now['format']}"]
    if with_data and prepared["data"] != now["data"]:
        lines.append("data.train / data.eval: the data files (or their shares) are not those it was prepared from")
    if prepared.get("decontaminate") != now["decontaminate"]:
        lines.append("data.decontaminate: the evaluation sets' contents are not those it was checked against")
    for key, value in now["settings"].items():
        if prepared["settings"].get(key) != value:
            lines.append(f"{key}: prepared with {prepared['settings'].get(key)!r}, the recipe has {value!r}")
    if prepared["tokenizer"]["sha256"] != now["tokenizer"]["sha256"]:
        lines.append(f"the tokenizer: prepared with {prepared['about']['tokenizer']}'s, which differs from "
                     f"{now['about']['tokenizer']}'s")
    if prepared["template"] != now["template"]:
        lines.append("the chat template: prepared with another one (model.chat_template or the tokenizer's)")
    if prepared["code"] != now["code"]:
        changed = {name: (was, now["code"]["libraries"][name]) for name, was in prepared["code"]["libraries"].items()
                   if was != now["code"]["libraries"].get(name)}
        lines.append("the code that prepares data: " + (", ".join(f"{name} {was} then, {is_} now"
                                                                  for name, (was, is_) in changed.items())
                                                        or "another version of finetune's data code"))
    return lines


def read_inputs(folder: Path) -> dict[str, Any] | None:
    """The inputs a complete folder was prepared from; None for a folder that is not one."""
    try:
        return json.loads((folder / INPUTS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def staging(folder: Path) -> Path:
    """A new staging folder for `folder`, beside it; those that earlier preparations on this machine left when they
    were killed half-way are removed (a folder on a shared filesystem may be another machine's, still at work)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    for stale in folder.parent.glob(f".{folder.name}.prepare-{host}-*"):
        if not _alive(int(stale.name.rsplit("-", 1)[1])):
            shutil.rmtree(stale, ignore_errors=True)
    path = folder.parent / f".{folder.name}.prepare-{host}-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def publish(staged: Path, folder: Path, inputs: dict[str, Any]) -> None:
    """`staged` becomes `folder` in one rename, replacing an older preparation there; another process that finished
    the same preparation first wins."""
    (staged / INPUTS).write_text(json.dumps(inputs, indent=1), encoding="utf-8")
    if folder.exists():
        if matches(read_inputs(folder), inputs):  # another process prepared the same, first
            shutil.rmtree(staged)
            return
        replaced = folder.parent / f".{folder.name}.replaced-{os.getpid()}"
        folder.rename(replaced)
        staged.rename(folder)
        shutil.rmtree(replaced)
        return
    staged.rename(folder)


def check_target(folder: Path) -> None:
    """`prepare --out` writes only an empty folder or one that holds a preparation."""
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--out {folder} is a file; give a folder for the prepared data")
    if folder.is_dir() and any(folder.iterdir()) and read_inputs(folder) is None:
        raise UserError(f"--out {folder} holds other files (no {INPUTS}): give an empty or new folder, or one that "
                        "finetune prepare wrote")


def load(folder: Path) -> PreparedData:
    report = read_report(folder)
    evaluation = _shards(folder / "eval") if (folder / "eval").is_dir() else None
    examples = json.loads((folder / EVAL_EXAMPLES).read_text(encoding="utf-8"))
    return PreparedData(_shards(folder / "train"), evaluation, report, examples)


def read_report(folder: Path) -> dict[str, Any]:
    return json.loads((folder / REPORT).read_text(encoding="utf-8"))


def _shards(folder: Path):
    """A split's shards as one Dataset, memory-mapped: rows are read where they lie, none copied."""
    import datasets
    from datasets.table import MemoryMappedTable

    return datasets.concatenate_datasets([datasets.Dataset(MemoryMappedTable(_mapped_for_random_reads(path), str(path)))
                                          for path in sorted(folder.glob("*.arrow"))])


def _mapped_for_random_reads(path: Path):
    """A shard's table, memory-mapped with the kernel told that reads are random. Mapped as datasets maps it
    (Dataset.from_file), reading each record batch's header made the kernel read ahead around it, which on a disk
    with a large read-ahead (8 MB on the machine this was measured on) read every shard whole before the first step:
    the 809 MB of 200,000 conversations, where this reads 1 MB. Training reads its rows in random order anyway."""
    import pyarrow as pa

    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mapped, "madvise"):  # (not on Windows)
        mapped.madvise(mmap.MADV_RANDOM)
    return pa.ipc.open_stream(pa.BufferReader(pa.py_buffer(mapped))).read_all()


def is_url(location: str) -> bool:
    """Whether `location` is a URL that fsspec reaches (s3://, gs://, ...), not a path here (file:// is one)."""
    return "://" in location and not location.startswith("file://")


def local_path(location: str) -> Path:
    return Path(location.removeprefix("file://")).expanduser()


def local_copy(location: str, cache: Path) -> Path:
    """A local folder for `location`: itself, or for a URL (s3://, gs://, ... through fsspec) a copy in `cache`,
    made once per machine and read memory-mapped like a local folder."""
    if not is_url(location):
        return local_path(location)
    import fsspec

    filesystem, path = fsspec.core.url_to_fs(location)
    path = path.rstrip("/")
    inputs = _remote_inputs(filesystem, path)
    if inputs is None:
        raise UserError(f"data.prepared: {location} has no {INPUTS}: not a complete prepared folder (run finetune "
                        "prepare RECIPE --out to it)")
    local = cache / f"prepared-{key_of(inputs)}"
    if not matches(read_inputs(local), inputs):
        staged = staging(local)
        filesystem.get(f"{path}/", str(staged), recursive=True)
        (staged / INPUTS).unlink()  # publish writes it last
        publish(staged, local, inputs)
    return local


def upload(folder: Path, location: str) -> bool:
    """Copy a complete folder to a URL (fsspec), prepared.json last: a reader never takes a half-copied one.
    Whether it copied (not when the same preparation is there)."""
    import fsspec

    filesystem, path = fsspec.core.url_to_fs(location)
    path = path.rstrip("/")
    if matches(_remote_inputs(filesystem, path), read_inputs(folder)):
        return False
    if filesystem.exists(f"{path}/{INPUTS}"):
        filesystem.rm(f"{path}/{INPUTS}")
    for file in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != INPUTS):
        filesystem.put_file(str(file), f"{path}/{file.relative_to(folder).as_posix()}")
    filesystem.put_file(str(folder / INPUTS), f"{path}/{INPUTS}")
    return True


def _remote_inputs(filesystem, path: str) -> dict[str, Any] | None:
    try:
        return json.loads(filesystem.cat_file(f"{path}/{INPUTS}"))
    except FileNotFoundError:
        return None
