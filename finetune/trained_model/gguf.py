"""GGUF exports made and checked by the pinned llama.cpp (`pip install -e ".[gguf]"`: llama-cpp-python 0.3.36).

The converter (convert_hf_to_gguf.py with its conversion/ package and its own gguf-py, which differs from PyPI's
`gguf` of the same version) is not in llama-cpp-python's wheel but in the sdist of the same release: `converter()`
fetches that sdist once through pip into $FINETUNE_HOME, checks its hash and keeps the converter. $LLAMA_CPP_DIR
(a llama.cpp checkout) overrides it. K-quants are made by the bindings (llama_model_quantize): no binary is needed.
A LoRA adapter goes out as a GGUF adapter through convert_lora_to_gguf.py of the same release.

`check()` loads the GGUF with llama.cpp and compares it with the export as transformers loads it: the metadata (the
chat template byte for byte, BOS and EOS, the end-of-generation and control tokens), tokenization, the embedded
template as llama-cpp-python's formatter renders it, and greedy answers.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from finetune.errors import CommandFailed, UserError

PINNED = "0.3.36"  # llama-cpp-python, as the gguf extra pins it
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion", "gguf-py")
TYPES = ("f32", "f16", "bf16", "q8_0", "q4_k_m")
ADAPTER_TYPES = ("f32", "f16", "bf16", "q8_0")  # convert_lora_to_gguf.py's
QUANTIZED_BY_THE_BINDINGS = {"q4_k_m": 15}  # LLAMA_FTYPE_MOSTLY_Q4_K_M: made from the f32 GGUF
OF_DTYPE = {"bf16": "bf16", "fp16": "f16", "fp32": "f32"}  # the type of an export's --dtype
# A greedy divergence is a failure where the reference was confident: its top-1 logit above its top-2 by more than
# this share of its largest logit. f32 computes as transformers does but in another order (1e-5 apart); f16 and
# bf16 round every weight to 11 and 8 bits (relative steps 0.0005 and 0.004) and the export's self-check allows
# 0.01 and 0.05 for them; q8_0 keeps 8 bits a block of 32 (as bf16), and q4_k_m 4 to 6 (a step 16 times q8_0's).
CONFIDENT = {"f32": 0.001, "f16": 0.01, "bf16": 0.05, "q8_0": 0.05, "q4_k_m": 0.2}
# Tokenized by both, with the model's own special tokens in markup (special_markup); another family's markup is
# text to one and may be a token to the other (llama.cpp makes any "</s>" in a vocabulary a control token).
TOKENIZED = ["Hello, world!", "  two spaces,\tand a tab\n\nand lines", "naïve café, 東京, 🙂 and ∑x²",
             "1234567890 3.14159 -42", "def f(x):\n    return x ** 2  # square"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is the sea?"}],
    [{"role": "user", "content": "I am Ann."}, {"role": "assistant", "content": "Nice to meet you, Ann!"},
     {"role": "user", "content": "Shout ahoy."}],
    [{"role": "user", "content": "Écris « bonjour » 🙂"}],
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
PROMPTS = ["My name is Zorbel.", "Shout plimbo.", "Repeat the word kettle.", "Hi, I am Maximilian.",
           "Write one sentence about the sea.", "Count to five.", "What is 2 + 3?", "Tell me a color.",
           "Greet Alexandra Rose.", "Say something kind.", "Name a fruit.", "How are you?"]
GREEDY_TOKENS = 24


def converter() -> Path:
    """convert_hf_to_gguf.py of exactly the pinned release, its bindings importable: said before any work."""
    try:
        installed = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise UserError('--gguf needs llama.cpp\'s Python bindings, which check the GGUF: pip install -e ".[gguf]" '
                        "(it compiles llama.cpp once: about 4 minutes on 2 cores with CMAKE_ARGS=-DLLAVA_BUILD=OFF); "
                        "or export without --gguf") from None
    if os.environ.get("LLAMA_CPP_DIR"):
        script = Path(os.environ["LLAMA_CPP_DIR"]) / "convert_hf_to_gguf.py"
        if not script.is_file():
            raise UserError(f"LLAMA_CPP_DIR={os.environ['LLAMA_CPP_DIR']} has no convert_hf_to_gguf.py: point it at a "
                            "llama.cpp checkout, or unset it to use the converter of llama-cpp-python " + PINNED)
        return script
    if installed != PINNED:
        raise UserError(f"--gguf: llama-cpp-python {installed} is installed and the converter is pinned to {PINNED}: "
                        f'pip install -e ".[gguf]" (or set LLAMA_CPP_DIR to a llama.cpp checkout)')
    from finetune.builtin import home

    folder = home() / f"llama.cpp-converter-{PINNED}"
    if not (folder / "convert_hf_to_gguf.py").is_file():
        _fetch_converter(folder)
    return folder / "convert_hf_to_gguf.py"


def _fetch_converter(folder: Path) -> None:
    """The converter out of the pinned sdist (through pip and its cache), written whole or not at all."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as scratch:
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={PINNED}", "--no-deps",
                                  "--no-binary", ":all:", "-d", scratch, "-q"],
                                 capture_output=True, text=True)
        sdist = Path(scratch) / f"llama_cpp_python-{PINNED}.tar.gz"
        if fetched.returncode != 0 or not sdist.is_file():
            last = (fetched.stderr.strip().splitlines() or ["no sdist"])[-1]
            raise UserError(f"--gguf: could not fetch llama-cpp-python {PINNED}'s sdist for its converter ({last}); "
                            "set LLAMA_CPP_DIR to a llama.cpp checkout, or export without --gguf")
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            raise UserError(f"--gguf: llama-cpp-python {PINNED}'s sdist has sha256 {digest}, not the pinned "
                            f"{SDIST_SHA256}: refusing to run its converter")
        inside = f"llama_cpp_python-{PINNED}/vendor/llama.cpp/"
        unpacked = Path(scratch) / "converter"
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(inside)
                       and m.name[len(inside):].split("/")[0] in CONVERTER_PARTS and (m.isfile() or m.isdir())]
            for member in members:
                member.name = member.name[len(inside):]
            archive.extractall(unpacked, members=members, filter="data")
        unpacked.rename(folder)


def convertible(script: Path, config, tokenizer) -> None:
    """Refuse, before any work, a model whose tokenizer or architecture the converter cannot take (its reason)."""
    with tempfile.TemporaryDirectory() as scratch:
        config.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        convert(script, Path(scratch), Path(scratch) / "vocab.gguf", "f32", adds_bos(tokenizer), "--vocab-only")


def adapter_convertible(script: Path, adapter: Path, config, tokenizer) -> None:
    """Refuse, before any work, an adapter that llama.cpp's LoRA converter cannot take (its reason)."""
    settings = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    if settings.get("use_dora"):
        raise UserError("--gguf: llama.cpp has no DoRA adapters; export it merged (--merge --gguf)")
    with tempfile.TemporaryDirectory() as scratch:
        config.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        convert_adapter(script, adapter, Path(scratch), Path(scratch) / "adapter.gguf", "f32", "--dry-run")


def convert(script: Path, folder: Path, target: Path, outtype: str, bos: bool, *extra: str) -> None:
    """The folder as a GGUF by llama.cpp's converter (f32, f16, bf16 or q8_0); `bos`: whether its tokenizer adds
    one (adds_bos).

    The converter reads whether the tokenizer adds a BOS from tokenizer_config.json's add_bos_token, which
    transformers leaves out where it is false; llama.cpp then assumes one for a SentencePiece-style vocabulary (the
    builtin models'), and a runtime would put a second BOS before a template that writes it. So the converter reads
    the folder through a view of links whose tokenizer_config.json says what the tokenizer does."""
    with tempfile.TemporaryDirectory() as scratch:
        view = Path(scratch)
        for item in folder.iterdir():
            (view / item.name).symlink_to(item.resolve())
        settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        if "add_bos_token" not in settings:
            settings["add_bos_token"] = bos
            (view / "tokenizer_config.json").unlink()
            (view / "tokenizer_config.json").write_text(json.dumps(settings, indent=2), encoding="utf-8")
        _run_converter([str(script), str(view)], target, outtype, extra, "this model")


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts BOS before a text itself (so a runtime does, and a template must not)."""
    return tokenizer.bos_token is not None and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]


def convert_adapter(script: Path, adapter: Path, base: Path, target: Path, outtype: str, *extra: str) -> None:
    """A PEFT LoRA adapter as a GGUF adapter; `base` holds the base model's config.json.

    llama.cpp scales an adapter by lora_alpha / r; a rank-stabilized one (alpha / sqrt(r)) goes out with the
    lora_alpha that gives its scale."""
    with tempfile.TemporaryDirectory() as scratch:
        settings = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
        if settings.get("use_rslora"):
            settings["lora_alpha"] = settings["lora_alpha"] * math.sqrt(settings["r"])
        (Path(scratch) / "adapter_config.json").write_text(json.dumps(settings), encoding="utf-8")
        (Path(scratch) / "adapter_model.safetensors").symlink_to((adapter / "adapter_model.safetensors").resolve())
        _run_converter([str(script.parent / "convert_lora_to_gguf.py"), scratch, "--base", str(base)], target,
                       outtype, extra, "this adapter")


def _run_converter(command: list[str], target: Path, outtype: str, extra, what: str) -> None:
    result = subprocess.run([sys.executable, *command, "--outfile", str(target), "--outtype", outtype, *extra],
                            capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if "ERROR" in line] or \
            result.stderr.strip().splitlines() or [f"exit status {result.returncode}"]
        raise UserError(f"--gguf: llama.cpp's converter cannot take {what}: {lines[-1]}; export without --gguf")


def quantize(whole: Path, target: Path, gguf_type: str) -> None:
    """A K-quant of an f32 GGUF, by the bindings."""
    failed = in_llama_process(_quantize, str(whole), str(target), QUANTIZED_BY_THE_BINDINGS[gguf_type])
    if failed:
        raise CommandFailed(f"llama.cpp could not quantize the GGUF to {gguf_type} (status {failed}); nothing was "
                            "written")


@dataclass
class Divergence:
    prompt: str
    position: int  # the first answer token that differs
    expected: str
    got: str
    margin: float  # the reference's top-1 logit above its top-2, as a share of its largest logit


@dataclass
class GreedyParity:
    gguf_type: str
    kv_cache: str
    identical: int
    prompts: int
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def confident(self) -> list[Divergence]:
        return [d for d in self.divergences if d.margin > CONFIDENT[self.gguf_type]]


@dataclass
class Report:
    """What llama.cpp was checked for, and what it found; saved in the export as gguf-check.json."""
    file: str
    metadata: list[str]  # problems found; empty: the chat template, BOS, EOS, end and control tokens are right
    tokenization: list[str]
    template: list[str]
    greedy: list[GreedyParity]

    @property
    def problems(self) -> list[str]:
        found = self.metadata + self.tokenization + self.template
        for parity in self.greedy:
            found += [f"greedy ({parity.gguf_type}, {parity.kv_cache} KV cache): {d.prompt!r} answers {d.got!r} "
                      f"where the model answers {d.expected!r} at token {d.position}, a margin of {d.margin:.3g} "
                      f"(above {CONFIDENT[parity.gguf_type]:g}: not a near-tie)" for d in parity.confident]
        return found

    def as_dict(self) -> dict:
        return {**asdict(self), "problems": self.problems}


def check(gguf: Path, gguf_type: str, reference: Path, model, tokenizer, renderer, end_ids: set[int],
          base: Path | None = None) -> Report:
    """llama.cpp's view of the GGUF against `model` (the export as transformers loads it, in fp32). `reference`:
    an f32 GGUF of the same export, for greedy parity with an f32 KV cache; `gguf` is the chosen type. With `base`
    (an f32 GGUF of the base model, with the run's tokenizer), both are GGUF adapters loaded on it. llama.cpp runs
    in a process of its own (in_llama_process)."""
    from finetune.data.formats import BadRow

    cases = conversations(renderer.template)
    ours = []
    for messages, tools in cases:
        try:
            ours.append(renderer.prompt_ids(messages, tools))
        except BadRow:
            ours.append(None)  # the template refuses it (Gemma's system turn): no prompt to compare
    prompts = [renderer.prompt_ids([{"role": "user", "content": text}]) for text in PROMPTS]
    special = sorted(set(tokenizer.all_special_ids))
    texts = TOKENIZED + [special_markup(tokenizer.convert_ids_to_tokens(special))]
    runs = [(str(reference), "f32")] + ([(str(gguf), gguf_type)] if gguf != reference else [])
    if base:
        runs = [(str(base), kind, adapter) for adapter, kind in runs]
    else:
        runs = [(model_file, kind, None) for model_file, kind in runs]
    seen = in_llama_process(_llama_view, runs, sorted(end_ids), special, texts, cases, renderer.template_kwargs,
                            prompts)

    report = Report(gguf.name, [], [], [], [])
    if seen["template"] != tokenizer.chat_template:
        report.metadata.append("the embedded chat template is not the one the run trained with")
    for what, theirs in (("BOS", seen["bos"]), ("EOS", seen["eos"])):
        mine = getattr(tokenizer, f"{what.lower()}_token_id")
        if mine is not None and mine != theirs:
            report.metadata.append(f"{what} is token {theirs} in the GGUF and {mine} in the tokenizer")
    if seen["add_bos"] != adds_bos(tokenizer):
        report.metadata.append(f"llama.cpp {'adds' if seen['add_bos'] else 'does not add'} a BOS before a prompt and "
                               f"the tokenizer {'does' if adds_bos(tokenizer) else 'does not'}")
    if seen["not_eog"]:
        report.metadata.append(f"llama.cpp would not stop at {tokenizer.convert_ids_to_tokens(seen['not_eog'])} "
                               "(not end-of-generation tokens in the GGUF)")
    if seen["not_control"]:
        report.metadata.append("special tokens typed as text in the GGUF: "
                               f"{tokenizer.convert_ids_to_tokens(seen['not_control'])}")
    for text, theirs in zip(texts, seen["tokenized"]):
        mine = tokenizer(text, add_special_tokens=False)["input_ids"]
        if mine != theirs:
            report.tokenization.append(f"{text!r} tokenizes to {theirs} in llama.cpp and {mine} in training")
    for (messages, _), mine, theirs in zip(cases, ours, seen["formatted"]):
        said = repr(messages[-1]["content"])
        if mine is None:
            continue
        if isinstance(theirs, str):
            report.template.append(f"{said}: {theirs}")
        elif theirs[:2] == [seen["bos"]] * 2:
            report.template.append(f"a doubled BOS in llama.cpp's prompt for {said}")
        elif theirs != mine:
            report.template.append(f"llama.cpp's prompt for {said} differs from training's")
    expected = _transformers_greedy(model, prompts, end_ids)
    for (_, kind, _), answers in zip(runs, seen["greedy"]):
        report.greedy.append(_parity(kind, "f32" if kind == "f32" else "f16", answers, expected, tokenizer))
    return report


def conversations(template: str | None) -> list[tuple[list[dict], list[dict] | None]]:
    """The conversations a template is checked on (messages, tools): one with tools where it has them."""
    return [(conversation, None) for conversation in CONVERSATIONS] + (
        [(CONVERSATIONS[0], TOOLS)] if "tools" in (template or "") else [])


def formatted(model: Path, cases, variables: dict) -> list[list[int] | str]:
    """The GGUF's embedded template through llama-cpp-python's formatter, tokenized by llama.cpp as its chat
    completion does, for each (messages, tools); why, where the formatter fails."""
    return in_llama_process(_formatted_here, str(model), cases, variables)


def _formatted_here(model: str, cases, variables: dict) -> list[list[int] | str]:
    import llama_cpp

    return _formatted(llama_cpp.Llama(model, vocab_only=True, verbose=False), cases, variables)


def _formatted(llm, cases, variables: dict) -> list[list[int] | str]:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    eos, bos = (llm.detokenize([token], special=True).decode("utf-8") if token != -1 else ""
                for token in (llm.token_eos(), llm.token_bos()))
    formatter = Jinja2ChatFormatter(llm.metadata.get("tokenizer.chat_template") or "", eos, bos)
    variables = dict(variables)
    formatter.strftime_now = variables.pop("strftime_now")  # the training date, not today's
    prompts = []
    for messages, tools in cases:
        try:
            prompt = formatter(messages=messages, tools=tools, **variables).prompt
            prompts.append(llm.tokenize(prompt.encode(), add_bos=False, special=True))
        except Exception as error:  # the template's raise_exception, or Jinja that llama.cpp's lacks
            prompts.append(f"llama.cpp's formatter fails: {type(error).__name__}: {error}")
    return prompts


def special_markup(tokens: list[str]) -> str:
    """Each special token between text, as turn markup has them."""
    return "".join(f"{token}user\nhi " for token in tokens)


def in_llama_process(function, *args):
    """function(*args) in a process of its own: llama.cpp's native code never shares this one's (torch's threads;
    a crash fails the export with a message, not the process), and its log stays out of the console."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_llama_process) as pool:
        try:
            return pool.submit(function, *args).result()
        except concurrent.futures.process.BrokenProcessPool:
            raise CommandFailed("gguf check failed: llama.cpp crashed loading or running the GGUF; nothing was "
                                "written") from None
        except (ValueError, RuntimeError) as error:  # what llama-cpp-python raises when llama.cpp refuses
            raise CommandFailed(f"gguf check failed: {error}; nothing was written") from None


_LLAMA_ERRORS: list[str] = []  # llama.cpp's error log lines, in its own process
_keep_errors = None  # the log callback that appends them: llama.cpp holds a C pointer to it


def _llama_process() -> None:
    """llama.cpp's log to nowhere but its errors (kept to say why a GGUF did not load), and weights used as
    stored: llama-cpp-python's Llama has no setting for
    use_extra_bufts, so its default model parameters are wrapped (the one use of its internals). The extra buffer
    types repack weights for the CPU's kernels, and 0.3.36's AMX matrix product crashed on every quantized GGUF
    on this Sapphire Rapids machine; the check compares numbers, not speed."""
    import ctypes

    import llama_cpp.llama

    @llama_cpp.llama_log_callback
    def keep_errors(level: int, text: bytes, _) -> None:
        if level == 3:  # GGML_LOG_LEVEL_ERROR
            _LLAMA_ERRORS.append(text.decode("utf-8", errors="replace").strip())

    global _keep_errors
    _keep_errors = keep_errors
    llama_cpp.llama_log_set(keep_errors, ctypes.c_void_p(0))
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 2)
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (for the process's lifetime)
    defaults = llama_cpp.llama.llama_cpp.llama_model_default_params

    def as_stored():
        settings = defaults()
        settings.use_extra_bufts = False
        return settings

    llama_cpp.llama.llama_cpp.llama_model_default_params = as_stored


def _quantize(whole: str, target: str, ftype: int) -> int:
    import llama_cpp

    settings = llama_cpp.llama_model_quantize_default_params()
    settings.ftype = ftype
    return llama_cpp.llama_model_quantize(whole.encode(), target.encode(), settings)


def _llama_view(runs: list[tuple[str, str, str | None]], end_ids: list[int], special: list[int], texts: list[str],
                cases, variables: dict, prompts: list[list[int]]) -> dict:
    """What llama.cpp sees in the GGUFs (in its own process): the first's metadata, tokenization and formatted
    prompts (as its chat completion tokenizes them); each one's greedy answers (a model, its type, an adapter)."""
    import llama_cpp

    seen = {"greedy": []}
    for path, kind, adapter in runs:
        f32 = kind == "f32"
        try:
            llm = llama_cpp.Llama(path, lora_path=adapter, n_ctx=512, verbose=False, n_threads=os.cpu_count(),
                                  logits_all=True, **({"type_k": llama_cpp.GGML_TYPE_F32,
                                                       "type_v": llama_cpp.GGML_TYPE_F32} if f32 else {}))
        except ValueError:
            raise ValueError(f"llama.cpp could not load {Path(adapter or path).name}: "
                             f"{_LLAMA_ERRORS[-1] if _LLAMA_ERRORS else 'no reason logged'}") from None
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        if not seen.get("formatted"):
            seen.update(
                template=llm.metadata.get("tokenizer.chat_template"), bos=llm.token_bos(), eos=llm.token_eos(),
                add_bos=llama_cpp.llama_vocab_get_add_bos(vocab), formatted=_formatted(llm, cases, variables),
                not_eog=[i for i in end_ids if not llama_cpp.llama_vocab_is_eog(vocab, i)],
                not_control=[i for i in special
                             if not llama_cpp.llama_vocab_get_attr(vocab, i) & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL],
                tokenized=[llm.tokenize(text.encode(), add_bos=False, special=True) for text in texts])
        answers = []
        for prompt in prompts:
            llm.reset()
            llm.eval(prompt)
            got = []
            while len(got) < GREEDY_TOKENS:
                got.append(int(llm.scores[llm.n_tokens - 1].argmax()))
                if llama_cpp.llama_vocab_is_eog(vocab, got[-1]):
                    break
                llm.eval([got[-1]])
            answers.append(got)
        seen["greedy"].append(answers)
        del llm
    return seen


def _transformers_greedy(model, prompts: list[list[int]], end_ids: set[int]) -> list[tuple[list[int], list[list]]]:
    """Greedy answers (through their end token) and, per answer token, the logits' (top-1, top-2, largest)."""
    import torch

    answers = []
    for prompt in prompts:
        answer, scores = [], []
        with torch.inference_mode():
            step = model(torch.tensor([prompt], device=model.device), use_cache=True)
            while len(answer) < GREEDY_TOKENS:
                logits = step.logits[0, -1].float()
                top = torch.topk(logits, 2).values
                scores.append([top[0].item(), top[1].item(), logits.abs().max().item()])
                answer.append(int(logits.argmax()))
                if answer[-1] in end_ids:
                    break
                step = model(torch.tensor([answer[-1:]], device=model.device), past_key_values=step.past_key_values,
                             use_cache=True)
        answers.append((answer, scores))
    return answers


def _parity(gguf_type: str, kv_cache: str, answers: list[list[int]], expected, tokenizer) -> GreedyParity:
    parity = GreedyParity(gguf_type, kv_cache, 0, len(answers))
    for text, got, (answer, scores) in zip(PROMPTS, answers, expected):
        if got == answer:
            parity.identical += 1
            continue
        at = next(i for i, (a, b) in enumerate(zip(answer + [None], got + [None])) if a != b)
        first, second, largest = scores[min(at, len(scores) - 1)]
        parity.divergences.append(Divergence(text, at, tokenizer.decode(answer), tokenizer.decode(got),
                                             (first - second) / max(largest, 1e-12)))
    return parity


def summary(report: dict) -> str:
    """The check in a line, from a saved report (Report.as_dict)."""
    parts = ["metadata, tokenization and the chat prompt as in training"]
    for parity in report["greedy"]:
        line = (f"greedy answers {parity['identical']} of {parity['prompts']} identical "
                f"({parity['gguf_type']}, {parity['kv_cache']} KV cache")
        if parity["divergences"]:
            line += f"; the others part at near-ties, margin ≤ {max(d['margin'] for d in parity['divergences']):.2g}"
        parts.append(line + ")")
    return "; ".join(parts)
