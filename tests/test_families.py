"""The families people fine-tune besides Llama and GPT-OSS, each proven on the toolkit's paths: Qwen 2.5 and 3 (the
real Qwen tokenizer), Gemma 2 and 3, Mistral and Phi-3 (Llama 3.2's vocabulary with the family's turn tokens as a
stand-in: their real tokenizers are not in the shared assets), each with its official chat template as TRL ships it,
and tiny random-initialized models of their architectures (finetune/models/architectures.py)."""

from __future__ import annotations

import pytest

from finetune.data.formats import BadRow
from finetune.data.render import Renderer, training_template
from tests.conftest import family_tokenizer, trained_spans

FAMILIES = ["qwen2.5", "qwen3", "gemma2", "gemma3", "mistral", "phi3"]
DATE = "2026-01-01"

TALK = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5."},
        {"role": "user", "content": "And doubled?"}, {"role": "assistant", "content": "10."}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
TOOL_TALK = [{"role": "user", "content": "Add 2 and 3."},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
             {"role": "tool", "name": "add", "content": "5"},
             {"role": "assistant", "content": "It is 5."}]


def spans(renderer: Renderer, messages: list[dict], tools: list | None = None) -> tuple[list[int], list[str]]:
    ids, labels = renderer.encode({"messages": messages, **({"tools": tools} if tools else {})})
    return ids, trained_spans(renderer.tokenizer, ids, labels)


@pytest.mark.parametrize("family", FAMILIES)
def test_assistant_masks_match_the_official_templates_marked_variant(family):
    """Our masks from the official template's prefixes equal those of TRL's variant with {% generation %} markers
    (which the pipeline renders with where TRL has one): each answer and its end-of-turn token, nothing else."""
    tokenizer = family_tokenizer(family)
    official = tokenizer.chat_template
    marked = training_template(tokenizer, official)
    assert (marked != official) == (family != "mistral")  # TRL marks every family here but Mistral's stand-in
    end = {"qwen2.5": "<|im_end|>", "qwen3": "<|im_end|>", "gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>",
           "phi3": "<|end|>", "mistral": "<|eot_id|>"}[family]
    cases = [(TALK, None)] + ([(TOOL_TALK, TOOLS)] if family.startswith("qwen") else [])
    for messages, tools in cases:
        by_markers = spans(Renderer(tokenizer, marked, DATE), messages, tools)
        if family in ("qwen3", "phi3"):  # not prefix-stable: Qwen 3 drops earlier reasoning (below), Phi-3 ends
            with pytest.raises(BadRow, match="renders the conversation"):  # with an end of text its prefixes lack
                Renderer(tokenizer, official, DATE).encode({"messages": messages, "tools": tools})
        else:
            assert spans(Renderer(tokenizer, official, DATE), messages, tools) == by_markers
        ids, trained = by_markers
        assert tokenizer.decode(ids) == Renderer(tokenizer, official, DATE).render_text(  # as the model sees it
            {"messages": messages, "tools": tools})
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        answers = [m["content"] for i, m in enumerate(messages) if m["role"] == "assistant"
                   and (family != "qwen3" or i > last_user)]  # Qwen 3's earlier answers are context (test below)
        if family == "phi3":  # the end of text after the last turn is in its generation block
            trained[-1] = trained[-1].removesuffix("\n" + tokenizer.eos_token)
        assert len(trained) == len(answers) and all(span.endswith(end) for span in trained), trained
        # Qwen 3 writes an empty reasoning block before an answer given without reasoning, as it generates one
        assert trained[-1].removeprefix("<think>\n\n</think>\n\n").removesuffix(end).strip() == answers[-1]


def test_qwen3_trains_the_last_turns_reasoning_while_its_template_drops_earlier_turns():
    """Qwen 3's template renders an earlier turn's reasoning only while that turn is the last: its renderings of a
    growing conversation are not prefixes of each other, so masks come from TRL's marked variant; the last turn's
    reasoning is trained, and an earlier one's is not there to train."""
    tokenizer = family_tokenizer("qwen3")
    talk = [TALK[0], {**TALK[1], "thinking": "Two plus three."}, TALK[2], {**TALK[3], "thinking": "Five twice."}]
    with pytest.raises(BadRow, match="renders the conversation"):
        Renderer(tokenizer, tokenizer.chat_template, DATE).encode({"messages": talk})
    renderer = Renderer(tokenizer, training_template(tokenizer, tokenizer.chat_template), DATE)
    ids, trained = spans(renderer, talk)
    assert tokenizer.decode(ids) == Renderer(tokenizer, tokenizer.chat_template, DATE).render_text({"messages": talk})
    assert "Two plus three." not in tokenizer.decode(ids)
    assert trained == ["<think>\nFive twice.\n</think>\n\n10.<|im_end|>"]  # the earlier answer is context
    _, without = spans(Renderer(tokenizer, renderer.template, DATE, train_thinking=False), talk)
    assert without == ["</think>\n\n10.<|im_end|>"]  # the reasoning is context; closing it is the answer's start


END_OF_TURN = {"qwen2.5": "<|im_end|>", "qwen3": "<|im_end|>", "gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>",
               "phi3": "<|end|>", "mistral": "<|eot_id|>"}
LORA_TARGETS = {"phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}}  # fused: other names than Llama's
LLAMA_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def family_model(folder, family: str):
    """A tiny random-initialized model of the family with its tokenizer (family_tokenizer) and end tokens."""
    from finetune.models.architectures import tiny
    from tests.conftest import save_tiny_model

    tokenizer = family_tokenizer(family)
    ends = sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END_OF_TURN[family])})
    config = tiny(family, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=ends,
                  pad_token_id=tokenizer.pad_token_id)
    return save_tiny_model(folder, config, tokenizer)


@pytest.fixture(scope="module")
def greeters(tmp_path_factory):
    """greeters(family) -> a run folder: the family's tiny model fine-tuned with LoRA on every linear layer until
    it answers "Hi!", trained once per module."""
    from tests.conftest import train_greeter, write_greetings

    runs = {}
    data = write_greetings(tmp_path_factory.mktemp("data") / "greetings.jsonl")

    def greeter(family: str):
        if family not in runs:
            model = family_model(tmp_path_factory.mktemp(family), family)
            runs[family] = train_greeter(model, data, "lora", 30, 1e-2, 4, tmp_path_factory.mktemp("runs") / family)
        return runs[family]

    return greeter


@pytest.mark.integration
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_its_real_modules_answers_and_exports_merged(greeters, family, tmp_path, capsys):
    """LoRA on all-linear finds the family's own module names; the trained model answers and stops at the family's
    end of turn; the adapter and the merged export each pass their self-check (logits against the trained model)."""
    import json

    from finetune.trained_model.chat import Chat, Sampling
    from tests.conftest import cli_here

    run = greeters(family)
    adapter = json.loads((run / "final" / "adapter_config.json").read_text())
    assert {name.rsplit(".", 1)[-1] for name in adapter["target_modules"]} == LORA_TARGETS.get(family, LLAMA_TARGETS)
    reply = Chat(run / "final").reply([{"role": "user", "content": "I am qqq."}],
                                      Sampling(max_new_tokens=20, temperature=0))
    assert (reply.answer, reply.ended_by) == ("Hi!", END_OF_TURN[family])
    assert reply.thinking == ("Greet." if family == "qwen3" else "")  # the only template here with a place for it
    code, printed, err = cli_here(capsys, "export", str(run / "final"), "--out", str(tmp_path / "adapter"))
    assert code == 0 and "checked: " in printed, err[-3000:]
    exported = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert sorted(exported) == sorted(adapter["target_modules"])  # PEFT writes a set: its order is the hash seed's
    # The stand-ins are no vocabulary llama.cpp's converter should take; of the two Qwens (one tokenizer, the same
    # converter code), Qwen 3's template is the harder one for llama.cpp's formatter (reasoning, tools).
    gguf = family == "qwen3"
    code, printed, err = cli_here(capsys, "export", str(run / "final"), "--out", str(tmp_path / "merged"), "--merge",
                                  "--dtype", "fp32", *(["--gguf"] if gguf else []))
    assert code == 0, err[-3000:]
    assert "checked: " in printed, printed
    if gguf:  # llama.cpp answers as trained (an f32 GGUF): its template (tools), tokens and end of turn
        assert "greedy answers 12 of 12 identical (f32, f32 KV cache)" in printed, printed
    loading = ', attn_implementation="eager")' if family == "gemma2" else '"auto")\n'  # sdpa ignores its cap
    assert loading in (tmp_path / "merged" / "README.md").read_text()
    held_out = tmp_path / "held-out.jsonl"  # names it never saw: the answer, and its end, on each
    held_out.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"I am {name}."},
                                                         {"role": "assistant", "content": "Hi!"}]}) + "\n"
                                for name in ("kkk", "mno", "zzyz")))
    code, _, err = cli_here(capsys, "eval", str(run), "--data", str(held_out), "--max-new-tokens", "16")
    assert code == 0, err[-3000:]
    scores = json.loads((run / "eval" / "final-held-out.json").read_text())["metrics"]
    assert scores["stop_rate"] == 1.0, scores


@pytest.mark.integration
def test_one_server_serves_every_family_each_stopping_at_its_end_of_turn(greeters, tmp_path):
    """`finetune serve` with the six runs at once (six bases): each answers through the OpenAI API as chat does,
    with Qwen 3's reasoning apart from its answer."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    openai = pytest.importorskip("openai", reason="the test extra's openai client is not installed")
    from tests.test_serve import free_port

    port, log = free_port(), tmp_path / "server.log"
    targets = [f"{family}={greeters(family)}" for family in FAMILIES]
    with open(log, "w") as written:
        server = subprocess.Popen([sys.executable, "-m", "finetune", "serve", *targets, "--port", str(port)],
                                  stdout=written, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for family in FAMILIES:
            answer = client.chat.completions.create(model=family, temperature=0, max_tokens=20,
                                                    messages=[{"role": "user", "content": "I am qqq."}])
            message = answer.choices[0].message
            assert (message.content, answer.choices[0].finish_reason) == ("Hi!", "stop"), family
            assert getattr(message, "reasoning_content", None) == ("Greet." if family == "qwen3" else None), family
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
            server.wait(timeout=60)
    assert "Traceback" not in log.read_text()


@pytest.mark.integration
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["qlora", "full"])
def test_each_family_trains_with_qlora_and_in_full(family, method, tmp_path):
    """Two steps each: a 4-bit base (bitsandbytes quantizes the family's Linear layers, fused ones included) and
    every weight trained (Gemma's and Qwen's tied embeddings)."""
    from tests.conftest import SHORT, train_here, write_greetings
    from tests.test_training import losses, progress

    model = family_model(tmp_path / "model", family)
    data = write_greetings(tmp_path / "d.jsonl")
    result = train_here("quickstart", f"model.name_or_path={model}", f"data.train={data}",
                        f"output_dir={tmp_path / 'run'}", *SHORT, f"method={method}", "train.max_steps=2",
                        "train.max_length=128")
    assert result.returncode == 0, result.stderr[-3000:]
    assert progress(tmp_path / "run")[-1]["status"] == "completed" and len(losses(tmp_path / "run")) == 2


@pytest.mark.integration
@pytest.mark.parametrize("family", FAMILIES)
def test_two_process_ddp_equals_one_big_batch_killed_and_resumed(family, tmp_path):
    """What DDP adds per family is its gradients' all-reduce over the family's parameters (none left without a
    gradient: that would fail the reducer): an epoch of 37 rows in global batches of 4, as tests/test_training.py
    checks for Llama. The one-process run is killed (SIGKILL) after step 5 and resumed from its checkpoint of step
    4: what a resume restores per family (the adapter on the family's modules, the optimizer, the data position)
    must leave it equal to the two processes that were never stopped."""
    import os

    from tests.conftest import EQUAL_BATCH_EPOCH, launch_cli, run_cli, write_greetings
    from tests.test_training import adapter, losses, progress

    model = family_model(tmp_path / "model", family)
    data = tmp_path / "greetings-37.jsonl"
    data.write_text("".join(write_greetings(tmp_path / "all.jsonl").read_text().splitlines(True)[:37]))
    common = [f"model.name_or_path={model}", f"data.train={data}", *EQUAL_BATCH_EPOCH]
    two = launch_cli("cpu_ddp_2proc", "quickstart", *common, f"output_dir={tmp_path / 'two'}",
                     "train.per_device_train_batch_size=2")
    assert two.returncode == 0, two.stderr[-3000:]
    one = [*common, f"output_dir={tmp_path / 'one'}", "train.per_device_train_batch_size=4",
           "train.save_strategy=steps", "train.save_steps=2"]
    killed = run_cli("train", "quickstart", *one, env={**os.environ, "FINETUNE_FAULTS": "die@step:5",
                                                       "FINETUNE_FAULT_READY": str(tmp_path / "died")})
    assert killed.returncode == -9 and (tmp_path / "died").exists(), killed.stderr[-3000:]
    resumed = run_cli("train", "quickstart", *one, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [row["resumed"]["from"] for row in progress(tmp_path / "one") if "resumed" in row] == ["checkpoint-4"]
    single, ddp = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(single) == len(ddp) == 10
    assert max(abs(a - b) / abs(a) for a, b in zip(single, ddp)) <= 1e-4
    weights_one, weights_two = adapter(tmp_path / "one"), adapter(tmp_path / "two")
    assert max((weights_one[k] - weights_two[k]).abs().max().item() for k in weights_one) <= 1e-5
