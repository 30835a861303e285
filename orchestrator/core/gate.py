"""The acceptance gate: a verdict on a drafter from the probe's metric deltas. Pure: no I/O.

Facts (docs/domain/qwen36-dflash.md, "What acceptance to expect"): vLLM's draft acceptance rate is
(mean acceptance length - 1) / k, so it FALLS as k grows while a healthy drafter's mean acceptance length (AL)
rises; a fixed rate threshold fails healthy DFlash at k = 15 (15-19 %). The default verdict therefore looks at:

- AL against a threshold that scales with k: 1 + 0.4 * min(k, 3) (1.4 for k = 1, 1.8 for k = 2, 2.2 for k >= 3);
  AL can never exceed k + 1;
- acceptance at draft position 0 (default >= 0.5): a guessed config is near zero there;
- no cliff: positions from some p on all ~0 while the ones before are not (sliding layers run as full attention,
  or a missing window; AL can stay near healthy, only the shape shows it);
- enough drafts for the figures to mean something (the count and a Wilson interval are stated).

A playbook may set each threshold, turn the cliff check off, or ask for the old rate threshold explicitly
(`acceptance.min_draft_acceptance`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_MIN_FIRST_POSITION = 0.5
DEFAULT_MIN_DRAFTS = 100
CLIFF_ZERO = 0.01  # "~0": at most this acceptance at every position from the cliff on
CLIFF_DROP = 0.1  # the first ~0 position is below this fraction of the one before it
CLIFF_BEFORE = 0.05  # ... and the one before it is at least this (else it is just a short curve)
CLIFF_REACHING = 20  # drafts that reached the position before the cliff: fewer say nothing about the cliff
CLIFF_CAUSE = ("the sign of sliding layers run as full attention, or a missing sliding window (use_sliding_window "
               "false or absent, sliding_window null, or a vLLM that runs sliding layers as full attention: "
               "< 0.26, or VLLM_USE_V2_MODEL_RUNNER=0)")


def default_min_al(k: int) -> float:
    """1 + 0.4 * min(k, 3): healthy DFlash (k = 5 or 15) and healthy MTP (k = 3) pass it, the guessed config
    (AL ~1.1) fails it, and it never asks for more than k + 1."""
    return round(1 + 0.4 * min(int(k), 3), 4)


def wilson(successes: float, n: float, z: float = 1.96) -> tuple[float, float] | None:
    """The Wilson score interval of a proportion (95 % by default); None without trials."""
    if not n or n <= 0:
        return None
    p = max(0.0, min(1.0, successes / n))
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class Thresholds:
    k: int
    min_al: float
    min_al_source: str  # "default" or "playbook"
    min_first: float
    min_rate: float | None  # the old rate gate, only when the playbook asks for it
    cliff: bool
    min_drafts: int

    def as_dict(self) -> dict:
        return {"k": self.k, "min_mean_acceptance_length": self.min_al, "min_mean_acceptance_length_source":
                self.min_al_source, "min_first_position": self.min_first, "min_draft_acceptance": self.min_rate,
                "cliff_check": self.cliff, "min_drafts": self.min_drafts}

    def describe(self) -> str:
        parts = [f"AL >= {self.min_al:g}" + (f" (1 + 0.4*min(k,3), k={self.k})" if self.min_al_source == "default"
                                              else ""),
                 f"position 0 >= {self.min_first:g}"]
        if self.cliff:
            parts.append("no cliff")
        if self.min_rate is not None:
            parts.append(f"rate >= {self.min_rate:.0%}")
        parts.append(f">= {self.min_drafts} drafts")
        return ", ".join(parts)


def playbook_thresholds(pb) -> Thresholds:
    """The gate's thresholds of a playbook: its `acceptance` section and spec k (the one place they are derived;
    plan.step_acceptance carries them to the runner, monitor export and status show them). With a batch-size
    schedule (speculative.schedule) the probe, one request at a time, drafts the schedule's k at batch size 1: the
    positions past it are never drafted, so they are not a cliff."""
    sp = pb.conf.speculative
    first = next((r for r in sorted(sp.schedule or []) if r[0] <= 1 <= r[1]), None)
    return thresholds(vars(pb.conf.acceptance), min(sp.num_speculative_tokens, first[2]) if first and first[2] >= 1
                      else sp.num_speculative_tokens)


def thresholds(acc_cfg: dict | None, k: int) -> Thresholds:
    """The gate's thresholds from a playbook's `acceptance` section (absent keys: the defaults for this k)."""
    a = acc_cfg or {}
    own_al = a.get("min_mean_acceptance_length")
    return Thresholds(k=int(k), min_al=float(own_al) if own_al is not None else default_min_al(k),
                      min_al_source="playbook" if own_al is not None else "default",
                      min_first=float(a["min_first_position"]) if a.get("min_first_position") is not None
                      else DEFAULT_MIN_FIRST_POSITION,
                      min_rate=a.get("min_draft_acceptance"),
                      cliff=bool(a.get("cliff_check", True)),
                      min_drafts=int(a["min_drafts"]) if a.get("min_drafts") is not None else DEFAULT_MIN_DRAFTS)


def find_cliff(per: list[float], drafts: float) -> int | None:
    """The first position p >= 1 from which every position is ~0 while position p - 1 is not (and enough drafts
    reached p - 1 for the zeros to mean something); None when the curve just decays."""
    for p in range(1, len(per)):
        before = per[p - 1]
        if before < CLIFF_BEFORE or before * drafts < CLIFF_REACHING:
            continue
        if per[p] <= before * CLIFF_DROP and all(x <= CLIFF_ZERO for x in per[p:]):
            return p
    return None


def fmt_curve(per: list[float]) -> str:
    return "[" + ", ".join(f"{x:.2f}" for x in per) + "]"


@dataclass
class Verdict:
    passed: bool
    reasons: list = field(default_factory=list)  # why it failed, one sentence per failed check
    passes: list = field(default_factory=list)  # the checks that passed, in words
    cliff_at: int | None = None
    too_few: bool = False
    figures: dict = field(default_factory=dict)
    thresholds: dict = field(default_factory=dict)

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)

    def figures_text(self) -> str:
        """AL, rate (with its interval and the counts), position 0, the whole per-position curve."""
        f = self.figures
        al, rate, k = f.get("mean_acceptance_length"), f.get("draft_acceptance_rate"), f.get("k")
        ci = f.get("rate_interval")
        s = (f"AL {al:.2f} of {k + 1}" if al is not None else "AL unknown") + ", "
        s += f"rate {rate:.1%}" if rate is not None else "rate unknown"
        if ci:
            s += f" (95% interval {ci[0]:.1%}-{ci[1]:.1%})"
        s += f" over {f.get('drafts', 0):g} drafts ({f.get('draft_tokens', 0):g} drafted tokens)"
        if f.get("per_position"):
            s += f", per position {fmt_curve(f['per_position'])}"
        return s

    def text(self) -> str:
        """The figures, then the verdict in words."""
        if self.passed:
            return f"{self.figures_text()}: passes ({'; '.join(self.passes)})"
        return f"{self.figures_text()}: FAILS: {self.reason}"

    def as_dict(self) -> dict:
        return {"passed": self.passed, "reason": self.reason or None, "reasons": list(self.reasons),
                "passes": list(self.passes), "cliff_at": self.cliff_at, "too_few_drafts": self.too_few,
                "figures": dict(self.figures), "thresholds": dict(self.thresholds)}


def judge(acc, th: Thresholds, *, extended: str | None = None) -> Verdict:
    """The verdict on one measurement (vllm_facts.Acceptance) against the thresholds."""
    k = th.k
    per = list(acc.per_position or [])[:max(k, 1)]  # a schedule drafts fewer than the configured k: not a cliff
    drafts = acc.drafts or 0
    if not drafts and acc.draft_tokens and k:
        drafts = round(acc.draft_tokens / k)  # the log line gives drafted tokens only
    rate, al = acc.draft_acceptance, acc.mean_acceptance_length
    rate_ci = wilson(acc.accepted, acc.draft_tokens) if acc.draft_tokens else None
    first = per[0] if per else (None if al is None or k > 1 else al - 1)
    first_ci = wilson(first * drafts, drafts) if first is not None and drafts else None
    v = Verdict(False, thresholds=th.as_dict(), figures={
        "k": k, "mean_acceptance_length": _r(al), "draft_acceptance_rate": _r(rate), "per_position": [_r(x) for x in per],
        "first_position": _r(first), "drafts": drafts, "draft_tokens": acc.draft_tokens, "accepted_tokens": acc.accepted,
        "rate_interval": [_r(x) for x in rate_ci] if rate_ci else None,
        "first_position_interval": [_r(x) for x in first_ci] if first_ci else None, "source": acc.source})
    if extended:
        v.figures["probe_extended"] = extended
    if drafts < th.min_drafts:
        v.too_few = True
        v.reasons.append(f"too few drafts to judge: {drafts:g} < {th.min_drafts} (acceptance.min_drafts)"
                         + (f" even after {extended}" if extended else "")
                         + "; raise acceptance.probe.max_tokens or max_rounds, or check that the probe's requests "
                           "produce output")
    if al is None:
        v.reasons.append("no mean acceptance length (no drafts counted)")
    elif al < th.min_al:
        v.reasons.append(f"mean acceptance length {al:.2f} < {th.min_al:g}"
                         + (f" (the default for k={k}: 1 + 0.4*min(k,3))" if th.min_al_source == "default" else
                            " (acceptance.min_mean_acceptance_length)"))
    else:
        v.passes.append(f"AL {al:.2f} >= {th.min_al:g}")
    if first is None:
        v.reasons.append("no position-0 acceptance (the per-position counters are missing)")
    elif first < th.min_first:
        v.reasons.append(f"position-0 acceptance {first:.2f} < {th.min_first:g}: the drafter's first token is "
                         "mostly wrong (a guessed or stale config: wrong mask_token_id or target_layer_ids, or the "
                         "wrong target layers tapped)")
    else:
        v.passes.append(f"position 0 {first:.2f} >= {th.min_first:g}")
    if th.cliff and per:
        c = find_cliff(per, drafts)
        if c is not None:
            v.cliff_at = c
            v.reasons.append(f"a cliff: positions {c}-{len(per) - 1} are all ~0 (at most {max(per[c:]):.3f}) while "
                             f"position {c - 1} is {per[c - 1]:.2f}: {CLIFF_CAUSE}")
        else:
            v.passes.append("no cliff")
    if th.min_rate is not None:
        if rate is None or rate < th.min_rate:
            v.reasons.append(f"draft acceptance rate {'unknown' if rate is None else f'{rate:.1%}'} < the playbook's "
                             f"min_draft_acceptance {th.min_rate:.0%} (the rate falls as k grows: healthy DFlash at "
                             "k=15 shows 15-19 %; drop min_draft_acceptance to gate on AL and the curve)")
        else:
            v.passes.append(f"rate {rate:.1%} >= {th.min_rate:.0%}")
    if not v.too_few:
        v.passes.append(f"{drafts:g} drafts >= {th.min_drafts}")
    v.passed = not v.reasons
    return v


def gate_figures(v: dict) -> str:
    """`AL 3.52 of 16, rate 16.8%, position 0 0.62` from a recorded verdict (gate.Verdict.as_dict())."""
    f = v.get("figures") or {}
    parts = []
    if f.get("mean_acceptance_length") is not None:
        parts.append(f"AL {f['mean_acceptance_length']:.2f}" + (f" of {f['k'] + 1}" if f.get("k") else ""))
    if f.get("draft_acceptance_rate") is not None:
        parts.append(f"rate {f['draft_acceptance_rate']:.1%}")
    if f.get("first_position") is not None:
        parts.append(f"position 0 {f['first_position']:.2f}")
    if f.get("drafts") is not None:
        parts.append(f"{f['drafts']:g} drafts")
    return ", ".join(parts) or "no figures"


def _r(x):
    return None if x is None else round(float(x), 4)
