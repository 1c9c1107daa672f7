"""Know the data before step 0: duplicates, overlap with evaluation sets (contamination), rows that teach nothing and
the template's faults, found while the data is prepared (scan.py's one pass; template_findings' probe), reported by
`finetune validate` (and at the start of training), and dropped or refused as the recipe's policies say."""

from __future__ import annotations

from array import array

from finetune.data.eval_sets import EvalSet
from finetune.data.formats import BadRow
from finetune.data.scan import IDLE, NGRAM, Contamination, Duplicates, scan, text_of
from finetune.errors import UserError

SHOWN = 5  # groups or matches listed per finding
SNIPPET = 160  # characters of a row shown beside its match
UNSTABLE = "differently from the full conversation"  # render.py's reason for such a row


def check(spool, train: array, eval_: array, data, eval_sets: list[EvalSet], stage: str, template: dict,
          processes: int = 1) -> tuple[array, dict]:
    """The checks data.duplicates, data.decontaminate and data.teaches_nothing ask for, on the examples (offsets in
    `spool`): a UserError where a policy is fail and a check finds rows; the rows dropped where it is drop.
    `template`: what template_findings found. (The training examples kept, the report.)"""
    report: dict = {}
    drop: set[int] = set()  # positions in train
    threshold = data.near_duplicate_threshold if data.duplicates != "unchecked" else None
    scanned = scan(spool, train, eval_, eval_sets, threshold, processes,
                   teaching=template["thinking_dropped"] if stage == "sft" else None)
    duplicates, contamination = scanned.duplicates, scanned.contamination
    if duplicates:
        report["duplicates"] = _duplicates_report(duplicates, spool, train, data.near_duplicate_threshold)
        report["duplicates"]["policy"] = data.duplicates
        _apply(data.duplicates, duplicates.dropped(), drop, lambda: _duplicates_error(report["duplicates"]))
    if eval_sets:
        contaminated = {match.position for match in contamination}
        report["contamination"] = _contamination_report(contamination, spool, train, eval_sets)
        report["contamination"].update(policy=data.contaminated, max_share=data.contamination_max_share)
        over = report["contamination"]["share"] > data.contamination_max_share
        _apply(data.contaminated if over or data.contaminated != "fail" else "report", contaminated, drop,
               lambda: _contamination_error(report["contamination"]))
    report["template"] = list(template["findings"])
    if stage == "sft":
        report["teaches_nothing"] = _teaches_nothing_report(scanned.idle, spool, train)
        report["teaches_nothing"]["policy"] = data.teaches_nothing
        if template["ignores_system"] and scanned.system_rows:
            report["template"].append(
                f"the chat template leaves out system messages, and {counted(scanned.system_rows, 'row')} have one "
                "(data.system_prompt adds one to every row): the model never sees them")
        _apply(data.teaches_nothing, {position for position, _ in scanned.idle}, drop,
               lambda: _teaches_nothing_error(report["teaches_nothing"]))
    report["dropped"] = len(drop)
    kept = array("q", (example for position, example in enumerate(train) if position not in drop)) if drop else train
    return kept, report


def _apply(policy: str, rows: set[int], drop: set[int], error) -> None:
    if rows and policy == "fail":
        raise error()
    if policy == "drop":
        drop |= rows


def template_findings(renderer, train_thinking: bool) -> dict:
    """What rendering a probe conversation shows of the chat template: whether an assistant turn ends with a token
    (the model learns to stop), whether system messages reach the model, whether the reasoning of the answer does.
    {"findings": [what to tell], "ignores_system": bool, "thinking_dropped": bool}."""
    from finetune.data.render import IGNORE

    found = {"findings": [], "ignores_system": False, "thinking_dropped": False}
    if renderer.template is None:
        return found
    question, answer = {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"}
    tokenizer = renderer.tokenizer
    try:
        _, labels = renderer.encode({"messages": [question, answer], "tools": None})
    except BadRow:  # the template cannot render a plain exchange: every row will say why
        return found
    found["ignores_system"] = not _renders("system-probe-7d1c", renderer, [
        {"role": "system", "content": "system-probe-7d1c"}, question])
    found["thinking_dropped"] = train_thinking and not _renders("thinking-probe-7d1c", renderer, [
        question, {**answer, "thinking": "thinking-probe-7d1c"}])
    last = [label for label in labels if label != IGNORE][-1]
    if last not in set(tokenizer.get_added_vocab().values()) | {tokenizer.eos_token_id}:
        found["findings"].append(
            f"the chat template ends an assistant turn with {tokenizer.decode([last])!r}, not an end-of-turn token: "
            "a model trained on it never learns to stop (chat and serve run to max_new_tokens); use a template "
            "that ends each turn with one (model.chat_template)")
    return found


def _renders(probe: str, renderer, messages: list[dict]) -> bool:
    """Whether the rendering of the messages holds the probe text; True where the template refuses them (a row of
    such messages is a bad row, with the template's own reason)."""
    try:
        return probe in renderer.render_text({"messages": messages})
    except Exception:  # jinja's raise_exception: "System role not supported", for one
        return True


def add_encoding_findings(report: dict, encoded: dict, bad: list[str]) -> None:
    """What encoding found that belongs with the checks: rows with nothing to learn within train.max_length, and
    conversations the template renders differently as they grow (bad rows, said once as the template's fault)."""
    if "teaches_nothing" in report:
        report["teaches_nothing"]["nothing_within_max_length"] = encoded["too_long"]
    unstable = [entry for entry in bad if UNSTABLE in entry]
    if unstable:
        report["template"].append(unstable_template(len(unstable), unstable[0]))


def unstable_template(rows: int, first: str) -> str:
    return (f"the chat template renders {counted(rows, 'conversation')} differently as they grow "
            f"(the first: {first.split(': ')[0]}), so their loss masks cannot be derived; use a template with "
            "{% generation %} markers (model.chat_template)")


def _duplicates_report(found: Duplicates, spool, train: array, threshold: float) -> dict:
    where = spool.where
    return {
        "threshold": threshold,
        "exact": _groups_found(found.exact, train, where),
        "near": _groups_found(found.near, train, where),
        "eval_overlap": {"rows": len(found.eval_overlaps),
                         "shown": [{"eval": where(offset), "train": where(train[position]), "kind": kind}
                                   for offset, position, kind in found.eval_overlaps[:SHOWN]]},
    }


def _groups_found(groups: list[list[int]], train: array, where) -> dict:
    return {"groups": len(groups), "rows": sum(len(group) - 1 for group in groups),
            "shown": [{"size": len(group), "rows": [where(train[p]) for p in group[:3]]}
                      for group in sorted(groups, key=len, reverse=True)[:SHOWN]]}


def _contamination_report(found: list[Contamination], spool, train: array, eval_sets: list[EvalSet]) -> dict:
    sets = []
    for set_index, eval_set in enumerate(eval_sets):
        matches = [match for match in found if match.set_index == set_index]
        sets.append({"set": eval_set.name, "items": len(eval_set.items), "rows": len(matches),
                     "items_found": len({match.item for match in matches}),
                     "shown": [{"row": spool.where(train[match.position]),
                                "row_text": _snippet(text_of(spool.get(train[match.position]))),
                                "item": eval_set.items[match.item][0],
                                "item_text": _snippet(eval_set.items[match.item][1]),
                                "shared_words": match.shared_words} for match in matches[:SHOWN]]})
    rows = len({match.position for match in found})
    return {"ngram": NGRAM, "sets": sets, "rows": rows, "share": rows / len(train) if len(train) else 0.0}


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= SNIPPET else text[:SNIPPET - 1] + "…"


def _teaches_nothing_report(idle: list[tuple[int, str]], spool, train: array) -> dict:
    counts = {why: sum(1 for _, found in idle if found == why) for why in IDLE}
    return {"rows": len(idle), **counts,
            "shown": [f"{spool.where(train[position])}: {IDLE[why]}" for position, why in idle[:SHOWN]]}


def _duplicates_error(found: dict) -> UserError:
    lines = [f"  {' = '.join(group['rows'])}" + (f" (and {group['size'] - 3} more)" if group["size"] > 3 else "")
             for kind in ("exact", "near") for group in found[kind]["shown"]]
    lines += [f"  {match['train']} = eval {match['eval']}" for match in found["eval_overlap"]["shown"]]
    return UserError(f"data.train: {summary_of_duplicates(found)}:\n" + "\n".join(lines) + "\nRemove them, set "
                     "data.duplicates=drop to keep the first of each group (and no row an eval row duplicates), or "
                     "data.duplicates=report to train on them")


def summary_of_duplicates(found: dict) -> str:
    exact, near, overlap = found["exact"], found["near"], found["eval_overlap"]["rows"]
    return (f"{counted(exact['rows'], 'exact duplicate row')} in {counted(exact['groups'], 'group')}, "
            f"{counted(near['rows'], 'near duplicate')} (Jaccard >= {found['threshold']:g}) in "
            f"{counted(near['groups'], 'group')}, {counted(overlap, 'row')} duplicating an eval row")


def counted(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def _contamination_error(found: dict) -> UserError:
    lines = [f"  {match['row']} shares {match['shared_words']} words with {match['item']}"
             for one in found["sets"] for match in one["shown"]]
    return UserError(f"data.train: {counted(found['rows'], 'row')} ({found['share']:.2%}) "
                     f"overlap{'s' if found['rows'] == 1 else ''} data.decontaminate's sets, "
                     f"above data.contamination_max_share {found['max_share']:g}:\n" + "\n".join(lines)
                     + "\nRemove them, set data.contaminated=drop to leave them out, or raise "
                     "data.contamination_max_share")


def _teaches_nothing_error(found: dict) -> UserError:
    lines = [f"  {line}" for line in found["shown"]]
    more = f"\n  ... and {found['rows'] - len(lines)} more" if found["rows"] > len(lines) else ""
    return UserError(f"data.train: rows that teach nothing ({found['rows']:,}):\n" + "\n".join(lines) + more
                     + "\nFix them, or set data.teaches_nothing=drop to leave them out (report: train on them)")


def summary(found: dict, shown=str) -> str:
    """What the checks found, in a line (the model card's); `shown` names an evaluation set (the card: never by a
    local path)."""
    parts = []
    if "duplicates" in found:
        parts.append(f"{summary_of_duplicates(found['duplicates'])} (data.duplicates={found['duplicates']['policy']})")
    if "contamination" in found:
        against = ", ".join(shown(one["set"]) for one in found["contamination"]["sets"])
        parts.append(f"{counted(found['contamination']['rows'], 'row')} sharing {NGRAM} words with {against} "
                     f"(data.contaminated={found['contamination']['policy']})")
    if "teaches_nothing" in found:
        parts.append(f"{counted(found['teaches_nothing']['rows'], 'row')} teaching nothing "
                     f"(data.teaches_nothing={found['teaches_nothing']['policy']})")
    parts += found.get("template", [])
    if found.get("dropped"):
        parts.append(f"{counted(found['dropped'], 'train row')} dropped")
    return "; ".join(parts)
