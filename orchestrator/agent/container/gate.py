"""`gate_record`: the acceptance gate's verdict kept in the state directory (what passed, when, the drafts it was
measured on), and `gate_status` for `deploy status` (the verdict of the server serving now)."""

import os

from .core import dumps, loads, now
from .files import _read_json, remove_owned, write_json_atomic


def act_gate_record(a):
    """Record the gate's verdict, with its figures, for the launch it belongs to (state.json's launch id): a later
    `deploy up` says `already up` only for a launch with a passed verdict, and `deploy status` shows a launch
    without one as `not gated`. A rejection a fallback follows is also kept in rejected.json (it outlives the
    rejected launch; status shows it beside the fallback); a passed verdict of that playbook clears it."""
    sd = a["state_dir"]
    st = _read_json(os.path.join(sd, "state.json")) or {}
    v = dict(a.get("verdict") or {})
    rec = {"playbook": a.get("playbook"), "at": now(), "launch_id": st.get("launch_id"), "pid": st.get("pid"),
           "started_at": st.get("started_at"), "verdict": v}
    write_json_atomic(os.path.join(sd, "gate.json"), rec)
    back = _read_json(os.path.join(sd, "gate.json"))
    if back != loads(dumps(rec)):
        return {"ok": False, "message": "%s/gate.json reads back differently than written" % sd}
    rej = _read_json(os.path.join(sd, "rejected.json"))
    out = {"ok": True, "launch_known": bool(st.get("launch_id")), "rejected": False, "cleared": False}
    if v.get("rejected_fallback"):
        write_json_atomic(os.path.join(sd, "rejected.json"), {k: rec[k] for k in ("playbook", "at", "verdict")})
        out["rejected"] = _read_json(os.path.join(sd, "rejected.json")) is not None
    elif v.get("passed") and rej and rej.get("playbook") == a.get("playbook"):
        remove_owned(sd, "rejected.json")
        out["cleared"] = True
    return out


def gate_status(state_dir, st):
    """What status and `current` report about the gate: the verdict of the launch running now (None: not gated),
    and the last rejection that a fallback followed."""
    out = {"gate": None, "rejected": _read_json(os.path.join(state_dir, "rejected.json"))}
    g = _read_json(os.path.join(state_dir, "gate.json"))
    if isinstance(g, dict):
        lid = g.pop("launch_id", None)
        g["for_current_launch"] = bool(lid) and bool(st) and not st.get("corrupt") and lid == st.get("launch_id")
        out["gate"] = g
    return out


def act_tune_record(a):
    """Record deploy tune's verdict with the launch it left running (state.json's launch id and argv): deploy status
    shows it for that configuration, `not tuned` for any other."""
    sd = a["state_dir"]
    st = _read_json(os.path.join(sd, "state.json")) or {}
    rec = {"playbook": a.get("playbook"), "at": now(), "launch_id": st.get("launch_id"), "argv": st.get("argv"),
           "verdict": a.get("verdict"), "chosen": a.get("chosen")}
    write_json_atomic(os.path.join(sd, "tune.json"), rec)
    if _read_json(os.path.join(sd, "tune.json")) != loads(dumps(rec)):
        return {"ok": False, "message": "%s/tune.json reads back differently than written" % sd}
    return {"ok": True}
