"""Every `deploy ... --help` example runs, as written, against one test bed, and exits with the code it should
(issue 53, "How to keep it true"): a help example that names a playbook nobody has, an option that moved or a
file that is not there fails here with its exit code and the end of its output.

- RUN lists each help example's command line (after `deploy`; the shell's `| jq`, `> file` and `&& cd` are not
  deploy's), in the order they run, with its exit code and, where it asks, what is typed at its prompt. The order
  builds the state each needs: the test bed's hub first (it writes `my-hub-dflash`, the playbook the fetch
  examples name, beside a copy of the shipped playbooks: DEPLOY_PLAYBOOKS points there, as `deploy fetch --help`
  says), the read-only ones on the fresh test bed, then `up`, then the replicas (`qwen36-replicas`: the YAML of
  docs/playbooks.md#targets-replicas over pve1/129 and pve2/129), the host changes, the faults last.
- PARSE_ONLY lists the examples that are parsed by click only, each with why and which test runs that command:
  they run until Ctrl-C, need a long run (a whole `up` or more per example), reach outside the test bed, or
  would replace the test bed itself.
- A help example in neither fails `test_every_help_example_is_classified`, so a new example is run (or said
  why not) from the day it is written.

Runs from a scratch directory (the files examples write land there; `init`'s in a HOME of its own), against a
copy of the test bed's inventory (`discover --write` edits it). `tests/e2e/test_examples.py` runs the docs'
examples; it leaves the help examples to this file.
"""

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_examples import click_parse, help_examples

# (command line after `deploy`, exit code, typed at a prompt or None), in the order they run
RUN = [
    # the test bed's hub in pve1/129: it writes DIR/playbooks (my-hub-dflash beside the shipped playbooks)
    ("testbed hub pve1/129", 0, None),
    ("fetch my-hub-dflash", 0, None),
    ("fetch my-hub-dflash --timeout 7200", 0, None),
    ("fetch my-hub-dflash --connections 16", 0, None),
    ("fetch my-hub-dflash --verify", 0, None),
    ("fetch my-hub-dflash --manifest /tmp/qwen36.manifest.json", 0, None),
    ("--json fetch my-hub-dflash", 0, None),
    # read-only, on the fresh test bed: run 4 at a time (a list in RUN runs concurrently)
    [("plan qwen36-dflash", 0, None),
     ("plan qwen36-dflash --op install-vllm", 0, None),
     ("plan qwen36-dflash --op down", 0, None),
     ("--json plan qwen36-mtp", 0, None),
     ("up qwen36-dflash --dry-run", 0, None),
     ("install-vllm qwen36-dflash --dry-run", 0, None),
     ("prepare pve1/130 --gpus 0-3 --dry-run", 0, None),
     ("size qwen36-dflash", 0, None),
     ("size qwen36-dflash --max-model-len 131072 --tp 2", 0, None),
     ("size qwen36-dflash --gpu-mib 49140 --gmu 0.95", 0, None),
     ("--json size qwen36-mtp --max-model-len 131072", 0, None),
     ("docs", 0, None),
     ("docs quickstart", 0, None),
     ("docs cli#status", 0, None),
     ("docs troubleshooting", 0, None),
     ("schema playbook", 0, None),
     ("schema inventory", 0, None),
     ("status", 0, None),
     ("status pve1/129 --json", 0, None),
     ("endpoint qwen36-dflash", 0, None),
     ("monitor metrics", 0, None),
     ("monitor metrics pve1 qwen36-dflash", 0, None),
     ("testbed status --json", 0, None),
     ("discover pve1", 0, None),
     ("discover pve1 --json", 0, None),
     ("unlock pve1/129", 0, None),
     ("unlock qwen36-dflash -y", 0, None),
     ("init", 0, None),
     ("init ~/pve", 0, None),
     ("init --force", 0, None)],
    # the diff, then its question answered yes (the inventory is a copy); its merge left pve2's keys in pve1 until
    # this test ran it (issue 53)
    ("discover pve1 --write", 0, "y\n"),
    # a deployment
    ("up qwen36-dflash", 0, None),
    ("verify qwen36-dflash", 0, None),
    ("logs qwen36-dflash -n 100", 0, None),
    ("logs pve1/129 --all -n 20", 0, None),
    ("apply-config qwen36-dflash", 0, None),
    ("doctor pve1/129", 0, None),
    ("monitor export ./monitoring", 0, None),
    ("monitor export ./monitoring qwen36-mtp --for 5m", 0, None),
    ("down qwen36-dflash", 0, None),
    ("down qwen36-dflash --clean-gpus -y", 0, None),
    # replicas
    ("up qwen36-replicas --parallel 2", 0, None),
    ("down qwen36-replicas pve2/129", 0, None),
    # the hosts and containers
    ("prepare pve1/130 --gpus 0-3 -y", 0, None),
    ("prepare pve1/129 --driver-run /root/NVIDIA-Linux-x86_64-550.54.15.run -y", 0, None),
    ("testbed template pve1", 0, None),
    ("testbed template pve1 vpd-ml.tar.gz --no-models", 0, None),
    ("install-vllm qwen36-dflash --rollback", 1, None),  # nothing was installed by deploy: nothing to return to
    # faults, then all off, then the hub stopped (it removes my-hub-dflash)
    ("testbed fault pve1/129 oom_at_startup=cuda_oom", 0, None),
    ("testbed fault pve1/129 load_s=5", 0, None),
    ("testbed fault pve1 nvidia_smi_hang", 0, None),
    ('testbed fault pve1 foreign_holder={"gpu": 0, "mib": 30000}', 0, None),
    ("testbed fault pve1 latency_ms=50", 0, None),
    ("testbed fault pve1/129 readonly_models=off", 0, None),
    ("testbed fault --clear", 0, None),
    ("testbed hub pve1/129 --stop", 0, None),
]

_LONG_UP = "a whole deploy up (stop, launch, gates: 6-15 s on the test bed each)"
PARSE_ONLY = {
    "testbed up": "would start a second test bed (tests/testbed/test_testbed.py starts each layout)",
    "testbed up --hosts 1 --containers 129": "would start a second test bed (tests/testbed/test_testbed.py)",
    "testbed up --hosts 2 --containers 129,130:0-1 --gpus 4": "would start a second test bed "
                                                              "(tests/testbed/test_testbed.py)",
    "testbed up --containers 129,131 --ct-option pve1/131:init=systemd,onboot=1":
        "a real LXC container with systemd: debootstrap, minutes (tests/e2e/test_systemd_lxc.py)",
    "testbed up --containers 129,140 --ct-option pve1/140:vllm=real":
        "a real vLLM: gigabytes and minutes (tests/e2e/test_real_vllm.py)",
    "testbed down": "would tear down the test bed these examples run on (tests/testbed/test_testbed.py)",
    "compare qwen36-dflash qwen36-mtp -y": "long: brings up each playbook and benchmarks it, minutes "
                                           "(tests/e2e/test_compare.py)",
    "compare qwen36-dflash qwen36-mtp --rounds 5 --prompts my-prompts.txt -y": "long, and a prompts file of the "
                                                                               "user's (tests/e2e/test_compare.py)",
    "--json compare qwen36-dflash qwen36-mtp --keep qwen36-mtp -y": "long (tests/e2e/test_compare.py)",
    "compare qwen36-dflash qwen36-mtp --concurrency 1,8,32 --plot sweep.png -y": "long: a sweep "
                                                                                 "(tests/e2e/test_compare.py)",
    "compare qwen36-dflash --baseline -y": "long: two launches and a benchmark (tests/e2e/test_compare.py)",
    "tune qwen36-dflash -y": "long: several launches and sweeps (tests/e2e/test_tune.py)",
    "tune qwen36-dflash --concurrency 1,8,32 --max-launches 3 -y": "long (tests/e2e/test_tune.py)",
    "tune qwen36-dflash --write -y": "long (tests/e2e/test_tune.py)",
    "--json tune qwen36-dflash --plot tune.png -y": "long (tests/e2e/test_tune.py)",
    "restart qwen36-dflash --clean-gpus": _LONG_UP + " (tests/e2e/test_up.py)",
    "restart --clean-gpus -y": _LONG_UP + " per deployment (tests/e2e/test_up.py)",
    "restart qwen36-replicas --rolling": _LONG_UP + " per replica (tests/e2e/test_fleet.py)",
    "restart qwen36-replicas --rolling --max-unavailable 2": _LONG_UP + " per replica (tests/e2e/test_fleet.py)",
    "--json up qwen36-mtp -y": _LONG_UP + ", the code path of `up qwen36-dflash`, which runs (tests/e2e/test_up.py)",
    "install-vllm qwen36-dflash": "the test bed's containers reach no package index (an air-gapped host): pip "
                                  "retries ~15 s, then exit 1 with the offline fix (tests/e2e/test_install_vllm.py::"
                                  "test_the_shipped_playbook_without_an_index_names_the_network_and_the_offline_way)",
    "install-vllm qwen36-dflash -y": "no package index in reach, as above (tests/e2e/test_install_vllm.py)",
    "--json install-vllm qwen36-dflash": "no package index in reach, as above (tests/e2e/test_install_vllm.py)",
    "up qwen36-dflash --install-vllm": "no package index in reach, as above (tests/e2e/test_install_vllm.py)",
    "--json verify qwen36-dflash": "the run of `verify qwen36-dflash` (8-10 s: the drafter config loaded with "
                                   "transformers), which runs, as JSON (tests/e2e/test_verify.py checks the JSON)",
    "doctor": "doctor of every container of the inventory (~8 s; the engine of `doctor pve1/129`, which runs; "
              "tests/e2e/test_doctor.py)",
    "doctor pve1 --json": "doctor of every container of pve1 (~8 s), as JSON (tests/e2e/test_doctor.py)",
    "discover root@10.1.2.5 --name pve1": "an address outside the test bed: never connected to from a test "
                                          "(tests/e2e/test_discover.py runs discover on test-bed addresses)",
    "endpoint qwen36-dflash --tunnel": "runs until Ctrl-C (tests/e2e/test_endpoint.py)",
    "logs pve1/129 -f --grep SpecDecoding|ERROR": "follows until Ctrl-C (tests/e2e/test_up.py)",
    "status --watch 5": "runs until Ctrl-C (tests/e2e/test_status.py)",
    "manifest /srv/models/Qwen3.6-27B --hub Qwen/Qwen3.6-27B --revision 0123456789abcdef0123456789abcdef01234567":
        "a directory of weights on this machine that a test machine has not (tests/e2e/test_fetch.py writes one)",
    "monitor render ./monitoring/dashboard.json --prometheus http://127.0.0.1:9090 --out dashboard.png":
        "needs a Prometheus that has scraped the deployments (tests/e2e/test_monitor.py runs a real one)",
    "monitor render dashboard.json --prometheus http://prom:9090 --since 1h --out last-hour.svg":
        "needs a Prometheus (tests/e2e/test_monitor.py)",
    "monitor metrics --textfile /var/lib/prometheus/node-exporter/vllm-pve-deploy.prom":
        "writes into this machine's node_exporter directory (tests/e2e/test_monitor.py runs --textfile)",
}

FLAT = [e for item in RUN for e in (item if isinstance(item, list) else [item])]
SANDBOXED = {"init"}  # run in a HOME of their own (a leading ~ is that HOME, as the shell expands it)


def _help_lines() -> dict:
    """{command line after deploy: the first example with it}, over every --help."""
    out = {}
    for ex in help_examples():
        out.setdefault(" ".join(ex.argv), ex)
    return out


def test_every_help_example_is_classified():
    lines = _help_lines()
    listed = [k for k, _rc, _in in FLAT]
    assert len(listed) == len(set(listed)), "a line twice in RUN"
    missing = [k for k in lines if k not in listed and k not in PARSE_ONLY]
    assert not missing, ("help examples neither run nor said why not (add each to RUN with its exit code, or to "
                         "PARSE_ONLY with the reason and the test that runs it): " + ", ".join(missing))
    stale = [k for k in listed + list(PARSE_ONLY) if k not in lines]
    assert not stale, "lines in RUN/PARSE_ONLY that no --help shows any more: " + ", ".join(stale)
    both = set(listed) & set(PARSE_ONLY)
    assert not both, f"both run and parse-only: {both}"


@pytest.mark.parametrize("line", sorted(PARSE_ONLY))
def test_parse_only_examples_parse(line, capsys):
    ex = _help_lines().get(line)
    if ex is None:
        pytest.skip("no longer shown (test_every_help_example_is_classified says so)")
    try:
        click_parse(ex.argv)
    except SystemExit:
        pass
    capsys.readouterr()


REPLICAS = """
targets:
  - {host: pve1, vmid: 129, gpus: [0, 1, 2, 3]}
  - {host: pve2, vmid: 129, gpus: [0, 1, 2, 3]}
"""


def test_help_examples_run_on_the_test_bed(tb, tmp_path):
    lines = _help_lines()
    scratch = tmp_path / "cwd"
    scratch.mkdir()
    inventory = tmp_path / "hosts.yaml"
    shutil.copy(tb.inventory_path, inventory)
    env = dict(os.environ, DEPLOY_INVENTORY=str(inventory), DEPLOY_STATE_DIR=str(tmp_path / "state"),
               VPD_TESTBED_DIR=str(tb.root), DEPLOY_PLAYBOOKS=str(tb.root / "playbooks"), NO_COLOR="1")
    for host in ("pve1", "pve2"):
        tb.set_fault(host, 129, "load_s", 0.2)  # the fake vLLM loads in 0.2 s instead of 1 s
    failures, times = [], []

    def run(line, argv, typed):
        cwd, e = scratch, env
        if argv and argv[0] in SANDBOXED:
            cwd = tmp_path / f"home-{line.replace(' ', '_').replace('~', '').replace('/', '_')}"
            cwd.mkdir()
            argv = [str(cwd) + a[1:] if a.startswith("~") else a for a in argv]
            e = dict(env, HOME=str(cwd))
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "orchestrator.cli", *argv], cwd=cwd, env=e, text=True,
                           capture_output=True, timeout=300, input=typed or "")
        times.append((time.monotonic() - t0, line))
        return p

    def check(line, rc, typed):
        ex = lines.get(line)
        if ex is None:
            failures.append(f"{line}: no --help shows it any more")
            return
        p = run(line, ex.argv, typed)
        problems = []
        if p.returncode != rc:
            problems.append(f"exit {p.returncode}, expected {rc}")
        if "Traceback" in p.stderr:
            problems.append("a traceback")
        if problems:
            failures.append(f"{ex.source}: deploy {line}: {'; '.join(problems)}\n  stdout: {p.stdout[-1500:]}\n"
                            f"  stderr: {p.stderr[-2500:]}")
        if line == "testbed hub pve1/129" and p.returncode == 0:
            # qwen36-replicas, as docs/playbooks.md#targets-replicas writes it, beside the shipped ones
            d = tb.root / "playbooks"
            text = (d / "qwen36-mtp.yaml").read_text().replace("name: qwen36-mtp", "name: qwen36-replicas", 1)
            text = text.replace("target:\n  host: pve1\n  vmid: 129\n  gpus: [0, 1, 2, 3]\n", REPLICAS, 1)
            (d / "qwen36-replicas.yaml").write_text(text)

    t_start = time.monotonic()
    try:
        for item in RUN:
            if isinstance(item, list):  # read-only examples: 4 at a time
                with ThreadPoolExecutor(max_workers=4) as pool:
                    list(pool.map(lambda e: check(*e), item))
            else:
                check(*item)
    finally:
        subprocess.run([sys.executable, "-m", "orchestrator.cli", "testbed", "hub", "pve1/129", "--stop"], env=env,
                       capture_output=True, timeout=60)
        (tb.root / "playbooks" / "qwen36-replicas.yaml").unlink(missing_ok=True)
        for f in ("/tmp/qwen36.manifest.json", "/tmp/qwen36.manifest.model.json",
                  "/tmp/qwen36.manifest.drafter.json"):
            if os.path.exists(f):
                os.unlink(f)
        print(f"\n{len(times)} help examples ran in {time.monotonic() - t_start:.1f} s "
              f"({sum(t for t, _ in times):.1f} s one after the other); slowest: " +
              ", ".join(f"{line} {t:.1f}s" for t, line in sorted(times, reverse=True)[:8]))
    assert not failures, f"{len(failures)} help example(s) did not run as written:\n\n" + "\n\n".join(failures)
