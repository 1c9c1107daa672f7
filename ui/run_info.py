"""What the panel shows of a run, read from its progress.jsonl: status, curves, sampled answers, duration, ETA
and the time plan's."""

from __future__ import annotations

from dataclasses import dataclass

from finetune import run_folder


@dataclass
class RunInfo:
    name: str
    status: str  # starting | running | completed | stopped | failed
    rows: list[dict]
    started: float | None

    resumable: bool = False  # stopped or failed, with a complete checkpoint to continue from

    @property
    def train_rows(self) -> list[dict]:
        return run_folder.training_rows(self.rows)

    @property
    def samples(self) -> list[dict]:
        """The answers to held-out prompts at the last two evaluations (eval.samples): prompt, reference, and the
        answer at each step, newest first."""
        evaluations = [row for row in self.rows if "samples" in row][-2:][::-1]
        table = []
        for evaluation in evaluations:
            for index, sample in enumerate(evaluation["samples"]):
                if index == len(table):
                    table.append({"prompt": sample["prompt"], "reference": sample["reference"]})
                table[index][f"step {evaluation['step']}"] = sample["answer"] + ("" if sample["stopped"] else " …")
        return table

    @property
    def last(self) -> dict:
        return self.train_rows[-1] if self.train_rows else {}

    @property
    def duration_s(self) -> float | None:
        timed = [row for row in self.rows if "elapsed_s" in row]
        return timed[-1]["elapsed_s"] if timed else None

    @property
    def eta_s(self) -> float | None:
        return run_folder.eta_s(self.last) if self.status == "running" else None

    @property
    def plan(self) -> dict | None:
        """The time plan the run made at its start (where it knew a speed)."""
        return run_folder.planned(self.rows)

    @property
    def planned_left_s(self) -> float | None:
        """What that plan leaves of the run after its last logged step, to set beside the measured ETA."""
        return run_folder.planned_left_s(self.plan, self.last.get("step", 0))
