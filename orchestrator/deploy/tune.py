"""`deploy tune PLAYBOOK`: is speculative decoding faster than none here, with which k, at which load?

On the playbook's target, one launch after the other, each a real `up` with its gate (compare's bring-up: the
fallback off, the playbook itself or a failure), each swept over the same concurrency levels with compare's sweep
(the same prompts, streamed, every request timed in the container):

1. the baseline: the playbook without --speculative-config (a loaded drafter is not free even at k = 0);
2. the largest k: its per-position acceptance predicts the mean tokens per verification step of every smaller k
   (1 + the sum of the first k positions: exact for chains (MTP, EAGLE), approximate for DFlash, which drafts a
   whole block at once); the step time of k is taken between the baseline's and the largest k's at the same level,
   growing linearly with the tokens verified per step; together they predict tokens/s for every k at every level;
3. the few candidates the prediction ranks best (--max-launches), measured: the prediction is checked, not trusted;
4. per level the fastest of {off, each measured k}, with its margin and whether it is larger than the noise of the
   measurement; then the playbook change: a batch-size schedule (vLLM >= 0.27: num_speculative_tokens_per_batch_size)
   with 0 (no drafts) where the baseline wins, else the single k that wins at tune.expected_concurrency;
5. written in place only with --write (comments and layout kept: ruamel.yaml round trip; a backup; the strict
   schema checks the result before it replaces the file); the best configuration is left running.
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import math
import os
import time

from orchestrator.deploy import compare as C
from orchestrator.deploy import ops
from orchestrator.steps import plan as P
from orchestrator.core.errors import DeployError, UsageError
from orchestrator.core.report import Progress
from orchestrator.core.spec import Playbook, load_playbook

SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
NOISE_FLOOR = 0.03        # a margin under 3 % is never called a win, whatever the spread of the requests
PREDICTION_TOLERANCE = 0.25  # the stated bound on |predicted - measured| / measured (docs/cli.md#tune)
MAX_BATCH = 4096          # the schedule's last range ends here (vLLM caps it at max_num_seqs)


def label(pb: Playbook) -> str:
    if pb.spec_off:
        return "off"
    k = _k(pb)
    return f"k={k['k']}" + (f" schedule {k['schedule']}" if k["schedule"] else "")


def _k(pb: Playbook) -> dict:
    """A launch record's k and schedule (None for the baseline); the schedule as the playbook writes it."""
    sp = pb.conf.speculative
    return {"k": None if pb.spec_off else sp.num_speculative_tokens,
            "schedule": list(sp.schedule) if sp.schedule and not pb.spec_off else None}


def largest_k(pb: Playbook) -> int:
    """The largest k the drafter allows: DFlash drafts a block of block_size tokens, k = block_size - 1; else the
    playbook's k (MTP's head count limits it, and vLLM checks that at startup)."""
    bs = (pb.drafter_config or {}).get("block_size") if pb.conf.speculative.method == "dflash" else None
    return int(bs) - 1 if isinstance(bs, int) and bs > 1 else pb.conf.speculative.num_speculative_tokens


def cap_levels(pb: Playbook, levels: list[int]) -> tuple[list[int], str | None]:
    """The levels that fit: the sizing model's concurrency at max_model_len (when it has the target's config)."""
    from orchestrator.core import sizing

    inp = sizing.from_playbook(pb)
    try:
        cap = sizing.size(inp).max_concurrency if inp is not None else None
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        cap = None
    if cap is None or cap <= 0:
        return list(levels), None
    keep = [c for c in levels if c <= max(1.0, cap)]
    if len(keep) == len(levels):
        return keep, None
    return keep or [1], (f"concurrency {', '.join(str(c) for c in levels if c not in keep)} dropped: the sizing model "
                         f"fits {cap:.1f} requests of max_model_len {pb.conf.serve.max_model_len} tokens")


# ------------------------------------------------------------------ the model


def mean_tokens(per_pos: list[float], k: int) -> float:
    """Mean tokens per verification step with k drafts: 1 + the first k positions' acceptance."""
    return 1.0 + sum(per_pos[:k])


def predict(off: list[dict], big: list[dict], per_pos: list[float], big_k: int) -> dict:
    """{k: {level: tokens/s}} for k = 1..big_k from the baseline's and the largest k's sweeps (same levels).

    Step time per level: baseline T0 = c / off tokens/s (one token per step), largest k TK = c * AL_K / its
    tokens/s; for k, T0 + (TK - T0) * k / K (linear in the drafts verified per step); tokens/s = c * AL_k / T."""
    out: dict = {}
    for lo, lb in zip(off, big):
        c, r0, rk = lo["concurrency"], lo.get("tokens_per_s"), lb.get("tokens_per_s")
        if not r0 or not rk:
            continue
        al_k = lb.get("acceptance_length") or mean_tokens(per_pos, big_k)
        t0, tk = c / r0, c * al_k / rk
        for k in range(1, big_k + 1):
            t = t0 + (tk - t0) * k / big_k
            out.setdefault(k, {})[c] = round(c * mean_tokens(per_pos, k) / t, 2) if t > 0 else None
    return out


def pick_candidates(pred: dict, off: dict, big_k: int, n: int) -> list[int]:
    """At most n values of k (not the largest, measured already) the prediction ranks best: each level's best first
    (low levels first), then by the best ratio over the baseline anywhere; only those predicted to beat it."""
    if n <= 0:
        return []
    ratio = {k: max((v / off[c] for c, v in by.items() if v and off.get(c)), default=0) for k, by in pred.items()}
    order = []
    for c in sorted(off):
        best = max((k for k in pred if pred[k].get(c) and k != big_k), key=lambda k: pred[k][c], default=None)
        if best is not None and pred[best][c] > off[c] and best not in order:
            order.append(best)
    order += [k for k in sorted(ratio, key=ratio.get, reverse=True) if k != big_k and ratio[k] > 1 and k not in order]
    return order[:n]


def run_noise(first: dict | None, again: dict | None) -> float | None:
    """The run-to-run noise: the baseline's first level measured twice in its launch, |a - b| / their mean."""
    a, b = (first or {}).get("tokens_per_s"), (again or {}).get("tokens_per_s")
    return round(abs(a - b) / ((a + b) / 2), 4) if a and b else None


def choose(levels: list[int], measured: dict, noise_run: float | None = None) -> list[dict]:
    """Per level, the fastest of {off, each measured k}; its margin over the runner-up and whether that margin is
    beyond the noise: twice the run-to-run noise measured (run_noise), at least NOISE_FLOOR.
    measured: {"off"|"k": [level figures]}."""
    out = []
    for c in levels:
        tps, itl = {}, {}
        for name, figs in measured.items():
            lv = next((x for x in figs if x["concurrency"] == c), None)
            if lv is not None:
                tps[name], itl[name] = lv.get("tokens_per_s"), lv.get("itl_ms_p50")
        ok = {k: v for k, v in tps.items() if v}
        win = max(ok, key=ok.get) if ok else None
        rest = sorted(((v, k) for k, v in ok.items() if k != win), reverse=True)
        margin = round(ok[win] / rest[0][0] - 1, 4) if win and rest else None
        noise = max(NOISE_FLOOR, 2 * (noise_run or 0.0)) if win and rest else None
        vs_off = round(ok[win] / ok["off"], 3) if win and ok.get("off") else None
        out.append({"concurrency": c, "tokens_per_s": tps, "itl_ms_p50": itl, "winner": win, "runner_up":
                    rest[0][1] if rest else None, "margin": margin, "noise": round(noise, 4) if noise else None,
                    "significant": bool(margin is not None and margin > noise), "speedup_vs_off": vs_off})
    return out


def schedule_of(chosen: list[dict]) -> list[list[int]]:
    """The levels' winners as vLLM's batch-size schedule: level i covers the batch sizes from the geometric middle
    between it and the level below to the middle between it and the level above (the first from 1, the last to
    MAX_BATCH); k = the winner, 0 where the baseline wins; neighbours with the same k merged."""
    rows: list[list[int]] = []
    levels = [x["concurrency"] for x in chosen]
    for i, x in enumerate(chosen):
        start = 1 if i == 0 else rows[-1][1] + 1
        end = MAX_BATCH if i == len(chosen) - 1 else max(start, int(math.sqrt(levels[i] * levels[i + 1])))
        k = 0 if x["winner"] in (None, "off") else int(x["winner"])
        if rows and rows[-1][2] == k:
            rows[-1][1] = end
        else:
            rows.append([start, end, k])
    return rows


def verdict_text(chosen: list[dict], schedule: list | None, k: int | None) -> str:
    """One line: what tune found (deploy status shows it too)."""
    wins = [x for x in chosen if x["winner"] not in (None, "off")]
    loses = [x for x in chosen if x["winner"] == "off"]
    if not wins:
        return "speculation loses at every measured level: turn it off"
    parts = []
    if schedule:
        for a, b, kk in schedule:
            rng = f"{a}-{b}" if b < MAX_BATCH else f"{a}+"
            parts.append(f"k={kk} at {rng} requests" if kk else f"off at {rng} requests")
    elif k is not None:
        parts.append(f"k={k}")
        if loses:
            parts.append("loses at " + ", ".join(str(x["concurrency"]) for x in loses) + " requests")
    first = chosen[0]
    if first["speedup_vs_off"]:
        parts.append(f"{first['speedup_vs_off']:.2f}x plain at {first['concurrency']} request"
                     + ("s" if first["concurrency"] > 1 else ""))
    return "; ".join(parts)


# ------------------------------------------------------------------ the playbook edit


def edit_text(text: str, *, k: int | None, schedule: list | None) -> str:
    """The playbook's text with speculative.num_speculative_tokens (and .schedule) replaced, everything else as it
    was: ruamel.yaml's round trip keeps comments, order and layout; the schedule in flow style, one line."""
    from ruamel.yaml import YAML  # lazy: only tune --write/diff needs it
    from ruamel.yaml.comments import CommentedSeq

    y = YAML()
    y.preserve_quotes = True
    y.width = 4096
    y.indent(mapping=2, sequence=4, offset=2)
    doc = y.load(text)
    spec = doc["speculative"]
    if k is not None:
        spec["num_speculative_tokens"] = k
    if schedule:
        seq = CommentedSeq([CommentedSeq(r) for r in schedule])
        seq.fa.set_flow_style()
        for r in seq:
            r.fa.set_flow_style()
        if "schedule" in spec:
            spec["schedule"] = seq
        else:
            keys = list(spec.keys())
            spec.insert(keys.index("num_speculative_tokens") + 1, "schedule", seq,
                        comment="k by batch size, 0 = no drafts (deploy tune)")
    elif "schedule" in spec:
        del spec["schedule"]
    out = io.StringIO()
    y.dump(doc, out)
    return out.getvalue()


def unified(path: str, before: str, after: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), fromfile=path,
                                        tofile=path + " (tuned)"))


# ------------------------------------------------------------------ the run


def _launch(fleet, pb: Playbook, progress: Progress, opts: ops.Options, step: P.Step | None) -> tuple[dict, dict | None]:
    """One launch: a real up with its gate, then compare's sweep. -> (the launch record, the measurement). Without a
    step: the last launch, the chosen configuration left running (not swept again)."""
    t0 = time.monotonic()
    progress.say(pb.where, f"tune: launching {label(pb)}" if step else f"tune: leaving {label(pb)} running")
    out = ops.up(fleet, pb, progress, dataclasses.replace(opts, yes=True))
    g = (out.info or {}).get("gate") or {}
    rec = {"config": label(pb), **_k(pb), "ok": out.ok, "status": out.status,
           "gate": {"passed": bool(g.get("passed")), "reason": g.get("reason")} if out.ok else
           {"passed": False, "reason": out.error.message if out.error else out.status},
           "error": out.error.as_dict() if out.error else None}
    m = None
    if out.ok and step:
        try:
            m = C._measure(fleet, pb, progress, step)
        except DeployError as e:
            rec.update(ok=False, error=e.as_dict())
    rec["seconds"] = round(time.monotonic() - t0, 2)
    if not step:
        return {**rec, "final": True}, None
    progress.say(pb.where, f"tune: {label(pb)}: " + (
        f"measured in {rec['seconds']:.1f} s" if rec["ok"] else
        f"dropped after {rec['seconds']:.1f} s: {(rec['error'] or {}).get('message') or rec['status']}"))
    return rec, m


def _schedule_supported(fleet, pb: Playbook, progress: Progress) -> tuple[bool, str | None]:
    """Whether the container's vLLM has num_speculative_tokens_per_batch_size: the fields of its SpeculativeConfig,
    as verify reads them (Python's ast on vllm/config/speculative.py)."""
    ctx = ops.new_context(fleet, pb, progress)
    r = ctx.call(P.step_verify(dataclasses.replace(pb, spec_off=True)))
    stack = getattr(r, "stack", None) or {}
    fields = (stack.get("spec_fields") or {}).get("fields")
    return bool(fields and SCHEDULE_KEY in fields), stack.get("version")


def tune(fleet, pb: Playbook, progress: Progress, opts: ops.Options, *, prompts: list[str], rounds: int,
         max_tokens: int, timeout_s: float, levels: list[int], max_launches: int = 2, write: bool = False,
         inventory=None) -> dict:
    where = f"{pb.host}/{pb.vmid}"
    levels, capped = cap_levels(pb, sorted(levels))
    warnings = [capped] if capped else []
    step = P.step_sweep(pb, prompts, rounds, max_tokens, timeout_s * len(levels), list(levels))
    # the baseline sweeps its first level once more at the end: the run-to-run noise, measured
    step_off = P.step_sweep(pb, prompts, rounds, max_tokens, timeout_s * (len(levels) + 1),
                            list(levels) + [levels[0]])
    launches, measured, acceptance = [], {}, None

    def run(v: Playbook, step=step) -> dict | None:
        rec, m = _launch(fleet, v, progress, opts, step)
        launches.append(rec)
        return m if rec["ok"] else None

    res = {"ok": False, "target": where, "playbook": pb.name, "method": pb.conf.speculative.method, "concurrency": levels,
           "prompts": len(prompts), "rounds": rounds, "max_tokens": max_tokens, "launches": launches,
           "levels": [], "predicted": {}, "prediction_error": {}, "chosen": None, "written": None, "backup": None,
           "diff": "", "warnings": warnings, "verdict": None, "kept": None,
           "prediction_tolerance": PREDICTION_TOLERANCE}
    base = run(pb.variant(off=True), step_off)
    if base is None:
        res["error"] = launches[-1]["error"]
        return res
    again = base["levels"].pop() if len(base["levels"]) > len(levels) else None
    res["run_to_run_noise"] = noise = run_noise(base["levels"][0] if base["levels"] else None, again)
    measured["off"] = base["levels"]
    sched_ok, version = _schedule_supported(fleet, pb, progress)
    res["vllm_version"], res["schedule_supported"] = version, sched_ok
    big_k = largest_k(pb)
    big = run(pb.variant(k=big_k))
    if big is not None:
        measured[str(big_k)] = big["levels"]
        acceptance = big.get("acceptance")
    per_pos = list((acceptance or {}).get("per_position") or [])
    res["acceptance"] = acceptance
    off_tps = {lv["concurrency"]: lv["tokens_per_s"] for lv in base["levels"] if lv.get("tokens_per_s")}
    if big is not None and per_pos:
        pred = predict(base["levels"], big["levels"], per_pos, min(big_k, len(per_pos)))
        res["predicted"] = {str(k): {str(c): v for c, v in by.items()} for k, by in pred.items()}
        for k in pick_candidates(pred, off_tps, big_k, max_launches):
            m = run(pb.variant(k=k))
            if m is not None:
                measured[str(k)] = m["levels"]
        for name, figs in measured.items():
            if name == "off" or name not in res["predicted"]:
                continue
            errs = {}
            for lv in figs:
                p = res["predicted"][name].get(str(lv["concurrency"]))
                if p and lv.get("tokens_per_s"):
                    errs[str(lv["concurrency"])] = round((p - lv["tokens_per_s"]) / lv["tokens_per_s"], 4)
            res["prediction_error"][name] = errs
    elif big is None:
        warnings.append(f"the largest k ({big_k}) failed its launch: nothing predicts the other values of k; only the "
                        "baseline was measured")
    chosen = choose(levels, measured, noise)
    res["levels"] = chosen
    # the proposal
    orig_k = pb.conf.speculative.num_speculative_tokens
    wins = [x for x in chosen if x["winner"] not in (None, "off")]
    loses = [x for x in chosen if x["winner"] == "off"]
    expected = pb.conf.tune.expected_concurrency
    why = f"vLLM {version or '(unknown version)'} has no {SCHEDULE_KEY} (vLLM >= 0.27)"
    if not wins:
        proposal = {"k": orig_k, "schedule": None, "off": True}
        warnings.append("speculation loses at every measured level: turn it off (serve without the drafter; no "
                        "playbook key does that: a schedule of k=0 everywhere would keep the drafter loaded, which "
                        "still costs its memory and a few % per step, vLLM #49548); the baseline is left running")
    elif sched_ok:
        schedule = schedule_of(chosen)
        # one k for every batch size is no schedule: plain num_speculative_tokens (a schedule switches vLLM's CUDA
        # graphs to PIECEWISE, which costs even where k does not change: vLLM #49548)
        proposal = {"k": max(r[2] for r in schedule), "schedule": schedule if len(schedule) > 1 else None,
                    "off": False}
        if loses:
            warnings.append("no drafts (k=0) at " + ", ".join(str(x["concurrency"]) for x in loses) + " requests: "
                            "the loaded drafter still costs its memory and a few % per step there (vLLM #49548)")
    else:
        at = max([x for x in chosen if x["concurrency"] <= expected] or chosen[:1], key=lambda x: x["concurrency"])
        w = at["winner"]
        proposal = {"k": int(w) if w not in (None, "off") else orig_k, "schedule": None,
                    "off": w in (None, "off"), "expected_concurrency": expected, "decided_at": at["concurrency"]}
        if proposal["off"]:
            warnings.append(f"speculation loses at the expected load (tune.expected_concurrency {expected}, measured "
                            f"at {at['concurrency']}): turn it off (serve without the drafter); {why}")
        elif loses:
            warnings.append("speculation loses at " + ", ".join(str(x["concurrency"]) for x in loses)
                            + f" requests (one k for every load: {why})")
    res["chosen"] = proposal
    res["verdict"] = verdict_text(chosen, proposal["schedule"], proposal["k"])
    # the playbook change
    with open(pb.path, encoding="utf-8") as fh:
        before = fh.read()
    # no playbook key turns speculation off (said in the warnings): then the playbook stays as it is
    after = before if proposal["off"] else edit_text(before, k=proposal["k"], schedule=proposal["schedule"])
    res["diff"] = unified(pb.path, before, after)
    if write and after != before:
        from orchestrator.core.atomic import write_atomic

        # write_atomic's check: the strict schema and the cross-checks, on the temp file, before it replaces pb.path
        res["backup"] = write_atomic(pb.path, after, keep_mode=True, backup=True,
                                     check=lambda tmp: load_playbook(tmp, inventory),
                                     fix=f"the playbook {pb.path} was left as it was; apply the diff by hand")
        res["written"] = pb.path
    # leave the best configuration running
    if proposal["off"]:
        final = pb.variant(off=True)
    elif res["written"]:
        final = load_playbook(pb.path, inventory).variant()
    else:
        final = pb.variant(k=proposal["k"], schedule=proposal["schedule"])
    last = launches[-1] if launches else None
    if last and last["ok"] and last["config"] == label(final):
        res["kept"] = {"config": label(final), "ok": True, "status": "up", "error": None}
    else:
        rec, _ = _launch(fleet, final, progress, opts, None)
        launches.append(rec)
        res["kept"] = {"config": rec["config"], "ok": rec["ok"], "status": rec["status"], "error": rec["error"]}
    res["ok"] = bool(res["kept"]["ok"])
    if res["ok"]:
        _record(fleet, final, progress, res)
    return res


def _record(fleet, pb: Playbook, progress: Progress, res: dict) -> None:
    """tune.json beside the state file: deploy status shows the verdict for the launch left running. A failure to
    record is a warning (status then says `not tuned`)."""
    ctx = ops.new_context(fleet, pb, progress)
    step = P.step_tune_record(pb, res["verdict"], res["chosen"])
    try:
        r = ctx.call(step)
        ok, msg = bool(r.ok), r.message
    except DeployError as e:
        ok, msg = False, e.message
    if not ok:
        res["warnings"].append(f"could not record the verdict in {pb.conf.runtime.state_dir}/tune.json ({msg}): "
                               "deploy status says `not tuned`")


# ------------------------------------------------------------------ output


def render(res: dict) -> list[str]:
    lines = []
    names = sorted(C.names_seen(res.get("levels") or []), key=lambda n: -1 if n == "off" else int(n))
    head = ["concurrency"] + [("off" if n == "off" else f"k={n}") + " tok/s (ITL p50 ms)" for n in names] + \
        ["winner", "margin"]
    rows = []
    for x in res.get("levels") or []:
        cells = [str(x["concurrency"])]
        for n in names:
            v, i = x["tokens_per_s"].get(n), x["itl_ms_p50"].get(n)
            cells.append(f"{v:g} ({i:g})" if v is not None and i is not None else (f"{v:g}" if v else "-"))
        w = x["winner"]
        cells.append("-" if w is None else ("off" if w == "off" else f"k={w}"))
        cells.append("-" if x["margin"] is None else f"+{x['margin']:.1%}" + ("" if x["significant"] else
                                                                             " (within noise)"))
        rows.append(cells)
    if rows:
        w = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
        for r in [head] + rows:
            lines.append("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip())
    for name, errs in (res.get("prediction_error") or {}).items():
        pred = res["predicted"].get(name, {})
        cells = [f"{c}: {pred[c]:g} vs {x['tokens_per_s'][name]:g} ({errs[c]:+.0%})"
                 for x in res.get("levels") or [] if (c := str(x["concurrency"])) in errs]
        if cells:
            worst = max(abs(e) for e in errs.values())
            lines.append(f"k={name} predicted vs measured tok/s: " + ", ".join(cells) +
                         ("" if worst <= res["prediction_tolerance"] else
                          f"  (off by more than {res['prediction_tolerance']:.0%}: the step-time model is rough here)"))
    lines += chart(res)
    for rec in res.get("launches") or []:
        lines.append(f"launch {rec['config']}: {rec['seconds']:.1f} s, "
                     + ("gate passed" if rec["ok"] else f"dropped: {(rec['error'] or {}).get('message') or rec['status']}"))
    for wmsg in res.get("warnings") or []:
        lines.append(f"warning: {wmsg}")
    ch = res.get("chosen")
    if ch:
        lines.append("verdict: " + (res.get("verdict") or "-"))
        if ch.get("schedule"):
            lines.append(f"proposal: num_speculative_tokens {ch['k']}, schedule {ch['schedule']} "
                         f"({SCHEDULE_KEY})")
        elif ch.get("off"):
            lines.append("proposal: serve without speculative decoding (no playbook key does that: remove the "
                         "drafter, or keep it and accept the loss)")
        else:
            lines.append(f"proposal: num_speculative_tokens {ch['k']} (wins at tune.expected_concurrency "
                         f"{ch.get('expected_concurrency')})")
    if res.get("diff"):
        lines.append("the playbook change:" if res.get("written") else "the playbook change (not written; --write "
                                                                        "applies it):")
        lines += res["diff"].rstrip("\n").splitlines()
    elif ch:
        lines.append("the playbook already says this: no change")
    if res.get("written"):
        lines.append(f"written: {res['written']} (backup {res['backup']})")
    k = res.get("kept")
    if k:
        lines.append(f"left running on {res['target']}: {k['config']}" if k["ok"] else
                     f"could not leave {k['config']} running on {res['target']}: {(k['error'] or {}).get('message')}")
    elif res.get("error"):
        lines.append(f"tune stopped: {res['error'].get('message')}"
                     + (f"\n  fix: {res['error']['fix']}" if res["error"].get("fix") else ""))
    return lines


def chart(res: dict, width: int = 40) -> list[str]:
    """compare's terminal chart over tune's configurations (off, each measured k)."""
    levels = [{"concurrency": x["concurrency"], "tokens_per_s": {("off" if n == "off" else f"k={n}"): v
                                                                  for n, v in x["tokens_per_s"].items()}}
              for x in res.get("levels") or []]
    return C.bars(levels, C.names_seen(levels), width)


def plot(res: dict, path: str) -> str:
    """tokens/s and ITL p50 against concurrency, one line per configuration (matplotlib, Agg)."""
    import matplotlib  # lazy: optional (the plot extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = C.names_seen(res.get("levels") or [])
    for ax, key, title in ((axes[0], "tokens_per_s", "output tokens/s"), (axes[1], "itl_ms_p50", "ITL p50 (ms)")):
        for n in names:
            pts = [(x["concurrency"], x[key].get(n)) for x in res["levels"] if x[key].get(n) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label="off" if n == "off" else f"k={n}")
        C.concurrency_axes(ax, title, res.get("concurrency"))
    fig.suptitle(f"deploy tune {res['playbook']} on {res['target']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def check_args(pb: Playbook, max_launches: int) -> None:
    if pb.is_fleet:
        raise UsageError(f"{pb.name} has several targets; tune runs on one container",
                         fix="tune a single-target playbook of the same model (its measurements hold for every "
                             "replica on the same hardware)")
    if max_launches < 0:
        raise UsageError("--max-launches must be >= 0", fix="--max-launches 2")
    if not os.access(pb.path, os.R_OK):
        raise UsageError(f"cannot read {pb.path}", fix="check its permissions")
