"""Validation: one test per class of mistake, asserting the message and the line number. Nothing remote runs."""

import os
import textwrap

import pytest

from orchestrator.core.errors import SpecError
from orchestrator.core.spec import load_inventory, load_playbook
from playbook_support import edit_file, playbook_work

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

INVENTORY = """\
hosts:
  - name: pve1
    address: 127.77.0.1
    port: 2222
    containers:
      - vmid: 129
        gpus: [0, 1, 2, 3]
"""


@pytest.fixture
def work(tmp_path):
    return playbook_work(tmp_path, INVENTORY)


def inv(work):
    return load_inventory(str(work / "hosts.yaml"))


def edit(work, name, old, new):
    return edit_file(work / "playbooks" / f"{name}.yaml", old, new)


def problems(fn):
    with pytest.raises(SpecError) as ei:
        fn()
    return ei.value.problems


def line_of(path, needle):
    for i, ln in enumerate(open(path).read().splitlines(), 1):
        if needle in ln:
            return i
    raise AssertionError(needle)


def test_shipped_playbooks_are_valid(work):
    pb = load_playbook(str(work / "playbooks" / "qwen36-dflash.yaml"), inv(work))
    assert pb.fallback.name == "qwen36-mtp"
    assert pb.drafter_config["block_size"] == 16
    mtp = load_playbook(str(work / "playbooks" / "qwen36-mtp.yaml"), inv(work))
    assert mtp.conf.speculative.drafter is None


def test_unknown_key_with_did_you_mean(work):
    p = edit(work, "qwen36-dflash", "  port: 8000", "  prot: 8000")
    (msg,) = problems(lambda: load_playbook(p, inv(work)))
    assert msg.startswith(f"{p}:{line_of(p, 'prot:')}:3: serve.prot: unknown key (did you mean 'port'?)")


def test_wrong_type(work):
    p = edit(work, "qwen36-dflash", "tensor_parallel_size: 4", "tensor_parallel_size: four")
    (msg,) = problems(lambda: load_playbook(p, inv(work)))
    assert f":{line_of(p, 'tensor_parallel_size')}:" in msg
    assert "serve.tensor_parallel_size: expected an integer, found a string ('four')" in msg


def test_out_of_range_port_and_vmid(work):
    p = edit(work, "qwen36-dflash", "port: 8000", "port: 70000")
    p = edit(work, "qwen36-dflash", "vmid: 129", "vmid: 5")
    msgs = problems(lambda: load_playbook(p, inv(work)))
    assert any(f":{line_of(p, 'port: 70000')}:" in m and "serve.port: 70000 is out of range" in m for m in msgs)
    assert any("target.vmid: 5 is out of range [100, 999999999]" in m for m in msgs)


def test_every_error_reported_at_once(work):
    p = edit(work, "qwen36-dflash", "port: 8000", "port: -1")
    p = edit(work, "qwen36-dflash", "gpu_memory_utilization: 0.90", "gpu_memory_utilization: 2")
    p = edit(work, "qwen36-dflash", "method: dflash", "method: dflsh")
    msgs = problems(lambda: load_playbook(p, inv(work)))
    assert len(msgs) == 3
    assert any("'dflsh' is not one of" in m and "did you mean 'dflash'" in m for m in msgs)


def test_num_speculative_tokens_vs_block_size(work):
    p = edit(work, "qwen36-dflash", "num_speculative_tokens: 15", "num_speculative_tokens: 16")
    (msg,) = problems(lambda: load_playbook(p, inv(work)))
    assert f":{line_of(p, 'num_speculative_tokens: 16')}:" in msg
    assert "16 exceeds the drafter's block_size 16 - 1 = 15" in msg


def test_unknown_host_and_container(work):
    p = edit(work, "qwen36-dflash", "host: pve1", "host: pve9")
    (msg,) = problems(lambda: load_playbook(p, inv(work)))
    assert "target.host: unknown host 'pve9'" in msg and "known: pve1" in msg
    p = edit(work, "qwen36-dflash", "host: pve9", "host: pve1")
    p = edit(work, "qwen36-dflash", "vmid: 129", "vmid: 131")
    (msg,) = problems(lambda: load_playbook(p, inv(work)))
    assert "host 'pve1' has no container 131" in msg


def test_gpu_not_in_container(work):
    p = edit(work, "qwen36-dflash", "gpus: [0, 1, 2, 3]", "gpus: [0, 1, 2, 7]")
    (msg,) = problems(lambda: load_playbook(p, inv(work)))
    assert "GPU(s) [7] are not passed into container 129" in msg


def test_missing_drafter_file_and_sha_mismatch(work):
    p = edit(work, "qwen36-dflash", "drafters/qwen36-27b-dflash.config.json", "drafters/nope.json")
    (msg,) = problems(lambda: load_playbook(p, inv(work)))
    assert "cannot read pinned drafter config" in msg and "nope.json" in msg
    p = edit(work, "qwen36-dflash", "drafters/nope.json", "drafters/qwen36-27b-dflash.config.json")
    p = edit(work, "qwen36-dflash", "sha256: df82", "sha256: 0f82")
    (msg,) = problems(lambda: load_playbook(p, inv(work)))
    assert f":{line_of(p, 'sha256:')}:" in msg and "does not match" in msg and "file has df82aa8b" in msg


def test_required_key_missing(work):
    p = edit(work, "qwen36-dflash", "  served_model_name: qwen36\n", "")
    (msg,) = problems(lambda: load_playbook(p, inv(work)))
    assert "serve.served_model_name: required key is missing" in msg


def test_duplicate_key(work):
    p = edit(work, "qwen36-dflash", "  port: 8000\n", "  port: 8000\n  port: 8001\n")
    (msg,) = problems(lambda: load_playbook(p, inv(work)))
    assert "serve.port: duplicate key (first defined on line" in msg


def test_hostile_strings_rejected_or_kept_literal(work):
    p = edit(work, "qwen36-dflash", "path: /root/models/Qwen3.6-27B\n", 'path: "relative; rm -rf /"\n')
    (msg,) = problems(lambda: load_playbook(p, inv(work)))
    assert "model.path: 'relative; rm -rf /' is not valid: must be an absolute path" in msg
    p = edit(work, "qwen36-dflash", 'path: "relative; rm -rf /"', 'path: "/root/m\\nx"')
    (msg,) = problems(lambda: load_playbook(p, inv(work)))
    assert "control characters or newlines are not allowed" in msg


def test_reserved_flag_in_extra_args(work):
    p = edit(work, "qwen36-dflash", "extra_args: []", "extra_args: ['--port=9000']")
    (msg,) = problems(lambda: load_playbook(p, inv(work)))
    assert "--port is set by the playbook's own keys" in msg


def test_mtp_with_drafter_and_dflash_without(work):
    p = edit(work, "qwen36-dflash", "method: dflash", "method: mtp")
    msgs = problems(lambda: load_playbook(p, inv(work)))
    assert any("method 'mtp' uses the target's own MTP head; remove the drafter" in m for m in msgs)


@pytest.mark.parametrize("content,needle", [
    (b"", "file is empty"),
    (b"- a\n- b\n", "(top): expected a mapping, found a list"),
    (b"\xff\xfe\x00bad", "not UTF-8"),
    (b"a: [1, 2\n", "invalid YAML"),
    (b"a: &x [1]\nb: *x\n", "aliases"),
    (b"x" * (2 << 20), "larger than"),
    (b"name: a\n---\nname: b\n", "more than one YAML document"),
])
def test_unreadable_files(tmp_path, content, needle):
    p = tmp_path / "pb.yaml"
    p.write_bytes(content)
    msgs = problems(lambda: load_playbook(str(p), None))
    assert any(needle in m for m in msgs), msgs
    assert all(m.startswith(str(p) + ":") for m in msgs)


def test_missing_playbook_file(tmp_path):
    msgs = problems(lambda: load_playbook(str(tmp_path / "nope.yaml"), None))
    assert msgs == [f"{tmp_path / 'nope.yaml'}:1:1: (top): file not found"]


def test_inventory_errors(tmp_path):
    p = tmp_path / "hosts.yaml"
    p.write_text(textwrap.dedent("""\
        hosts:
          - name: pve1
            address: 127.0.0.1
            containers:
              - vmid: 129
              - vmid: 129
          - name: pve1
            port: 0
            adress: x
    """))
    msgs = problems(lambda: load_inventory(str(p)))
    text = "\n".join(msgs)
    assert ":6:15: hosts[0].containers[1].vmid: duplicate vmid 129" in text
    assert "hosts[1].port: 0 is out of range" in text
    assert "hosts[1].adress: unknown key (did you mean 'address'?)" in text
    assert "duplicate host name 'pve1'" in text
    assert "needs 'address' or 'ssh_config_alias'" in text


def test_fallback_must_exist(work):
    p = edit(work, "qwen36-dflash", "fallback: qwen36-mtp", "fallback: qwen36-nope")
    (msg,) = problems(lambda: load_playbook(p, inv(work)))
    assert "acceptance.fallback: no playbook named 'qwen36-nope'" in msg


def test_repo_inventory_example_is_inert():
    """The shipped hosts.yaml documents the field-report layout only in comments: it connects nowhere."""
    assert load_inventory(os.path.join(REPO, "hosts.yaml")).hosts == {}


def test_deprecated_mtp_alias_is_refused_with_the_fix(work):
    p = edit(work, "qwen36-mtp", "method: mtp", "method: qwen3_next_mtp")
    (msg,) = problems(lambda: load_playbook(p, inv(work)))
    assert "'qwen3_next_mtp' is a deprecated alias that vLLM rewrites to 'mtp'" in msg and "write method: mtp" in msg


# ---------------------------------------------------------------- issue 12: secrets by reference, remote code


@pytest.mark.parametrize("name", ["HF_TOKEN", "VLLM_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD"])
def test_a_secret_in_serve_env_is_refused_with_its_line(work, name):
    path = edit(work, "qwen36-dflash", "  env: {}", f"  env:\n    NCCL_DEBUG: WARN\n    {name}: hf_abcdef123456")
    probs = problems(lambda: load_playbook(path, inv(work)))
    want = f"{path}:{line_of(path, name + ':')}:"
    hit = [p for p in probs if f"serve.env.{name}" in p]
    assert hit and hit[0].startswith(want), probs
    assert "looks like a secret" in hit[0] and ("serve.secret_env" in hit[0] or "serve.api_key_env" in hit[0])
    assert not [p for p in probs if "NCCL_DEBUG" in p]


def test_secrets_by_reference_reach_the_launch_on_stdin_only(work, monkeypatch):
    from orchestrator.deploy import ops
    from orchestrator.steps import plan as P
    from orchestrator.core.remote import shell_join

    path = edit(work, "qwen36-dflash", "  env: {}", "  env: {}\n  secret_env:\n    HF_TOKEN: MY_LOCAL_HF")
    pb = load_playbook(path, inv(work))
    monkeypatch.setenv("MY_LOCAL_HF", "hf_verysecretvalue")
    assert ops.secrets_for(pb) == {"HF_TOKEN": "hf_verysecretvalue"}
    steps = P.plan_up(pb)
    launch = next(s for s in steps if s.name == "launch")
    assert "HF_TOKEN" in launch.payload
    assert all("hf_verysecretvalue" not in shell_join(s.remote_argv("/py")) for s in steps)
    monkeypatch.delenv("MY_LOCAL_HF")
    with pytest.raises(Exception) as ei:
        ops.secrets_for(pb)
    assert "serve.secret_env.HF_TOKEN names MY_LOCAL_HF, but it is not set" in str(ei.value)


def test_trust_remote_code_is_an_explicit_opt_in(work):
    from orchestrator.steps import plan as P

    pb = load_playbook(str(work / "playbooks" / "qwen36-dflash.yaml"), inv(work))
    assert "--trust-remote-code" not in P.serve_argv(pb) and P.verify_args(pb)["trust_remote_code"] is False
    path = edit(work, "qwen36-dflash", "  env: {}", "  env: {}\n  trust_remote_code: true")
    pb = load_playbook(path, inv(work))
    assert "--trust-remote-code" in P.serve_argv(pb) and P.verify_args(pb)["trust_remote_code"] is True


def test_lock_leases_cover_the_steps_they_guard(work):
    """The old leases were fixed numbers (down: 600 s) shorter than the steps under them (stop grace 3600 s)."""
    from orchestrator.steps import plan as P

    path = edit(work, "qwen36-dflash", "  stop_grace_s: 30", "  stop_grace_s: 3600")
    pb = load_playbook(path, inv(work))
    for steps in (P.plan_down(pb), P.plan_up(pb)):
        lock = next(s for s in steps if s.name == "lock")
        assert lock.args["lease_s"] >= sum(s.timeout for s in steps if s.name not in ("lock", "unlock"))
        assert lock.args["term_s"] == 60


def test_supervise_defaults_and_a_start_limit_that_can_never_be_reached(work):
    pb = load_playbook(str(work / "playbooks" / "qwen36-dflash.yaml"), inv(work))
    sv = pb.data["supervise"]
    assert (sv["restart_sec"], sv["start_limit_burst"], sv["start_limit_interval_s"]) == (5.0, 3, 600.0)
    p = edit(work, "qwen36-dflash", "\ngpu:\n",
             "\nsupervise:\n  restart_sec: 300\n  start_limit_burst: 3\n  start_limit_interval_s: 600\ngpu:\n")
    (msg,) = problems(lambda: load_playbook(p, inv(work)))
    assert f":{line_of(p, 'start_limit_interval_s: 600')}:" in msg and "supervise.start_limit_interval_s" in msg
    assert "a crash loop would never stop: 3 starts 300 s apart take 900 s" in msg
    p = edit(work, "qwen36-dflash", "start_limit_burst: 3", "start_limit_burst: 0")
    (msg,) = problems(lambda: load_playbook(p, inv(work)))
    assert "supervise.start_limit_burst" in msg


def test_plain_http_install_sources_need_allow_insecure(work):
    """issue 22: http:// for requires.vllm, index_url, find_links is refused unless allow_insecure: true."""
    src = '  vllm: "0.34.0"'  # the shipped playbook names a release (issue 24): replace it
    new = ("  vllm: http://mirror.invalid/vllm-0.34.0-cp38-abi3-manylinux1_x86_64.whl\n  install:\n"
           "    index_url: http://mirror.invalid/simple\n    find_links: [/root/wheels, http://mirror.invalid/w]\n")
    path = edit(work, "qwen36-dflash", src, new)
    probs = "\n".join(problems(lambda: load_playbook(path, inv(work))))
    for key in ("requires.vllm", "requires.install.index_url", "requires.install.find_links[1]"):
        assert key in probs and "plain http" in probs and "allow_insecure: true" in probs
    assert "find_links[0]" not in probs
    edit(work, "qwen36-dflash", "    index_url:", "    allow_insecure: true\n    index_url:")
    load_playbook(path, inv(work))


def test_hashes_pin_a_release_not_a_git_source(work):
    h = "sha256:" + "a" * 64
    path = edit(work, "qwen36-dflash", '  vllm: "0.34.0"', f'  vllm: "0.34.0"\n  install:\n    hashes: [{h}]\n')
    assert load_playbook(path, inv(work)).data["requires"]["install"]["hashes"] == [h]
    edit(work, "qwen36-dflash", 'vllm: "0.34.0"', "vllm: git+https://github.com/ORG/vllm@main")
    assert any("cannot be hash-pinned" in p for p in problems(lambda: load_playbook(path, inv(work))))
    edit(work, "qwen36-dflash", f"hashes: [{h}]", "hashes: [md5:abc]")
    assert any("sha256:<64 lowercase hex digits>" in p for p in problems(lambda: load_playbook(path, inv(work))))


@pytest.mark.parametrize("content", [
    b"", b"- a\n- b\n", b"a: [1, 2\n", b"a: &x [1]\nb: *x\n", b"name: a\n---\nname: b\n",
    b"name: a\nname: b\n", b"name: 3\ntarget:\n  model: [x\n", b"a:\tb\n", b"name: a\n  bad: indent\n",
    b"name: \"unterminated\n", b"\tname: a\n", b"name: a\nmembers:\n  - host: pve1\n    vmid: zz\n",
])
def test_libyaml_and_pure_python_parsers_report_the_same(tmp_path, monkeypatch, content):
    # issue 54: files are read with libyaml's parser when PyYAML has it (~10-40x faster); a file it refuses is
    # read again by the pure-Python one, so every message (text, line, column) is the one the docs quote
    from orchestrator.core import schema

    p = tmp_path / "pb.yaml"
    p.write_bytes(content)

    def msgs():
        try:
            load_playbook(str(p), None)
        except SpecError as e:
            return e.problems
        return []

    fast = msgs()
    monkeypatch.setattr(schema, "_C_LOADER", None)
    assert fast == msgs()


def _tree(node):
    import yaml

    if node is None:
        return None
    if isinstance(node, yaml.MappingNode):
        kids = [(_tree(k), _tree(v)) for k, v in node.value]
    elif isinstance(node, yaml.SequenceNode):
        kids = [_tree(v) for v in node.value]
    else:
        kids = node.value
    return (type(node).__name__, node.tag, node.start_mark.line, node.start_mark.column, kids)


def _both(monkeypatch, path):
    from orchestrator.core import schema

    out = []
    for loader in (schema._C_LOADER, None):
        monkeypatch.setattr(schema, "_C_LOADER", loader)
        pr = schema.Problems(str(path))
        out.append((_tree(schema.compose_file(path, pr)), pr.items))
    return out


def test_mutated_shipped_files_parse_the_same_with_either_parser(tmp_path, monkeypatch):
    # the shipped playbooks and inventory, and 400 copies with 1-3 characters inserted, deleted or replaced
    # (seeded): the same node tree (tags, lines, columns, values) or the same problems with either parser
    import glob
    import random

    from orchestrator.core import schema

    if schema._C_LOADER is None:
        pytest.skip("PyYAML without libyaml: only the pure-Python parser")
    texts = [open(f).read() for f in sorted(glob.glob(os.path.join(REPO, "playbooks", "*.yaml")))
             + [os.path.join(REPO, "hosts.yaml")]]
    rnd = random.Random(54)
    chars = list(":- \n[]{}'\"#&*!|>?%@`,\t\r\\x0\u00e9\u2028\x85\ufeff\x00\x7f\xa0\U0001F600")
    p = tmp_path / "f.yaml"
    for i in range(len(texts) + 400):
        t = list(texts[i] if i < len(texts) else rnd.choice(texts))
        for _ in range(rnd.randint(1, 3) if i >= len(texts) else 0):
            pos, op = rnd.randrange(len(t)), rnd.random()
            if op < 0.4:
                t.insert(pos, rnd.choice(chars))
            elif op < 0.7:
                del t[pos]
            else:
                t[pos] = rnd.choice(chars)
        p.write_text("".join(t))
        fast, slow = _both(monkeypatch, p)
        assert fast == slow, "".join(t)
