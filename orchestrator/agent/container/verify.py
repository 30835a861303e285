"""`verify`: the drafter config vLLM will read, checked: path, bytes (sha256), every key against the pinned file,
cross-checks against the target model and the launch, the config as transformers loads it (no remote code unless
trusted), the serving stack (stack.py) and the weights header."""

import stat as _stat
import errno
import hashlib
import json
import os
import re
import sys

from .core import sha256_or_none
from .stack import _vllm_stack, _vtuple, serving_checks


ABSENT = "<absent>"


def _load_json_strict(raw):
    def hook(pairs):
        d = {}
        for k, v in pairs:
            if k in d:
                raise ValueError("duplicate key %r" % k)
            d[k] = v
        return d
    return json.loads(raw.decode("utf-8"), object_pairs_hook=hook)


def _get(d, dotted):
    cur = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return ABSENT
        cur = cur[part]
    return cur


def resolve_drafter_path(a):
    """The config.json vLLM will really read: a local dir, or the hub cache snapshot for a hub id."""
    if a.get("path"):
        p = os.path.join(a["path"], "config.json")
        return {"kind": "local", "path": p, "realpath": os.path.realpath(p)}
    org, name = a["hub_id"].split("/", 1)
    base = os.path.join(a.get("hf_home") or "/root/.cache/huggingface", "hub", "models--%s--%s" % (org, name))
    rev = None
    want = a.get("revision") or "main"  # from the playbook
    try:
        if re.match(r"^[0-9a-f]{40}$", want) and os.path.isdir(os.path.join(base, "snapshots", want)):
            rev = want  # a pinned commit (deploy fetch put it there)
        else:
            fd = os.open(os.path.join(base, "refs", want), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as fh:
                if not _stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                    raise OSError(errno.EINVAL, "not a regular file")
                rev = fh.read(256).decode("utf-8", "replace").strip()
            if not safe_rev(rev):
                return {"kind": "hub", "path": None, "error": "%s/refs/%s holds %r, not a snapshot name (40 hex "
                                                              "digits)" % (base, want, rev[:80])}
    except OSError:
        snaps = sorted(os.listdir(os.path.join(base, "snapshots"))) if os.path.isdir(os.path.join(base, "snapshots")) else []
        snaps = [n for n in snaps if safe_rev(n)]
        rev = snaps[-1] if snaps else None
    if not rev:
        return {"kind": "hub", "path": None, "error": "no snapshot of %s in %s" % (a["hub_id"], base)}
    p = os.path.join(base, "snapshots", rev, "config.json")
    return {"kind": "hub", "path": p, "realpath": os.path.realpath(p), "revision": rev}


def act_verify(a):
    """Check the drafter config vLLM will read: path, bytes, fields, cross-checks, as loaded, serving stack."""
    checks = []

    def check(name, ok, expected=None, on_disk=None, as_loaded=None, reason="", severity="error"):
        checks.append({"check": name, "ok": bool(ok), "expected": expected, "on_disk": on_disk,
                       "as_loaded": as_loaded, "reason": "" if ok else reason, "severity": severity})

    out = {"checks": checks, "python": sys.executable}
    if a.get("stack_only"):  # playbooks without a drafter (MTP): only the serving stack
        out["stack"] = _vllm_stack(float(a.get("import_timeout_s", 120)))
        serving_checks(out["stack"], {}, a, check)
        return out
    pinned = a["pinned"]
    loc = resolve_drafter_path(a)
    out["location"] = loc
    if not loc.get("path"):
        check("path", False, reason=loc.get("error"))
        return out
    path = loc["path"]
    if a.get("hub_id") and a.get("local_path_hint"):
        out["local_hint"] = a["local_path_hint"]
    try:
        with open(path, "rb") as fh:
            raw = fh.read(4 << 20)
    except OSError as e:
        check("path", False, expected=path, on_disk=None,
              reason="cannot read %s: %s" % (path, e.strerror))
        return out
    check("path", True, expected=path, on_disk=loc["realpath"])
    sha = hashlib.sha256(raw).hexdigest()
    out["sha256"] = sha
    check("sha256", sha == a["sha256"], expected=a["sha256"], on_disk=sha,
          reason="the file vLLM reads is not the pinned config (%s)" % loc["realpath"])
    try:
        disk = _load_json_strict(raw)
        if not isinstance(disk, dict):
            raise ValueError("top level is not a JSON object")
        check("json", True)
    except ValueError as e:
        check("json", False, reason="not valid JSON: %s" % e)
        return out

    # 3a. every key against the pinned file
    def walk(p, d, prefix=""):
        keys = sorted(set(p) | set(d)) if isinstance(p, dict) and isinstance(d, dict) else []
        for k in keys:
            name = prefix + k
            pv, dv = p.get(k, ABSENT), d.get(k, ABSENT)
            if isinstance(pv, dict) and isinstance(dv, dict):
                walk(pv, dv, name + ".")
            elif pv != dv:
                check("field " + name, False, expected=pv, on_disk=dv, reason="differs from the pinned config")
    before = len(checks)
    walk(pinned, disk)
    if len(checks) == before:
        check("fields", True, reason="", expected="all %d keys as pinned" % len(pinned))

    # 3b. cross-checks against the target model and the launch
    target = None
    try:
        with open(os.path.join(a["target_path"], "config.json"), "rb") as fh:
            tcfg = _load_json_strict(fh.read(4 << 20))
        target = tcfg.get("text_config") or tcfg
        out["target"] = {k: target.get(k) for k in ("num_hidden_layers", "hidden_size", "vocab_size")}
    except (OSError, ValueError) as e:
        check("target config", False, expected=os.path.join(a["target_path"], "config.json"),
              reason="cannot read the target model's config.json: %s" % getattr(e, "strerror", e))
    cross(disk, target, a, check)

    # 4. as loaded by the container's Python (the one that runs vLLM)
    loaded = load_as_vllm(os.path.dirname(path), out, check, disk, bool(a.get("trust_remote_code")))
    if loaded is not None:
        crit = ["layer_types", "sliding_window", "use_sliding_window", "max_window_layers", "dflash_config",
                "bos_token_id", "rope_theta", "num_hidden_layers", "hidden_size", "vocab_size", "block_size",
                "num_target_layers", "mask_token_id", "eagle_aux_hidden_state_layer_ids", "is_causal"]
        for key in crit:
            rv, lv = disk.get(key, ABSENT), loaded.get(key, ABSENT)
            if rv == ABSENT and lv in (ABSENT, None):
                continue
            if rv == ABSENT:
                check("loaded " + key, False, expected=ABSENT, on_disk=ABSENT, as_loaded=lv,
                      reason="absent from the raw file but set after loading (a default filled in)")
            elif rv != lv:
                reason = "changed by loading"
                if key == "sliding_window" and disk.get("use_sliding_window") is not True:
                    reason = "the window was dropped on load because use_sliding_window is not true"
                check("loaded " + key, False, expected=rv, on_disk=rv, as_loaded=lv, reason=reason)
        for key in ("layer_types", "sliding_window", "use_sliding_window", "dflash_config"):
            if key in disk and loaded.get(key, ABSENT) == disk.get(key):
                check("loaded " + key, True, expected=pinned.get(key, ABSENT), on_disk=disk.get(key),
                      as_loaded=loaded.get(key))

    out["sha256_after"] = sha256_or_none(path)
    check("unchanged during verify", out["sha256_after"] == sha, expected=sha, on_disk=out["sha256_after"],
          reason="the file changed while it was being verified: something rewrites it")

    # 5. the serving stack
    stack = _vllm_stack(float(a.get("import_timeout_s", 120)))
    out["stack"] = stack
    serving_checks(stack, disk, a, check)
    if a.get("method") == "dflash":
        dflash_semantics(disk, stack, check)

    # 6. safetensors header
    st_path = os.path.join(os.path.dirname(path), "model.safetensors")
    if os.path.exists(st_path):
        safetensors_check(st_path, disk, check)
    return out


def cross(disk, target, a, check):
    n_layers = disk.get("num_hidden_layers")
    lt = disk.get("layer_types")
    if isinstance(lt, list) and isinstance(n_layers, int):
        check("layer_types length", len(lt) == n_layers, expected=n_layers, on_disk=len(lt),
              reason="len(layer_types) must equal num_hidden_layers")
        bad = [x for x in lt if x not in ("sliding_attention", "full_attention")]
        check("layer_types values", not bad, expected="sliding_attention|full_attention",
              on_disk=(("unknown: %s" % bad) if bad else "|".join(sorted(set(lt)))),
              reason="unknown layer types")
    sliding = isinstance(lt, list) and "sliding_attention" in lt
    win = disk.get("sliding_window")
    has_win = isinstance(win, int) and win > 0
    check("window iff sliding", has_win == sliding, expected="a positive window" if sliding else "no window",
          on_disk=win, reason="sliding layers need a positive sliding_window" if sliding
          else "a window is set but no layer slides")
    if sliding or has_win:
        check("use_sliding_window", disk.get("use_sliding_window") is True, expected=True,
              on_disk=disk.get("use_sliding_window", ABSENT),
              reason="transformers drops the window (sliding_window=None) unless use_sliding_window is true")
    dc = disk.get("dflash_config") if isinstance(disk.get("dflash_config"), dict) else {}
    ids = dc.get("target_layer_ids")
    k = a.get("num_speculative_tokens")
    block = disk.get("block_size")
    if isinstance(block, int) and isinstance(k, int):
        check("block_size vs num_speculative_tokens", k <= block - 1, expected="<= %d" % (block - 1), on_disk=k,
              reason="num_speculative_tokens must be at most block_size - 1")
    if "rope_theta" not in disk and "rope_parameters" not in disk:
        check("rope_theta", False, expected="present", on_disk=ABSENT,
              reason="absent: vLLM falls back to 1e6 silently")
    for key in ("use_swa", "causal"):
        if key in dc:
            check("override dflash_config." + key, False, expected=ABSENT, on_disk=dc[key],
                  reason="this key overrides vLLM's behaviour")
    am = disk.get("auto_map") if isinstance(disk.get("auto_map"), dict) else {}
    if "AutoConfig" in am:
        mod = am["AutoConfig"].split(".")[0] + ".py"
        check("auto_map.AutoConfig module", os.path.exists(os.path.join(os.path.dirname(a.get("_cfg_path", "")), mod))
              or os.path.exists(os.path.join(a.get("path") or "", mod)), expected=mod, on_disk=ABSENT,
              reason="AutoConfig names a module file that is not in the drafter directory")
    if target is None:
        return
    N = target.get("num_hidden_layers")
    dflash = a.get("method") in (None, "dflash")  # EAGLE3 drafters have no num_target_layers or mask token
    if dflash:
        check("num_target_layers", disk.get("num_target_layers") == N, expected=N,
              on_disk=disk.get("num_target_layers", ABSENT),
              reason="must equal the target's text_config.num_hidden_layers")
    if isinstance(ids, list) and isinstance(N, int):
        bad = [i for i in ids if not isinstance(i, int) or i < 0 or i + 1 > N - 1]
        inc = all(isinstance(x, int) and isinstance(y, int) and x < y for x, y in zip(ids, ids[1:]))
        check("target_layer_ids range", not bad, expected="0 <= id and id + 1 <= %d" % (N - 1), on_disk=ids,
              reason="ids out of range: %s" % bad)
        check("target_layer_ids order", inc and len(set(map(str, ids))) == len(ids), expected="unique, increasing",
              on_disk=ids, reason="ids must be unique and increasing")
    for key in ("hidden_size", "vocab_size"):
        check(key + " matches target", disk.get(key) == target.get(key), expected=target.get(key),
              on_disk=disk.get(key, ABSENT), reason="the drafter shares the target's embeddings and LM head")
    mt = dc.get("mask_token_id", disk.get("mask_token_id"))  # vLLM reads dflash_config's, else the top-level key
    vs = target.get("vocab_size")
    if isinstance(vs, int) and dflash:
        check("mask_token_id range", isinstance(mt, int) and 0 <= mt < vs, expected="< %d" % vs, on_disk=mt,
              reason="mask_token_id must be a token of the target's vocabulary")


def load_as_vllm(dirpath, out, check, disk, trust_remote_code=False):
    """Load the config the way vLLM does, in this Python; return a plain dict of attributes (or None).

    Without the playbook's serve.trust_remote_code, code named by the config (auto_map.AutoConfig) is never run:
    this agent runs as root, and vLLM itself refuses such a config without --trust-remote-code."""
    am = disk.get("auto_map") if isinstance(disk.get("auto_map"), dict) else {}
    out["trust_remote_code"] = trust_remote_code
    if "AutoConfig" in am and not trust_remote_code:
        check("remote code", False, expected="no auto_map.AutoConfig, or serve.trust_remote_code: true",
              on_disk="auto_map.AutoConfig = %s" % am["AutoConfig"],
              reason="loading this config would run %s.py from %s as root; not loaded. Fix: drop auto_map."
                     "AutoConfig from the config, or, if you trust that code, set serve.trust_remote_code: true "
                     "in the playbook (it also passes --trust-remote-code to vLLM)"
                     % (str(am["AutoConfig"]).split(".")[0], dirpath))
        return None
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import transformers
        from transformers import AutoConfig
    except Exception as e:  # noqa: BLE001
        out["loaded_error"] = "cannot import transformers in %s: %s" % (sys.executable, e)
        check("as loaded", False, expected="transformers importable", reason=out["loaded_error"])
        return None
    out["transformers_version"] = transformers.__version__
    out["loader"] = "transformers.AutoConfig"
    try:
        cfg = AutoConfig.from_pretrained(dirpath, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        msg = "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        check("as loaded", False, expected="loads", as_loaded=msg, reason="AutoConfig.from_pretrained failed: " + msg)
        return None
    d = {k: v for k, v in vars(cfg).items() if not k.startswith("_")}
    rp = getattr(cfg, "rope_parameters", None)
    if "rope_theta" not in d and isinstance(rp, dict) and "rope_theta" in rp:
        d["rope_theta"] = rp["rope_theta"]
    check("as loaded", True, expected="loads", as_loaded=type(cfg).__name__)
    return json.loads(json.dumps(d, default=str))


def dflash_semantics(disk, stack, check):
    """How the installed vLLM reads this drafter config (0.34.0): a stray eagle_aux_hidden_state_layer_ids wins
    over target_layer_ids, dflash_config.swa_window_size over sliding_window, a top-level is_causal over every
    layer, use_sliding_window: true makes every layer sliding, mask_token_id falls back to the top-level key."""
    ver = "vLLM %s" % (stack.get("version") or "(unknown version)")
    dc = disk.get("dflash_config") if isinstance(disk.get("dflash_config"), dict) else {}
    ids = dc.get("target_layer_ids")
    aux = disk.get("eagle_aux_hidden_state_layer_ids", ABSENT)
    if aux is not ABSENT:
        want = [i + 1 for i in ids] if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else None
        check("semantics eagle_aux_hidden_state_layer_ids", aux == want, expected=ABSENT if want is None else
              "absent, or %s" % want, on_disk=aux,
              reason="%s taps the target layers given by eagle_aux_hidden_state_layer_ids %s as they are (no +1), "
                     "silently instead of dflash_config.target_layer_ids %s (taps %s): the drafter would read the "
                     "wrong target layers; remove the key" % (ver, aux, ids, want))
    lt = disk.get("layer_types") if isinstance(disk.get("layer_types"), list) else []
    sliding = "sliding_attention" in lt
    swa, win = dc.get("swa_window_size", ABSENT), disk.get("sliding_window")
    if swa is not ABSENT:
        check("semantics dflash_config.swa_window_size", swa == win, expected="absent, or equal to sliding_window "
              "%s" % win, on_disk=swa,
              reason="%s takes the window from dflash_config.swa_window_size (%s) before sliding_window (%s)"
                     % (ver, swa, win))
    eff = swa if swa is not ABSENT and swa else win
    if sliding:
        check("semantics sliding window", isinstance(eff, int) and eff > 0, expected="a positive window",
              on_disk=eff, reason="%s needs a window for sliding layers (dflash_config.swa_window_size, else "
                                  "sliding_window): without one it stops at startup with a ValueError" % ver)
    if "is_causal" in disk:
        check("semantics is_causal", False, expected=ABSENT, on_disk=disk["is_causal"],
              reason="%s applies a top-level is_causal (%s) to every layer, before dflash_config.causal and "
                     "layer_types; DFlash drafts with non-causal attention: remove the key" % (ver, disk["is_causal"]))
    v = _vtuple(stack.get("version"))
    if disk.get("use_sliding_window") is True and "full_attention" in lt and v is not None and v >= (0, 34):
        full = [i for i, t in enumerate(lt) if t == "full_attention"]
        check("semantics use_sliding_window", False, expected="layer_types as given", on_disk="every layer sliding",
              reason="%s runs every layer with sliding attention because use_sliding_window is true, layer(s) %s "
                     "too, which layer_types marks full_attention (window %s). Does it matter? Not for contexts up "
                     "to %s tokens (the same attention); beyond, those layer(s) see only the last %s tokens, and "
                     "the acceptance gate measures what that costs. Nothing to change: transformers needs the key "
                     "to keep the window, so the published config sets it" % (ver, full, eff, eff, eff),
              severity="warning")
    top, inner = disk.get("mask_token_id", ABSENT), dc.get("mask_token_id", ABSENT)
    if inner is ABSENT and top is ABSENT:
        check("semantics mask_token_id", False, expected="dflash_config.mask_token_id", on_disk=ABSENT,
              reason="%s reads mask_token_id from dflash_config, else the top-level key: neither is set" % ver)
    elif inner is not ABSENT and top is not ABSENT and inner != top:
        check("semantics mask_token_id", False, expected=inner, on_disk=top,
              reason="%s uses dflash_config.mask_token_id %s; the top-level mask_token_id %s is ignored: remove "
                     "one" % (ver, inner, top), severity="warning")


def safetensors_check(path, disk, check):
    import struct

    try:
        with open(path, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            if n > 100 << 20:
                raise ValueError("header length %d is implausible" % n)
            header = json.loads(fh.read(n))
    except (OSError, ValueError, struct.error) as e:
        check("weights header", False, reason="cannot read the safetensors header of %s: %s" % (path, e),
              severity="warning")
        return
    layers = set()
    for name in header:
        m = re.match(r"(?:model\.)?layers\.(\d+)\.", name)
        if m:
            layers.add(int(m.group(1)))
    nl = disk.get("num_hidden_layers")
    check("weights layers", len(layers) == nl, expected=nl, on_disk=len(layers),
          reason="the weights and the config come from different revisions", severity="warning")
    ids = (disk.get("dflash_config") or {}).get("target_layer_ids") or []
    fc = next((v for k, v in header.items() if k.endswith("fc.weight")), None)
    if fc and disk.get("hidden_size"):
        want = [disk["hidden_size"], disk["hidden_size"] * len(ids)]
        check("weights fc shape", fc.get("shape") == want, expected=want, on_disk=fc.get("shape"),
              reason="fc.weight width must be hidden_size x number of target layers", severity="warning")


SAFE_REV = re.compile(r"[0-9a-f]{40}|[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def safe_rev(rev):
    """A hub snapshot name read from refs/<rev> (untrusted): 40 hex digits or a plain name, never a path."""
    return isinstance(rev, str) and bool(SAFE_REV.fullmatch(rev)) and ".." not in rev
