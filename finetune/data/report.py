"""Human-readable summaries of prepared data (used by `finetune validate` and at the start of training)."""

from __future__ import annotations

from finetune.data.integrity import counted, summary_of_duplicates
from finetune.data.pipeline import MARK_CLOSE, MARK_OPEN

UNITS = {"sft": "rows", "dpo": "pairs", "kto": "labelled answers", "grpo": "prompts"}


def describe_data(report: dict) -> str:
    stage = report.get("stage", "sft")
    unit = UNITS[stage]
    lines = ["Data" + (f" (stage {stage})" if stage != "sft" else "")]
    for split in ("train", "eval"):
        rows = report["rows"][split]
        if not rows:
            continue
        stats = report[split]
        p = stats["length_percentiles"]
        lines.append(
            f"  {split}: {rows:,} {unit}, {stats['tokens']:,} tokens"
            + (f", {stats['trained_fraction']:.1%} of tokens carry loss" if stage != "grpo" else "")
        )
        lines.append(
            f"    tokens per {unit.split()[-1][:-1]}" + (" (prompt and the longer answer)" if stage == "dpo" else
                                                         " (the prompt)" if stage == "grpo" else "")
            + f": p50 {p['p50']}, p90 {p['p90']}, p99 {p['p99']}, max {p['max']}; "
            f"{stats['truncated_rows']:,} {unit} truncated at max_length {report['max_length']}"
        )
        if stats["dropped_no_trained_tokens"]:
            lines.append(
                f"    {stats['dropped_no_trained_tokens']:,} {unit} dropped: "
                + ("the prompt alone fills max_length" if stage != "sft" else "nothing to learn within max_length")
                + " (data.too_long=fail lists them)"
            )
        if "packed_rows" in stats:
            lines.append(
                f"    packed into {stats['packed_rows']:,} rows of up to {report['max_length']} tokens, "
                f"{stats['packed_fill']:.1%} full; batches are padding-free (100% real tokens)"
            )
    for source in report.get("sources", []):
        share = next((f" ({key} {source[key]:g})" for key in ("rows", "fraction", "weight") if key in source), "")
        lines.append(f"  source {source['source']}: {source['used']:,} rows of its {source['available']:,}{share}")
    bad = report["bad_rows"]
    if bad["count"]:
        lines.append(f"  bad rows dropped (data.bad_rows={bad['policy']}): {bad['count']:,}")
        lines += [f"    {line}" for line in bad["shown"]]
    else:
        lines.append("  bad rows: none")
    lines += describe_checks(report.get("integrity"))
    lines.append(f"Example (tokens that carry loss are between {MARK_OPEN} and {MARK_CLOSE}):" if stage == "sft" else
                 f"Example (the answers' tokens, scored, are between {MARK_OPEN} and {MARK_CLOSE}):" if stage != "grpo"
                 else "Example (a prompt that GRPO answers, and the reference its rewards compare with):")
    lines += [f"  {line}" for line in report["example"].splitlines()]
    return "\n".join(lines)


def describe_checks(found: dict | None) -> list[str]:
    """The data checks' findings (integrity.py), a line or a few each, with the first rows they name."""
    if not found:
        return []
    lines = ["Data checks"]
    duplicates = found.get("duplicates")
    if duplicates:
        lines.append(f"  duplicates: {summary_of_duplicates(duplicates)} (data.duplicates={duplicates['policy']})")
        for kind in ("exact", "near"):
            lines += [f"    {kind}: {' = '.join(group['rows'])}" + (f" ({group['size']} rows)" if group["size"] > 3
                                                                     else "")
                      for group in duplicates[kind]["shown"]]
        lines += [f"    eval {match['eval']} = {match['train']} ({match['kind']})"
                  for match in duplicates["eval_overlap"]["shown"]]
    contamination = found.get("contamination")
    if contamination:
        lines.append(f"  contamination ({contamination['ngram']} words in common with data.decontaminate): "
                     f"{counted(contamination['rows'], 'row')} ({contamination['share']:.2%}), "
                     f"data.contaminated={contamination['policy']}")
        for one in contamination["sets"]:
            lines.append(f"    {one['set']} ({counted(one['items'], 'item')}): {counted(one['rows'], 'row')} "
                         f"overlap{'s' if one['rows'] == 1 else ''} "
                         f"{one['items_found']:,} of its items")
            for match in one["shown"]:
                lines += [f"      {match['row']} shares {match['shared_words']} words with {match['item']}",
                          f"        row:  {match['row_text']}", f"        item: {match['item_text']}"]
    idle = found.get("teaches_nothing")
    if idle:
        within = idle.get("nothing_within_max_length", {"count": 0, "shown": []})
        lines.append(f"  rows that teach nothing: {idle['rows']:,} (data.teaches_nothing={idle['policy']}): ending "
                     f"without an answer {idle['ends_without_answer']:,}, a blank answer {idle['blank_answer']:,}, "
                     f"reasoning the template leaves out {idle['thinking_dropped']:,}; and nothing to learn within "
                     f"max_length {within['count']:,} (data.too_long={within['policy']})")
        lines += [f"    {line}" for line in idle["shown"] + within["shown"][:3]]
    lines += [f"  template: {line}" for line in found.get("template", [])]
    if found.get("dropped"):
        lines.append(f"  dropped by the checks: {counted(found['dropped'], 'train row')}")
    return lines
