"""Examples are tests: every `deploy ...` example in every --help, and every command line in the fenced blocks of
README.md and docs/**/*.md, is checked against the code.

- Every example is parsed by click itself (the real command tree, option types, ranges and callbacks): an option
  that does not exist, or a bad value, fails here. Synopsis lines (`deploy up PLAYBOOK [-y] ...`) must name only
  options the command has.
- Cheap, read-only examples (plan, status, verify, logs, --help, --dry-run, testbed status, and new read-only
  commands named in CHEAP) run for real against the test bed: no usage error, no traceback, JSON where --json.
  `init` (SANDBOXED) runs for real in a scratch directory that is also HOME.
- Where a doc shows output (`$ deploy ...` followed by output lines), that output is checked against the real
  output: its lines, normalised (numbers, hashes, addresses and spacing), must appear in order. Counts are not
  normalised: `29 checks`, `at most 3740 s`, `19 steps` must be the real numbers (issue 26).
- Step lines shown anywhere in the docs (`[pve1/129] ok   verify   ...`), also in blocks that are not run, are
  compared with the same step of real runs (up, the fallback, down) where they describe the same thing: their
  counts must be the real ones. Every option of every command (the test bed's too, and the KEY= values its help
  names) is documented in docs/cli.md, and every state file name the docs give exists in the code.
- The rest (up, down, restart, apply-config, testbed up/down/fault, --watch, -f) change or hold the test bed or
  run until Ctrl-C: they are parsed only, each with the reason in NOT_RUN. A doc block can ask for more with a
  marker line right before its fence:
    <!-- examples: state up:PLAYBOOK -->   run the block's examples (all of them) after `deploy up PLAYBOOK`
    <!-- examples: not run (why) -->       parse only, for the reason given
    <!-- examples: illustrative (why) -->  run, but do not compare the documented output
    <!-- examples: run -->                 run it even if it changes the test bed (after the read-only ones of
                                            its state, in doc order: a walkthrough such as up, then down)
  A plain block right after a block with a single command is that command's documented output.
  (`state ...` and one of the others may be combined, separated by `;`)

Examples are collected generically (every command of the click tree, every doc file), so new commands and new
doc sections are picked up without touching this file.
"""

import glob
import json
import os
import re
import shlex
from dataclasses import dataclass, field

import click
import pytest

from e2e_helpers import REPO

DOC_FILES = sorted([os.path.join(REPO, "README.md")] + glob.glob(os.path.join(REPO, "docs", "**", "*.md"),
                                                                 recursive=True))
# Read-only commands that answer in about a second: run for real. (First words after `deploy`.)
CHEAP = {"plan", "size", "status", "verify", "logs", "schema", "completion", "docs", "endpoint", ("testbed", "status"),
         ("monitor", "metrics")}
# Commands that only write where they are told or where they run: run for real in a scratch directory that is also
# HOME (a leading ~ expanded to it, as a shell would), its path shown as /root (the docs' HOME) when compared.
SANDBOXED = {"init"}
NOT_RUN = {
    "up": "changes the deployment (tests/e2e/test_up.py runs it)",
    "down": "changes the deployment (tests/e2e/test_gpu.py runs it)",
    "restart": "changes the deployment (tests/e2e/test_up.py runs it)",
    "apply-config": "writes the drafter config (tests/e2e/test_verify.py runs it)",
    "compare": "brings up each playbook in turn and leaves the winner running (tests/e2e/test_compare.py runs it)",
    "tune": "brings up several configurations in turn and leaves the best running (tests/e2e/test_tune.py runs it)",
    "install-vllm": "installs vLLM into the container and switches its runtime (tests/e2e/test_install_vllm.py runs "
                    "it)",
    "fetch": "downloads weights into the container (tests/e2e/test_fetch.py runs it on the test bed's hub)",
    "manifest": "writes DIR/deploy-manifest.json (tests/e2e/test_fetch.py runs it)",
    # commands of branches not merged yet, classified ahead so that merging them needs no edit here
    "discover": "connects to the address it is given, which may be outside the test bed (its own tests run it)",
    "doctor": "diagnoses a vLLM started by hand, with a time budget per container (its own tests run it)",
    "unlock": "removes a container lock (its own tests run it)",
    "prepare": "changes a container's config and restarts it (tests/e2e/test_prepare.py runs it)",
    "--write": "edits the inventory",
    ("testbed", "up"): "the suite's test bed is already up (tests/testbed/ runs it)",
    ("testbed", "down"): "would tear down the suite's test bed (tests/testbed/ runs it)",
    ("testbed", "fault"): "changes the test bed (tests/testbed/ runs every fault)",
    ("testbed", "hub"): "starts a hub server in a container's network (tests/e2e/test_fetch.py runs it with a fetch)",
    ("testbed", "template"): "writes a template archive on a host's storage (tests/e2e/test_prepare_create.py runs "
                             "it in the walk-through)",
    "--watch": "runs until Ctrl-C",
    "--tunnel": "runs until Ctrl-C",
    ("monitor", "export"): "writes files into the directory it is given (tests/e2e/test_monitor.py runs it and "
                           "checks them with promtool)",
    ("monitor", "render"): "needs a Prometheus that has scraped the deployments (tests/e2e/test_monitor.py runs it "
                           "against a real one)",
    "--textfile": "writes into node_exporter's textfile directory (tests/e2e/test_monitor.py runs it)",
    "-f": "follows until Ctrl-C",
    "--follow": "follows until Ctrl-C",
}


@dataclass
class Example:
    source: str  # file:line, or "deploy up --help"
    argv: list  # after "deploy"
    line: str  # as written
    output: list = field(default_factory=list)  # documented output lines
    state: str = ""  # "" (a fresh test bed) or "up:PLAYBOOK"
    mode: str = ""  # "", "not run (why)", "illustrative (why)"

    def __str__(self):
        return f"{self.source}: {self.line}"


# ------------------------------------------------------------------ collecting


def _uncomment(line: str) -> str:
    """The line without its shell comment: a `#` that starts a word, outside quotes (`docs cli#status` keeps its
    `#`, as the shell does; shlex's commenters would cut it)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def split_commands(line: str) -> list[list[str]]:
    """The `deploy ...` commands of a shell line: comments dropped, split at | && || ; and redirections."""
    lex = shlex.shlex(_uncomment(line), posix=True, punctuation_chars=";&|<>")
    lex.whitespace_split = True
    lex.commenters = ""
    try:
        tokens = list(lex)
    except ValueError:
        return []
    cmds, cur, skip = [], [], False
    for t in tokens + [";"]:
        if t in (";", "&&", "||", "|", "&"):
            if cur and cur[0] == "deploy":
                cmds.append(cur[1:])
            cur, skip = [], False
        elif t in (">", ">>", "<", "2>", "&>"):
            skip = True
        elif skip:
            skip = False
        else:
            cur.append(t)
    return cmds


def is_synopsis(argv: list[str]) -> bool:
    return any(re.fullmatch(r"\[.*|.*\]|.*\.\.\.|[A-Z][A-Z_/|]*[A-Z](\[.*)?|[A-Z]", t) for t in argv) or \
        any(t.startswith("[") for t in argv)


def help_examples() -> list[Example]:
    """Every line under `Example:`/`Examples:` in the --help of every command (walked from the click tree)."""
    from orchestrator.cli import main

    out = []

    def walk(cmd, path):
        ctx = click.Context(cmd, info_name=" ".join(path))
        text = cmd.get_help(ctx)
        in_ex = False
        for ln in text.splitlines():
            s = ln.strip()
            if re.fullmatch(r"Examples?:", s):
                in_ex = True
                continue
            if not s:
                in_ex = False
                continue
            if in_ex:
                for argv in split_commands(s):
                    out.append(Example(f"{' '.join(path)} --help", argv, s))
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(None):  # the lazily loaded commands too
                sub = cmd.get_command(None, name)
                walk(sub, path + [name])

    walk(main, ["deploy"])
    return out


def doc_examples() -> list[Example]:
    out = []
    for path in DOC_FILES:
        rel = os.path.relpath(path, REPO)
        lines = open(path, encoding="utf-8").read().splitlines()
        i = 0
        last_single = last_end = None
        while i < len(lines):
            m = re.match(r"\s*```(\w*)", lines[i])
            if not m:
                i += 1
                continue
            lang = m.group(1)
            marker = lines[i - 1].strip() if i else ""
            mm = re.fullmatch(r"<!-- examples: (.*) -->", marker)
            state = mode = ""
            directives = r"state [^;\s]+|not run \([^)]*\)|illustrative \([^)]*\)|\brun\b"
            for what in re.findall(directives, mm.group(1) if mm else ""):
                if what.startswith("state "):
                    state = what[len("state "):].strip()
                else:
                    mode = what
            j = i + 1
            while j < len(lines) and not re.match(r"\s*```", lines[j]):
                j += 1
            body = [ln for ln in lines[i + 1:j] if ln.strip()]
            if lang == "" and not any(ln.startswith(("$ deploy", "deploy ")) for ln in body) and out and \
                    out[-1].source == last_single and all(not x.strip() for x in lines[last_end + 1:i]):
                if not mm or not mode:  # the output of the command block just above
                    out[-1].output = lines[i + 1:j]
                i = j + 1
                continue
            last_single = last_end = None
            cmds = [ln for ln in body if ln.strip().startswith("deploy ")]
            if len(body) == 1 and len(cmds) == 1:
                last_single, last_end = f"{rel}:{i + 2}", j
            if lang in ("", "bash", "sh", "console", "shell", "text"):
                cur = None
                for k in range(i + 1, j):
                    s = lines[k].strip()
                    prompt = lines[k].startswith("$ ")  # a transcript's command (indented `$ ...` is output)
                    cmd = s[2:] if prompt else s
                    if (prompt or not lines[k].startswith(" " * 4)) and (cmd.startswith("deploy ") or cmd == "deploy"):
                        cur = None
                        for argv in split_commands(cmd):
                            cur = Example(f"{rel}:{k + 1}", argv, cmd, state=state, mode=mode)
                            out.append(cur)
                        if not prompt:
                            cur = None  # a command list, not a console transcript: no output follows
                    elif prompt:
                        cur = None
                    elif cur is not None:
                        cur.output.append(lines[k])
            i = j + 1
    return out


ALL = help_examples() + doc_examples()


def words(argv):
    """The command path of argv: the leading subcommand words (after global options)."""
    from orchestrator.cli import main

    cmd, path = main, []
    for t in argv:
        if t.startswith("-"):
            continue
        if isinstance(cmd, click.Group) and cmd.get_command(None, t) is not None:
            cmd = cmd.get_command(None, t)
            path.append(t)
        else:
            break
    return path


def why_not_run(ex: Example) -> str:
    if ex.mode.startswith("not run"):
        return ex.mode
    if ex.mode == "run":
        return ""
    if is_synopsis(ex.argv):
        return "a synopsis (checked: its options exist)"
    for t in ex.argv:
        if t.startswith("-") and t in NOT_RUN:
            return NOT_RUN[t]
    if "--help" in ex.argv or "-h" in ex.argv or "--version" in ex.argv or "--dry-run" in ex.argv:
        return ""
    path = tuple(words(ex.argv))
    key = path[0] if len(path) == 1 else path[:2]
    if ex.state and key in NOT_RUN and key not in CHEAP:
        return ""  # a block that sets up its own state runs its (expensive) examples too
    if key in CHEAP or (path and path[0] in CHEAP) or (path and path[0] in SANDBOXED):
        return ""
    return NOT_RUN.get(key) or f"{' '.join(path) or '(no command)'}: not known to be read-only (add it to CHEAP " \
                               "if it is)"


# ------------------------------------------------------------------ checking without a test bed


def click_parse(argv):
    """Parse argv with the real click tree, as `deploy` would, without running anything."""
    from orchestrator.cli import Obj, main

    ctx = main.make_context("deploy", list(argv), obj=Obj("hosts.yaml", False, False))
    cmd = main
    while isinstance(cmd, click.Group):
        rest = list(getattr(ctx, "_protected_args", [])) + list(ctx.args)
        if not rest:
            break
        name, sub, rest = cmd.resolve_command(ctx, rest)
        ctx = sub.make_context(name, rest, parent=ctx)
        cmd = sub
    return cmd


def synopsis_options(argv):
    """A synopsis names only options its command (or the group above it) has."""
    from orchestrator.cli import main

    cmd, chain = main, [main]
    for t in argv:
        if isinstance(cmd, click.Group) and cmd.get_command(None, t) is not None:
            cmd = cmd.get_command(None, t)
            chain.append(cmd)
    known = {o for c in chain for p in c.params for o in p.opts + p.secondary_opts}
    known |= {"-h", "--help", "--version"}
    used = {m for t in argv for m in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", t)}
    return sorted(used - known)


def test_examples_were_found():
    sources = {e.source.split(":")[0] for e in ALL}
    assert len(ALL) > 50, len(ALL)
    assert any(s.endswith("--help") for s in sources) and "README.md" in sources and "docs/cli.md" in sources


@pytest.mark.parametrize("ex", ALL, ids=str)
def test_example_parses(ex, capsys):
    if is_synopsis(ex.argv):
        assert not synopsis_options(ex.argv), f"{ex}: no such option(s) {synopsis_options(ex.argv)}"
        return
    try:
        click_parse(ex.argv)
    except click.exceptions.Exit:
        pass  # --help, --version
    except click.ClickException as e:
        pytest.fail(f"{ex}: {e.format_message()}")
    capsys.readouterr()


# ------------------------------------------------------------------ running the cheap ones


COUNTS = re.compile(r"\b\d+ (?:checks?\b|check\(s\)|steps\b)|\bat most \d+ s\b")


def _norm(line: str, counts: bool = True) -> str:
    """Numbers, hashes and addresses normalised; with counts=True the counts (COUNTS) are kept exactly."""
    s = re.sub(r"127\.77\.\d+\.\d+", "ADDR", line.strip())
    s = re.sub(r"\b[0-9a-f]{7,64}\b", "H", s)
    if counts:  # digits of a count are spelt as letters, out of reach of the number rule below
        s = COUNTS.sub(lambda m: re.sub(r"\d", lambda d: "abcdefghij"[int(d.group())], m.group()), s)
    s = re.sub(r"\d+", "0", s)
    s = re.sub(r"-{2,}", "--", s)  # table rules follow the column widths
    return re.sub(r"\s+", " ", s)


def _matches(doc: str, real: str) -> bool:
    """`...` in a documented line elides part of the real one: the pieces must appear in order."""
    if doc == real:
        return True
    pieces = [p.strip() for p in re.split(r"\.\.\.|…", doc)]
    if len(pieces) == 1:
        return False
    pos = 0
    for p in pieces:
        k = real.find(p, pos)
        if k < 0:
            return False
        pos = k + len(p)
    return True


def _missing(want, have):
    pos = 0
    for w in want:
        while pos < len(have) and not _matches(w, have[pos]):
            pos += 1
        if pos == len(have):
            return w
        pos += 1
    return None


def check_output(ex: Example, stdout: str, stderr: str):
    """A doc shows a terminal: progress (stderr) and result (stdout) in either order."""
    want = [_norm(x) for x in ex.output if x.strip() and x.strip() not in ("...", "…")]
    out, err = [_norm(x) for x in stdout.splitlines()], [_norm(x) for x in stderr.splitlines()]
    miss = [_missing(want, out + err), _missing(want, err + out)]
    assert None in miss, (f"{ex}: documented output line not in the real output (in this order):\n  {miss[0]}\n"
                          f"real output:\n{stdout}{stderr}")


# help examples run in tests/e2e/test_help_examples.py, each with its exit code: here they are only parsed
RUN = [e for e in ALL if not why_not_run(e) and not e.source.endswith("--help")]
STATES = sorted({e.state for e in RUN})


def run_sandboxed(ex, tmp_path, n, env):
    """A SANDBOXED example in its own scratch directory (cwd and HOME); its path reads /root in the output."""
    import subprocess
    import sys

    box = tmp_path / f"sandbox-{n}"
    box.mkdir()
    argv = [str(box) + a[1:] if a.startswith("~") else a for a in ex.argv]
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", *argv], cwd=box, text=True, capture_output=True,
                       timeout=120, env=dict(os.environ, HOME=str(box), NO_COLOR="1", **env))
    p.stdout, p.stderr = p.stdout.replace(str(box), "/root"), p.stderr.replace(str(box), "/root")
    return p


@pytest.mark.parametrize("state", STATES, ids=lambda s: s or "fresh test bed")
def test_examples_run_on_the_test_bed(state, tb, deploy, tmp_path):
    """Each runnable example for real, in doc order, on the state it asks for."""
    if state.startswith("up:"):
        p = deploy("up", state[3:], "-y", env={"VPD_TESTBED_DIR": str(tb.root)})
        assert p.returncode == 0, p.stderr
    seen = set()
    failures = []
    mine = [e for e in RUN if e.state == state]
    changes = [e for e in mine if e.mode == "run" or NOT_RUN.get(
        tuple(words(e.argv))[0] if len(words(e.argv)) == 1 else tuple(words(e.argv))[:2])]
    for ex in [e for e in mine if e not in changes] + changes:  # what changes the state runs last
        key = tuple(ex.argv)
        if key in seen and not ex.output:
            continue  # the same command line, already run: one run is enough
        seen.add(key)
        if (words(ex.argv) or [""])[0] in SANDBOXED:
            p = run_sandboxed(ex, tmp_path, len(seen), {"DEPLOY_INVENTORY": tb.inventory_path})
        else:
            p = deploy(*ex.argv, timeout=120, env={"VPD_TESTBED_DIR": str(tb.root)})
        problems = []
        if p.returncode == 2:
            problems.append(f"exit 2 (usage):\n{p.stderr}")
        if "Traceback" in p.stderr:
            problems.append(f"a traceback:\n{p.stderr}")
        if "--json" in ex.argv and p.returncode != 2:
            try:
                json.loads(p.stdout)
            except ValueError:
                problems.append(f"--json but stdout is not JSON:\n{p.stdout[:500]}")
        if ex.output and not ex.mode.startswith("illustrative"):
            try:
                check_output(ex, p.stdout, p.stderr)
            except AssertionError as e:
                problems.append(str(e))
        if problems:
            failures.append(f"{ex}\n  " + "\n  ".join(problems))
    assert not failures, "\n\n".join(failures)


def test_sample_outputs_not_run_name_the_test_that_covers_them():
    """Issue 53, "How to keep it true": a documented output is either compared with a real run here, or its block
    is marked `<!-- examples: not run (why; tests/...) -->` with the test that checks what it shows."""
    wrong = []
    for ex in doc_examples():
        if not ex.output or not why_not_run(ex):
            continue
        if not ex.mode.startswith("not run"):
            wrong.append(f"{ex}: its output is not compared ({why_not_run(ex)}) and the block is not marked")
        elif "tests/" not in ex.mode and "Ctrl-C" not in ex.mode:
            wrong.append(f"{ex}: marked {ex.mode!r}, naming no test that covers it")
    assert not wrong, "\n".join(wrong)


def test_every_example_not_run_says_why():
    for ex in ALL:
        reason = why_not_run(ex)
        assert "not known to be read-only" not in reason, f"{ex}: {reason}"


# ------------------------------------------------------------------ outputs of commands that are not run (issue 26)

STEP_LINE = re.compile(r"\[[\w.-]+/\d+\] (ok  |FAIL|skip) (\S+)\s+(.*?)(?: \([\d.]+s\))?\s*$")


def doc_step_lines():
    """Every progress line of a step shown in a fenced block of the docs: (source, mark, step, summary)."""
    out = []
    for path in DOC_FILES:
        rel, fence = os.path.relpath(path, REPO), False
        for n, ln in enumerate(open(path, encoding="utf-8").read().splitlines(), 1):
            if re.match(r"\s*```", ln):
                fence = not fence
                continue
            m = STEP_LINE.search(ln) if fence else None
            if m:
                out.append((f"{rel}:{n}", m.group(1), m.group(2), m.group(3)))
    return out


def test_step_lines_anywhere_in_the_docs_have_the_real_counts(tb, deploy):
    """A documented step line that describes what a real run printed (the same words once numbers are set
    aside) must also have its counts: `28 checks` where verify now makes 29 is caught here, in every block."""
    env = {"VPD_TESTBED_DIR": str(tb.root)}
    real = []
    for argv in (["up", "qwen36-dflash", "--skip-config-write"], ["up", "qwen36-dflash", "-y"],
                 ["verify", "qwen36-dflash"], ["verify", "qwen36-mtp"], ["down", "qwen36-dflash"]):
        p = deploy(*argv, env=env, timeout=300)
        real += [m.groups() for m in map(STEP_LINE.search, (p.stdout + p.stderr).splitlines()) if m]
    assert real, "no step lines in the real runs"
    wrong = []
    for src, mark, step, summary in doc_step_lines():
        same = [r for r in real if r[:2] == (mark, step) and _matches(_norm(summary, False), _norm(r[2], False))]
        if same and not any(_matches(_norm(summary), _norm(r[2])) for r in same):
            wrong.append(f"{src}: {mark} {step} {summary}\n    real: {same[0][2]}")
    assert not wrong, "documented counts differ from a real run:\n" + "\n".join(wrong)


def _click_commands():
    from orchestrator.cli import main

    def walk(cmd, path):
        yield path, cmd
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(None):  # the lazily loaded commands too
                sub = cmd.get_command(None, name)
                yield from walk(sub, path + [name])
    return list(walk(main, ["deploy"]))


def test_every_option_is_documented_in_cli_md():
    """Each option of each command (and each KEY= an option's help names, e.g. --ct-option's init=, onboot=) is in
    docs/cli.md: a new option without its line there fails here."""
    text = open(os.path.join(REPO, "docs", "cli.md"), encoding="utf-8").read()
    missing = []
    for path, cmd in _click_commands():
        if getattr(cmd, "hidden", False):
            continue
        for p in cmd.params:
            if not isinstance(p, click.Option) or p.hidden:
                continue
            names = [o for o in p.opts + p.secondary_opts if o.startswith("--")] or p.opts
            if not any(re.search(r"(?<![\w-])" + re.escape(o) + r"(?![\w-])", text) for o in names):
                missing.append(f"{' '.join(path)} {names[0]}")
            for key in re.findall(r"(?<![\w$])([a-z_]+)=[a-z0-9]", p.help or ""):
                if not re.search(r"(?<![\w-])" + re.escape(key) + "=", text):
                    missing.append(f"{' '.join(path)} {names[0]} {key}=")
    assert not missing, "options not documented in docs/cli.md: " + ", ".join(missing)


def test_state_file_names_in_the_docs_exist_in_the_code():
    """`last_failure.json`, not `failure.json`: every file of the state directory the docs name (a path under
    /var/lib/vllm-pve-deploy/, or a row of a table of files) is one the code writes or reads."""
    import glob

    code = "".join(open(f, encoding="utf-8").read() for f in glob.glob(os.path.join(REPO, "orchestrator", "**", "*.py"),
                                                                       recursive=True))
    wrong = []
    for path in DOC_FILES:
        for n, ln in enumerate(open(path, encoding="utf-8").read().splitlines(), 1):
            names = re.findall(r"/var/lib/vllm-pve-deploy/([a-z][\w.-]*\.(?:json|log|lock))\b", ln)
            names += re.findall(r"^\| `([a-z][\w.-]*\.(?:json|log|lock))` \|", ln)
            for name in names:
                if re.search(r"-\d{8}T", name):  # an install id in the name: its fixed prefix must be in the code
                    name = name[:re.search(r"-\d{8}T", name).start() + 1]
                if not re.search(r"(?<![\w.-])" + re.escape(name) + r"(?![\w])", code):
                    wrong.append(f"{os.path.relpath(path, REPO)}:{n}: {name}")
    assert not wrong, "state file names in the docs that the code does not know: " + ", ".join(wrong)
