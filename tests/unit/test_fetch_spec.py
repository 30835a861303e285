"""The fetch keys of model and speculative.drafter (issue 27): schema, cross-checks, and what deploy fetch is given.
Nothing remote runs."""

import json

import pytest

from orchestrator.provision import weights_fetch as F
from orchestrator.steps import plan as P
from orchestrator.core.errors import UsageError
from orchestrator.core.spec import fetch_items, load_playbook
from test_spec import edit, inv, line_of, problems, work  # noqa: F401 - the fixture

MODEL = "model:\n  path: /root/models/Qwen3.6-27B\n"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_path_only_playbook_fetches_nothing(work):
    pb = load_playbook(str(work / "playbooks" / "qwen36-dflash.yaml"), inv(work))
    assert fetch_items(pb) == []


def test_hub_model_and_hub_id_drafter(work, monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    edit(work, "qwen36-dflash", MODEL, MODEL + "  hub: Qwen/Qwen3.6-27B\n  revision: main\n")
    p = edit(work, "qwen36-dflash", "    path: /root/models/Qwen3.6-27B-DFlash\n",
             f"    hub_id: z-lab/Qwen3.6-27B-DFlash\n    revision: {COMMIT}\n    token_env: MY_HF_TOKEN\n")
    pb = load_playbook(p, inv(work))
    its = P.fetch_args(pb)
    assert [(i["role"], i["hub"], i["revision"], i["dest_kind"], i["dest"]) for i in its] == [
        ("model", "Qwen/Qwen3.6-27B", "main", "dir", "/root/models/Qwen3.6-27B"),
        ("drafter", "z-lab/Qwen3.6-27B-DFlash", COMMIT, "cache", None)]
    assert its[0]["endpoint"] == "https://huggingface.co"
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.invalid:8080/")
    assert P.fetch_args(pb)[0]["endpoint"] == "http://mirror.invalid:8080"
    monkeypatch.delenv("MY_HF_TOKEN", raising=False)
    with pytest.raises(UsageError) as ei:
        F.tokens(pb, its)
    assert "speculative.drafter.token_env names MY_HF_TOKEN, but it is not set" in ei.value.message
    monkeypatch.setenv("MY_HF_TOKEN", "hf_secret")
    assert F.tokens(pb, its) == {"token:drafter": "hf_secret"}
    # the plan shows the step, never the token
    from orchestrator.steps.plan import plan_up

    steps = plan_up(pb.members[0] if pb.members else pb)
    fetch = next(s for s in steps if s.name == "fetch")
    assert "hf_secret" not in json.dumps(fetch.args) + " ".join(fetch.runs)
    assert [s.name for s in steps][:4] == ["container", "lock", "current", "fetch"]


def test_cross_checks(work):
    p = edit(work, "qwen36-dflash", MODEL, MODEL + "  hub: Qwen/Qwen3.6-27B\n  token_env: lower\n"
                                               "  endpoint: ftp://x\n")
    probs = problems(lambda: load_playbook(p, inv(work)))
    text = "\n".join(probs)
    assert "model.token_env" in text and "model.endpoint: 'ftp://x' is not an http(s):// URL" in text, text
    p = edit(work, "qwen36-dflash", "  token_env: lower\n  endpoint: ftp://x\n", "")
    probs = problems(lambda: load_playbook(p, inv(work)))
    assert any("model.revision: a hub source needs a pinned revision" in x for x in probs), probs
    assert any(f":{line_of(p, 'hub: Qwen')}:" in x for x in probs)
    p = edit(work, "qwen36-dflash", "  hub: Qwen/Qwen3.6-27B\n", "  revision: ../x\n")
    probs = problems(lambda: load_playbook(p, inv(work)))
    assert any("is not a revision" in x for x in probs), probs
    p = edit(work, "qwen36-dflash", "  revision: ../x\n", "  revision: main\n")
    probs = problems(lambda: load_playbook(p, inv(work)))
    assert any("model.revision: needs model.hub" in x for x in probs), probs


def test_drafter_hub_must_match_hub_id_and_source_excludes_token(work):
    p = edit(work, "qwen36-dflash", "    path: /root/models/Qwen3.6-27B-DFlash\n",
             f"    hub_id: z-lab/Qwen3.6-27B-DFlash\n    hub: z-lab/other\n    revision: {COMMIT}\n")
    probs = problems(lambda: load_playbook(p, inv(work)))
    assert any("differs from hub_id" in x for x in probs), probs
    p = edit(work, "qwen36-dflash", "    hub: z-lab/other\n", "    source: {path: /srv/d}\n    token_env: T\n")
    probs = problems(lambda: load_playbook(p, inv(work)))
    assert any("a directory source is not fetched from the hub" in x for x in probs), probs


def test_manifest_roundtrip(tmp_path):
    d = tmp_path / "m"
    (d / "sub").mkdir(parents=True)
    (d / "a.bin").write_bytes(b"abc")
    (d / "sub" / "b.txt").write_bytes(b"x")
    res = F.write_manifest(str(d), "o/n", COMMIT)
    m = json.loads((d / "deploy-manifest.json").read_text())
    assert res["files"] == 2 and m["format"] == F.MANIFEST_FORMAT and m["commit"] == COMMIT
    assert [f["name"] for f in m["files"]] == ["a.bin", "sub/b.txt"]
    assert m["files"][0]["sha256"] == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_progress_line():
    line = F.progress_line({"role": "model", "file": "w.safetensors", "file_bytes": 1 << 20, "file_total": 4 << 20,
                            "file_rate": 1 << 20, "file_eta_s": 3, "done": 1 << 20, "total": 8 << 20,
                            "rate": 1 << 20, "eta_s": 7})
    assert line == ("model w.safetensors: 1.0 MiB of 4.0 MiB (25%), 1.0 MiB/s, ETA 3s | total 1.0 MiB of 8.0 MiB "
                    "(12%), 1.0 MiB/s, ETA 7s")
