"""Human-readable summaries of prepared data (used by `finetune validate` and at the start of training)."""

from __future__ import annotations

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
    lines.append(f"Example (tokens that carry loss are between {MARK_OPEN} and {MARK_CLOSE}):" if stage == "sft" else
                 f"Example (the answers' tokens, scored, are between {MARK_OPEN} and {MARK_CLOSE}):" if stage != "grpo"
                 else "Example (a prompt that GRPO answers, and the reference its rewards compare with):")
    lines += [f"  {line}" for line in report["example"].splitlines()]
    return "\n".join(lines)
