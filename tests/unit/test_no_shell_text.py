"""Issue 51: no hand-built shell. A script run by `sh -c` / `bash -c` anywhere in the package (workstation and agent)
is a constant, its values passed as positional parameters ("$1"...) or quoted by remote.shell_join; never text
built by formatting (an f-string, %-format, .format, or + of text and a value). Found by reading the AST of every
module: the argv ["sh", "-c", SCRIPT, ...] (SCRIPT inline or a name bound in the same function) and any formatted
string whose text says `sh -c`."""

import ast
import os

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "orchestrator")
SHELLS = {"sh", "bash", "dash"}
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)

# (module, function) allowed for now, each with the issue that removes it; the list may only shrink
ALLOWED: dict = {}


def _formatted(e, names) -> bool:
    if isinstance(e, ast.JoinedStr):
        return any(isinstance(v, ast.FormattedValue) for v in e.values)
    if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Mod):
        return isinstance(e.left, (ast.Constant, ast.JoinedStr))
    if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add):  # text + a value (not a list + a list)
        text = [isinstance(x, ast.JoinedStr) or isinstance(x, ast.Constant) and isinstance(x.value, str)
                for x in (e.left, e.right)]
        return any(text) and not (all(text) and not any(isinstance(x, ast.JoinedStr) for x in (e.left, e.right)))
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "format":
        return True
    return isinstance(e, ast.Name) and e.id in names


def _scopes(tree):
    """(function name, its own nodes) for the module and every function, nested functions apart."""
    for fn in [tree] + [f for f in ast.walk(tree) if isinstance(f, SCOPES)]:
        todo, own = [c for c in ast.iter_child_nodes(fn) if not isinstance(c, SCOPES)], []
        while todo:
            node = todo.pop(0)
            own.append(node)
            todo[:0] = [c for c in ast.iter_child_nodes(node) if not isinstance(c, SCOPES)]
        yield getattr(fn, "name", "<module>"), own


def shell_text_sites(source: str) -> list:
    """[(function, line, why)] of every shell script built by formatting in the source."""
    out = []
    for name, nodes in _scopes(ast.parse(source)):
        made = {t.id for n in nodes if isinstance(n, ast.Assign) and _formatted(n.value, ())
                for t in n.targets if isinstance(t, ast.Name)}
        for n in nodes:
            if isinstance(n, (ast.List, ast.Tuple)):
                e = n.elts
                for i in range(len(e) - 2):
                    if (isinstance(e[i], ast.Constant) and isinstance(e[i].value, str)
                            and os.path.basename(e[i].value) in SHELLS
                            and isinstance(e[i + 1], ast.Constant) and e[i + 1].value == "-c"
                            and _formatted(e[i + 2], made)):
                        out.append((name, e[i + 2].lineno, f"{e[i].value} -c with a formatted script"))
            if _formatted(n, ()) and not isinstance(n, ast.Name):
                text = " ".join(c.value for c in ast.walk(n) if isinstance(c, ast.Constant) and isinstance(c.value, str))
                if any(f"{sh} -c " in text for sh in SHELLS):
                    out.append((name, n.lineno, "formatted text that runs `sh -c`"))
    return out


def test_the_finder_finds_each_kind():
    src = ("def f(x):\n"
           "    s = f'ls {x}'\n"
           "    run(['sh', '-c', s])\n"
           "    run(['/bin/bash', '-c', 'ls %s' % x])\n"
           "    run(['sh', '-c', 'ls {}'.format(x)])\n"
           "    run(['sh', '-c', 'ls ' + x])\n"
           "    t = f\"ssh h sh -c '{x}'\"\n"
           "    run(['sh', '-c', CONST, 'sh', x])\n")
    assert [line for _, line, _ in shell_text_sites(src)] == [3, 4, 5, 6, 7]


def test_no_shell_script_is_built_by_formatting():
    found = []
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                with open(path) as fh:
                    for fn, line, why in shell_text_sites(fh.read()):
                        rel = os.path.relpath(path, PKG)
                        if (rel, fn) not in ALLOWED:
                            found.append(f"orchestrator/{rel}:{line} ({fn}): {why}")
    assert not found, ("shell text built by formatting; pass the values as positional parameters (sh -c SCRIPT sh "
                       "ARG...) or quote them with remote.shell_join:\n" + "\n".join(found))


def test_the_allowed_sites_still_exist():
    """An allowed site that is gone (fixed) leaves the list: the list only shrinks."""
    for (rel, fn), why in ALLOWED.items():
        with open(os.path.join(PKG, rel)) as fh:
            sites = [s for s in shell_text_sites(fh.read()) if s[0] == fn]
        assert sites, f"{rel} {fn} builds no shell text now: remove it from ALLOWED ({why})"
