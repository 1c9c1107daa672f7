"""The data checks `finetune validate` reports (finetune/data/integrity.py): on a held-out style corpus, 10,000 real
conversations from the shared assets with defects the test plants (exact and near duplicates with small edits, GSM8K
test items copied or lightly paraphrased into training rows, rows that truncate to nothing), each check's recall and
its false positives on the rows nobody planted; then the policies, the template checks and the report as the CLI
prints it."""

from __future__ import annotations

import json
import random
import re
from array import array
from pathlib import Path

import pytest

from finetune.data import eval_sets, scan, sources
from finetune.data.pipeline import prepare_into, read_examples
from finetune.data.prepared_folder import read_report
from finetune.data.spool import Spool
from finetune.recipe.schema import load_recipe
from tests.conftest import asset, cli_here, write_recipe

PLANTED_EXACT, PLANTED_NEAR, VERBATIM, PARAPHRASED, TRUNCATING = 150, 200, 50, 50, 50
MAX_LENGTH = 1024
WORDS = re.compile(r"\w+")


def _conversation(turns: list[tuple[str, str]]) -> dict | None:
    """Consecutive turns of one role joined; None unless it is a user's question and an assistant's answer at least."""
    messages: list[dict] = []
    for role, text in turns:
        text = text.strip()
        if not text:
            continue
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + text
        else:
            messages.append({"role": role, "content": text})
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    return {"messages": messages} if len(messages) >= 2 and messages[0]["role"] == "user" else None


def real_conversations() -> list[dict]:
    """GSM8K's training set, ShareGPT and Glaive tool-call conversations, Self-Instruct's tasks and hh-rlhf's chosen
    transcripts, as user and assistant messages."""
    datasets = Path(asset("datasets"))
    found = []

    def jsonl(path: str):
        return [json.loads(line) for line in (datasets / path).read_text(encoding="utf-8").splitlines()]

    found += [_conversation([("user", row["question"]), ("assistant", row["answer"])])
              for row in jsonl("gsm8k/train.jsonl")]
    roles = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "user"}
    for path in ("sharegpt-fastchat/dummy_conversation.json", "glaive-toolcall/glaive_toolcall_en_demo.json"):
        found += [_conversation([(roles[turn["from"]], turn["value"]) for turn in row["conversations"]])
                  for row in json.loads((datasets / path).read_text(encoding="utf-8"))]
    for row in jsonl("self-instruct/user_oriented_instructions.jsonl"):
        found += [_conversation([("user", row["instruction"] + ("\n\n" + case["input"] if case["input"] else "")),
                                 ("assistant", case["output"])]) for case in row["instances"]]
    for row in jsonl("hh-rlhf/harmless_base_test_1000.jsonl"):
        parts = re.split(r"\n\n(Human|Assistant): ", row["chosen"])[1:]
        found.append(_conversation([("user" if who == "Human" else "assistant", text)
                                    for who, text in zip(parts[::2], parts[1::2])]))
    return [conversation for conversation in found if conversation]


def shingles(conversation: dict) -> set[tuple[str, ...]]:
    """The test's own reading of a near duplicate's definition: word 3-grams of the messages' texts."""
    words = WORDS.findall(" ".join(m["content"] for m in conversation["messages"]).lower())
    return {tuple(words[i:i + 3]) for i in range(max(len(words) - 2, 1))}


def jaccard(a: dict, b: dict) -> float:
    x, y = shingles(a), shingles(b)
    return len(x & y) / len(x | y)


def _edited(conversation: dict, rng: random.Random, edits: int) -> dict:
    """The conversation with `edits` small edits in its messages: a word replaced, dropped, or two swapped."""
    copy = json.loads(json.dumps(conversation))
    for _ in range(edits):
        message = rng.choice(copy["messages"])
        words = message["content"].split(" ")
        at = rng.randrange(len(words))
        kind = rng.choice(("replace", "drop", "swap"))
        if kind == "replace":
            words[at] = rng.choice(["really", "quite", "thing", "about", "maybe"])
        elif kind == "drop" and len(words) > 1:
            del words[at]
        elif at + 1 < len(words):
            words[at], words[at + 1] = words[at + 1], words[at]
        message["content"] = " ".join(words)
    return copy


PARAPHRASES = [("How many", "What number of"), ("how many", "what number of"), (" each ", " every "),
               (" total", " in all"), (" has ", " owns "), (" buys ", " purchases "), ("If ", "Suppose ")]


def _paraphrased(text: str) -> str:
    for old, new in PARAPHRASES:
        text = text.replace(old, new, 1)
    return text


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """The corpus written as one JSON lines file, and where each planted defect is (0-based rows)."""
    rng = random.Random(20261207)
    clean = real_conversations()
    test_items = [json.loads(line) for line in Path(asset("datasets/gsm8k/test.jsonl")).read_text().splitlines()]
    rows, planted = list(clean), {"exact": {}, "near": {}, "verbatim": [], "paraphrased": [], "truncating": []}
    sources = rng.sample(range(len(clean)), len(clean))  # each clean row the source of one planted row at most
    for source in sources[:PLANTED_EXACT]:
        copy = json.loads(json.dumps(clean[source]))
        message = rng.choice(copy["messages"])
        message["content"] = message["content"].replace(" ", "  ", 1) + "\n"
        planted["exact"][len(rows)] = source
        rows.append(copy)
    for source in sources[PLANTED_EXACT:]:
        if len(planted["near"]) == PLANTED_NEAR:
            break
        if len(shingles(clean[source])) < 40:  # a few words' edits make a short row another row
            continue
        copy = _edited(clean[source], rng, rng.randint(1, 3))
        if jaccard(copy, clean[source]) >= 0.85:  # a near duplicate by the definition, with a margin
            planted["near"][len(rows)] = source
            rows.append(copy)
    for number, item in enumerate(rng.sample(test_items, VERBATIM + PARAPHRASED)):
        verbatim = number < VERBATIM
        question, answer = (item["question"], item["answer"]) if verbatim else \
            (_paraphrased(item["question"]), _paraphrased(item["answer"]))
        turns = [("user", question), ("assistant", answer)]
        if number % 2:  # copied into a longer conversation
            turns = [("user", "Can you help me with some homework?"), ("assistant", "Of course, go ahead."), *turns]
        planted["verbatim" if verbatim else "paraphrased"].append(len(rows))
        rows.append(_conversation(turns))
    filler = " ".join(m["content"] for m in clean[sources[-1]]["messages"]).split()
    for _ in range(TRUNCATING):
        question = " ".join(rng.choice(filler) for _ in range(2 * MAX_LENGTH))
        planted["truncating"].append(len(rows))
        rows.append(_conversation([("user", question), ("assistant", "Done.")]))
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return {"path": path, "clean": len(clean), "rows": len(rows), "planted": planted}


def test_planted_defects_are_found_with_their_recall_and_clean_rows_are_not(corpus, tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, f"model: {{name_or_path: builtin:tiny-llama}}\n"
                                                f"data: {{train: {corpus['path']}}}\n"), [])
    bad: list[str] = []
    eval_set = eval_sets.read_eval_sets([str(asset("datasets/gsm8k/test.jsonl"))])
    with Spool(tmp_path) as spool:
        train = read_examples([sources.resolve(str(corpus["path"]), "data.train")], recipe.data, bad, spool)
        assert not bad and len(train) == corpus["rows"] >= 10_000
        scanned = scan.scan(spool, train, array("q"), eval_set, 0.8, processes=2)
    duplicates, contamination = scanned.duplicates, scanned.contamination
    planted = corpus["planted"]
    group_of = {}
    for kind in ("exact", "near"):
        for group in getattr(duplicates, kind):
            group_of.update({position: (kind, set(group)) for position in group})

    def found(copy: int, source: int, kinds: tuple[str, ...]) -> bool:
        kind, group = group_of.get(copy, (None, set()))
        return kind in kinds and source in group

    exact_recall = sum(found(c, s, ("exact",)) for c, s in planted["exact"].items()) / len(planted["exact"])
    near_recall = sum(found(c, s, ("exact", "near")) for c, s in planted["near"].items()) / len(planted["near"])
    contaminated = {match.position for match in contamination}
    verbatim_recall = len(contaminated & set(planted["verbatim"])) / len(planted["verbatim"])
    paraphrased_recall = len(contaminated & set(planted["paraphrased"])) / len(planted["paraphrased"])
    # The real rows hold duplicates of their own (ShareGPT's identity answers, repeated rows) and GSM8K training
    # problems that share 13 words with test problems: a finding among them is false only where the test's own
    # reading of the definitions says so.
    rows = [json.loads(line) for line in corpus["path"].read_text(encoding="utf-8").splitlines()]
    items = [text for _, text in eval_set[0].items]

    def really_duplicated(position: int) -> bool:
        kind, group = group_of[position]
        def text(row: dict) -> list[tuple[str, str]]:
            return [(m["role"], " ".join(m["content"].split())) for m in row["messages"]]

        return any(text(rows[other]) == text(rows[position]) if kind == "exact" else
                   jaccard(rows[position], rows[other]) >= 0.8 for other in group - {position})

    def really_contaminated(match) -> bool:
        words = WORDS.findall(" ".join(m["content"] for m in rows[match.position]["messages"]).lower())
        item = WORDS.findall(items[match.item].lower())
        n = min(13, len(item))
        return bool({tuple(item[i:i + n]) for i in range(len(item) - n + 1)} &
                    {tuple(words[i:i + n]) for i in range(len(words) - n + 1)})

    clean = set(range(corpus["clean"])) - set(planted["exact"].values()) - set(planted["near"].values())
    found_in_clean = (set(group_of) | contaminated) & clean
    false = {p for p in set(group_of) & clean if not really_duplicated(p)} | \
        {m.position for m in contamination if m.position in clean and not really_contaminated(m)}
    print(f"\nrecall: exact {exact_recall:.1%}, near {near_recall:.1%} ({len(planted['near'])} planted), "
          f"contamination verbatim {verbatim_recall:.1%}, paraphrased {paraphrased_recall:.1%}; in the "
          f"{len(clean):,} real rows: {len(found_in_clean)} found, {len(false)} of them false "
          f"({len(false) / len(clean):.2%})")
    assert len(planted["near"]) == PLANTED_NEAR
    assert exact_recall >= 0.95
    assert near_recall >= 0.80
    assert verbatim_recall >= 0.95
    assert len(false) / len(clean) <= 0.01


def test_the_report_counts_them_and_rows_that_truncate_to_nothing(corpus, tmp_path, llama_tokenizer):
    tokenizer = llama_tokenizer
    recipe = load_recipe(write_recipe(tmp_path, f"model: {{name_or_path: builtin:tiny-llama}}\n"
                                                f"data: {{train: {corpus['path']}, contaminated: report, "
                                                f"decontaminate: [{asset('datasets/gsm8k/test.jsonl')}]}}\n"
                                                f"train: {{max_length: {MAX_LENGTH}}}\n"), [])
    report = read_report(prepare_into(recipe, tokenizer, tokenizer.chat_template, str(tmp_path / "prepared"))[0])
    checks = report["integrity"]
    assert checks["duplicates"]["exact"]["rows"] >= 0.95 * PLANTED_EXACT
    assert checks["duplicates"]["near"]["rows"] >= 0.8 * PLANTED_NEAR
    assert checks["contamination"]["rows"] >= 0.95 * VERBATIM
    assert checks["teaches_nothing"]["nothing_within_max_length"]["count"] >= TRUNCATING
    assert report["rows"]["train"] == corpus["rows"] - checks["teaches_nothing"]["nothing_within_max_length"]["count"]


def _exchange(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture
def small_data(tmp_path) -> dict:
    """Twenty distinct exchanges, one twice, one a near copy, one a copy of an evaluation item, one blank answer."""
    topics = ["rivers", "mountains", "deserts", "forests", "oceans", "islands", "volcanoes", "glaciers", "caves",
              "lakes", "canyons", "reefs", "swamps", "plains", "valleys", "cliffs", "dunes", "fjords", "steppes",
              "tundras"]
    rows = [_exchange(f"Tell me three facts about {topic}, please, in plain words for a child of ten.",
                      f"Here are three facts about {topic}: they are found on several continents, they change "
                      f"slowly over many years, and scientists study {topic} to learn about the planet's past.")
            for topic in topics]
    item = {"question": "A farmer has 12 cows and buys 7 more cows at the market on Tuesday; how many cows does "
                        "the farmer have now?", "answer": "12 + 7 = 19 #### 19"}
    rows += [rows[3], json.loads(json.dumps(rows[5]).replace("plain words", "simple words")),
             _exchange(item["question"], item["answer"]), _exchange("Say nothing.", "   ")]
    return {"data": _jsonl(tmp_path / "data.jsonl", rows),
            "eval_set": _jsonl(tmp_path / "items.jsonl", [item, {"question": "What is 2 + 2?", "answer": "4"}])}


def _validate(capsys, tmp_path, data: Path, *overrides: str) -> tuple[int, str, str]:
    recipe = write_recipe(tmp_path, f"model: {{name_or_path: builtin:tiny-llama}}\ndata: {{train: {data}}}\n"
                                    f"output_dir: {tmp_path / 'run'}\n")
    return cli_here(capsys, "validate", str(recipe), *overrides)


def test_validate_reports_each_check_with_the_rows_it_names(capsys, tmp_path, small_data):
    code, out, err = _validate(capsys, tmp_path, small_data["data"], f"data.decontaminate=[{small_data['eval_set']}]",
                               "data.contaminated=report")
    assert code == 0, err
    data = small_data["data"]
    assert "duplicates: 1 exact duplicate row in 1 group, 1 near duplicate (Jaccard >= 0.8) in 1 group, 0 rows " \
           "duplicating an eval row (data.duplicates=report)" in out
    assert f"exact: {data} line 4 = {data} line 21" in out
    assert f"near: {data} line 6 = {data} line 22" in out
    assert "contamination (13 words in common with data.decontaminate): 1 row (4.17%), data.contaminated=report" \
        in out
    assert f"{small_data['eval_set']} (2 items): 1 row overlaps 1 of its items" in out
    assert f"{data} line 23 shares 27 words with {small_data['eval_set']} line 1" in out
    assert "rows that teach nothing: 1 (data.teaches_nothing=report): ending without an answer 0, a blank answer 1," \
        in out
    assert f"{data} line 24: an assistant message is only whitespace" in out
    assert "train: 24 rows" in out


def test_each_policy_refuses_or_drops_what_its_check_finds(capsys, tmp_path, small_data):
    data, eval_set = small_data["data"], small_data["eval_set"]
    code, out, err = _validate(capsys, tmp_path, data, f"data.decontaminate=[{eval_set}]")
    assert code == 2 and "Traceback" not in err
    assert err.startswith("error: data.train: 1 row (4.17%) overlaps data.decontaminate's sets, above "
                          "data.contamination_max_share 0:\n")
    assert f"  {data} line 23 shares 27 words with {eval_set} line 1\n" in err
    code, out, err = _validate(capsys, tmp_path, data, f"data.decontaminate=[{eval_set}]",
                               "data.contamination_max_share=0.05")
    assert code == 0, err
    code, out, err = _validate(capsys, tmp_path, data, "data.duplicates=fail")
    assert code == 2 and f"{data} line 4 = {data} line 21" in err and "data.duplicates=drop" in err
    code, out, err = _validate(capsys, tmp_path, data, "data.teaches_nothing=fail")
    assert code == 2 and "rows that teach nothing (1):" in err
    code, out, err = _validate(capsys, tmp_path, data, f"data.decontaminate=[{eval_set}]", "data.contaminated=drop",
                               "data.duplicates=drop", "data.teaches_nothing=drop")
    assert code == 0, err
    assert "dropped by the checks: 4 train rows" in out and "train: 20 rows" in out


def test_an_lm_eval_task_whose_data_is_local_is_an_evaluation_set(capsys, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness (the eval extra) is not installed")
    from finetune.trained_model.harness import eval_tasks_dir

    items = [json.loads(line) for line in (eval_tasks_dir() / "greetings.jsonl").read_text().splitlines()]
    rows = [_exchange(f"Please count to {n}.", " ".join(map(str, range(1, n + 1)))) for n in range(3, 12)]
    rows.append(_exchange(items[0]["prompt"], items[0]["answer"]))
    code, out, err = _validate(capsys, tmp_path, _jsonl(tmp_path / "data.jsonl", rows),
                               "data.decontaminate=[lm-eval:finetune_greetings]")
    assert code == 2, out
    assert f"line 10 shares {len(WORDS.findall(items[0]['prompt'] + ' ' + items[0]['answer']))} words with " \
           "lm-eval:finetune_greetings item 1" in err
    code, out, err = _validate(capsys, tmp_path, tmp_path / "data.jsonl", "data.decontaminate=[lm-eval:no_such_task]")
    assert code == 2 and "lm-evaluation-harness knows no task 'no_such_task'" in err


TEMPLATES = {
    "no end token": "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '\\n' }}{%- endfor -%}"
                    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}",
    "no system": "{%- for m in messages if m.role != 'system' -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + "
                 "'<|im_end|>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
                 "{%- endif -%}",
    "unstable": "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' + "
                "(' last' if loop.last else '') + '\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}"
                "{{ '<|im_start|>assistant\\n' }}{%- endif -%}",
}


@pytest.mark.parametrize("template", TEMPLATES)
def test_a_template_fault_is_said_once_as_the_templates(capsys, tmp_path, small_data, template):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATES[template], encoding="utf-8")
    code, out, err = _validate(capsys, tmp_path, small_data["data"], f"model.chat_template={path}",
                               "data.system_prompt=Answer briefly.")
    if template == "no end token":
        assert code == 0, err
        assert "template: the chat template ends an assistant turn with '\\n', not an end-of-turn token: a model " \
               "trained on it never learns to stop" in out
    elif template == "no system":
        assert code == 0, err
        assert "template: the chat template leaves out system messages, and 24 rows have one" in out
    else:
        assert code == 2
        assert err.startswith("error: 24 bad data rows:\n  the chat template renders 24 conversations differently "
                              f"as they grow (the first: {small_data['data']} line 1), so their loss masks cannot be "
                              "derived; use a template with {% generation %} markers (model.chat_template)\nFix them")


def test_reasoning_the_template_leaves_out_is_counted_as_teaching_nothing(capsys, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"What is {n} + {n}?"},
                          {"role": "assistant", "thinking": f"Add {n} to itself.", "content": str(2 * n)}]}
            for n in range(12)]
    data = _jsonl(tmp_path / "data.jsonl", rows)
    code, out, err = _validate(capsys, tmp_path, data)  # the builtin template renders the reasoning
    assert code == 0 and ", reasoning the template leaves out 0;" in out, err
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATES["no system"], encoding="utf-8")
    code, out, err = _validate(capsys, tmp_path, data, f"model.chat_template={path}")
    assert code == 0 and ", reasoning the template leaves out 12;" in out, err
    assert f"{data} line 1: the chat template leaves out its reasoning (thinking): it is not trained" in out
    code, out, err = _validate(capsys, tmp_path, data, f"model.chat_template={path}", "data.train_thinking=false")
    assert code == 0 and ", reasoning the template leaves out 0;" in out, err
