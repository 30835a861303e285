"""Issue 22, "A container is not trusted": each finding reproduced on the test bed with a hostile container (a user
of it, or root in it answering for the agent), and shown not to steer root, secrets or the operator's terminal.
The threat model is in docs/architecture.md, "Threat model"."""

import json
import os

from e2e_helpers import audit, cat
import pytest
from slack import slack

STATE = "/var/lib/vllm-pve-deploy"
NOBODY = 65534

# an "interpreter" a container user planted: run as root, it records who ran it
PLANTED = "#!/bin/sh\nid -u > /root/pwned-by-%s\necho '{}'\n"


def plant_interpreter(tb, where, tag, host="pve1", vmid=129):
    """WHERE/bin/python owned by uid 65534, with a vllm dist-info beside it (so it looks like a vLLM runtime)."""
    sp = f"{where}/lib/python3.11/site-packages/vllm-0.99.0.dist-info"
    tb.container_exec(host, vmid, ["sh", "-c",
                                   f"mkdir -p {where}/bin {sp} && printf '%s' \"$0\" > {where}/bin/python && "
                                   f"chmod 755 {where}/bin/python && printf 'Name: vllm\\nVersion: 0.99.0\\n' > "
                                   f"{sp}/METADATA && chown -R {NOBODY}:{NOBODY} {where}", PLANTED % tag], check=True)


def test_discover_runs_no_interpreter_another_user_owns(tb, deploy):
    plant_interpreter(tb, "/root/alice-env", "discover")
    p = deploy("--json", "discover", "pve1")
    assert p.returncode == 0, p.stderr
    assert tb.container_exec("pve1", 129, ["ls", "/root/pwned-by-discover"]).returncode != 0, "ran it as root"
    ct = next(c for c in p.json["containers"] if c["vmid"] == 129)
    assert ct["runtime"]["python"] == "/root/ml-env/bin/python"  # the root-owned venv, read from its files
    assert ct["runtimes"][0]["vllm_version"] == "0.34.0"
    assert all(r["python"] != "/root/alice-env/bin/python" for r in ct["runtimes"])
    prob = [x for x in ct["problems"] if "/root/alice-env/bin/python" in x]
    assert prob and "owned by uid 65534" in prob[0] and "not proposed as the runtime" in prob[0]


def test_install_vllm_refuses_a_runtime_that_is_not_a_venv(tb, deploy, playbooks):
    """runtime.python /usr/bin/python3 made /usr the "venv root" to move aside; here a stand-in prefix."""
    tb.container_exec("pve1", 129, ["sh", "-c", "mkdir -p /root/standin/bin /root/standin/share && "
                                    "ln -s $(readlink -f /root/ml-env/bin/python) /root/standin/bin/python && "
                                    "echo keep > /root/standin/share/precious"], check=True)
    pb = playbooks.dir / "qwen36-dflash.yaml"
    assert '\n  vllm: "0.34.0"' in pb.read_text()  # the shipped DFlash playbook names the release
    pb.write_text(pb.read_text() + "\nruntime:\n  python: /root/standin/bin/python\n  vllm: /root/standin/bin/vllm\n")
    p = deploy("install-vllm", "qwen36-dflash", "-y", env=playbooks.env)
    assert p.returncode != 0, p.stdout + p.stderr
    assert "has no pyvenv.cfg: it is not a venv" in p.stderr and "python3 -m venv" in p.stderr, p.stderr
    assert cat(tb, "pve1", 129, "/root/standin/share/precious") == "keep\n"
    assert tb.container_exec("pve1", 129, ["test", "-L", "/root/standin"]).returncode != 0
    assert tb.container_exec("pve1", 129, ["ls", "/root/standin.versions"]).returncode != 0


def test_a_state_dir_others_can_write_is_refused_before_anything_touches_it(tb, deploy, playbooks):
    """runtime.state_dir: /tmp (sticky): a user planted state.json naming a root process; down killed it, and the
    lock step turned /tmp into mode 1700."""
    victim = tb.container_exec("pve1", 129, ["sh", "-c", "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!"],
                               check=True).stdout.strip()
    start = cat(tb, "pve1", 129, f"/proc/{victim}/stat").rsplit(")", 1)[1].split()[19]
    forged = {"playbook": "qwen36-mtp", "pid": int(victim), "pgid": int(victim), "starttime": int(start),
              "launch_id": "x", "port": 8000, "served_model_name": "x", "method": "mtp", "started_at": 0}
    tb.container_exec("pve1", 129, ["sh", "-c", f"cat > /tmp/state.json && chown {NOBODY} /tmp/state.json"],
                      input=json.dumps(forged), check=True)
    playbooks("qwen36-mtp", "\nserve:", "\nruntime:\n  python: /root/ml-env/bin/python\n  vllm: /root/ml-env/bin/vllm"
                                        "\n  state_dir: /tmp\n\nserve:")
    p = deploy("down", "qwen36-mtp", "-y", env=playbooks.env)
    assert p.returncode != 0, p.stdout + p.stderr
    assert "state directory /tmp is writable by others" in p.stderr and "runtime.state_dir" in p.stderr, p.stderr
    assert "chmod 700 /tmp" not in p.stderr  # never offered: /tmp is everyone's
    assert tb.container_exec("pve1", 129, ["kill", "-0", victim]).returncode == 0, "the victim was killed"
    assert tb.container_exec("pve1", 129, ["stat", "-c", "%a", "/tmp"]).stdout.strip() == "1777"
    s = deploy("--json", "status", "qwen36-mtp", env=playbooks.env)
    assert "state directory /tmp is writable by others" in " ".join(s.json["rows"][0]["problems"]), s.stdout


def flood_runtime(tb, name, flood):
    """/root/NAME/bin/python: floods, then runs the real Python (a container whose runtime was tampered with)."""
    real = tb.container_exec("pve1", 129, ["readlink", "-f", "/root/ml-env/bin/python"]).stdout.strip()
    script = f"#!/bin/sh\n{flood}\nexec {real} \"$@\"\n"
    tb.container_exec("pve1", 129, ["sh", "-c", f"mkdir -p /root/{name}/bin && cat > /root/{name}/bin/python && "
                                    f"chmod 755 /root/{name}/bin/python"], input=script, check=True)
    return f"\nruntime:\n  python: /root/{name}/bin/python\n  vllm: /root/ml-env/bin/vllm\n\nserve:"


def test_a_stderr_flood_ends_the_session_with_a_clear_error(tb, deploy, playbooks):
    rt = flood_runtime(tb, "errflood", "head -c 50000000 /dev/zero | tr '\\0' x >&2")
    playbooks("qwen36-mtp", "\nserve:", rt)
    p = deploy("up", "qwen36-mtp", env=playbooks.env, timeout=300)
    assert p.returncode != 0
    assert "bytes to stderr; the session was ended" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_an_event_flood_is_cut_and_the_audit_log_stays_small(tb, deploy, playbooks):
    rt = flood_runtime(tb, "evflood", "awk 'BEGIN { for (i = 0; i < 60000; i++) "
                                      "print \"{\\\"event\\\": \\\"log\\\", \\\"line\\\": \\\"flood\\\"}\" }'")
    playbooks("qwen36-mtp", "\nserve:", rt)
    p = deploy("--json", "status", "qwen36-mtp", env=playbooks.env, timeout=300)
    assert "more than 50000 events" in p.stdout + p.stderr, (p.stdout + p.stderr)[-2000:]
    assert "Traceback" not in p.stderr
    assert (deploy.state_dir / "audit.jsonl").stat().st_size < 2 << 20


def pty_deploy(deploy_env, *args, timeout=120):
    """Run deploy with stdout/stderr on a real pseudo-terminal: -> (exit code, the raw bytes the terminal got)."""
    import sys

    from e2e_helpers import REPO
    from pty_support import run_on_pty

    env = {k: v for k, v in deploy_env.items() if k != "NO_COLOR"}
    return run_on_pty([sys.executable, "-m", "orchestrator.cli", *args], REPO, env=env, timeout=timeout, wait_s=30)


@pytest.mark.deadline
def test_doctor_reads_no_fifo_and_prints_no_control_sequences_from_other_users(tb, deploy):
    """A user's process claims to be `vllm serve` a model dir whose config.json is a FIFO, with escape sequences
    in its argv: doctor blocked on the FIFO (its root agent stayed behind) and printed the argv raw."""
    import time

    evil = "/tmp/evil\x1b]0;PWNED\x07\x1b[2Jcleared"
    tb.container_exec("pve1", 129, ["sh", "-c", f'mkdir -p "$0" && mkfifo "$0/config.json" && chown -R {NOBODY} "$0"',
                                    evil], check=True)
    spec = json.dumps({"method": "dflash", "model": evil, "num_speculative_tokens": 4})
    tb.container_exec("pve1", 129, ["sh", "-c", "setpriv --reuid=65534 --regid=65534 --clear-groups setsid "
                                    "/usr/bin/python3 -c 'import time; time.sleep(600)' /x/vllm serve \"$1\" "
                                    "--speculative-config \"$0\" </dev/null >/dev/null 2>&1 &", spec, evil],
                      check=True)
    env = dict(os.environ, DEPLOY_INVENTORY=tb.inventory_path, DEPLOY_STATE_DIR=str(deploy.state_dir))
    t0 = time.monotonic()
    rc, raw = pty_deploy(env, "doctor", "pve1/129", "--budget", "6")
    assert time.monotonic() - t0 < slack(40), "doctor waited on the FIFO"
    assert b"/tmp/evil" in raw and b"cleared" in raw, raw[-3000:]
    assert b"\x1b]0;" not in raw and b"\x1b[2J" not in raw and b"\x07" not in raw
    ps = tb.container_exec("pve1", 129, ["ps", "-eo", "args"]).stdout
    assert " - doctor " not in ps, ps
