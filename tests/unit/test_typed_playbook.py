"""Issue 51: the typed playbook (spec.py: Playbook.conf), built once at load from the schema's one table.

- each typed class's fields are exactly its map's keys in spec_schema.PLAYBOOK (the schema applied the defaults);
- the derived values (the DFlash defaults of serve) are computed there, once;
- string-key reads of the playbook (`pb.data["serve"]`, `sv.get("port")`, ...) outside the loader are counted per
  module, and today's counts are a ceiling: the number can only go down (0 outside the modules in CEILING);
- the inventory's runtime is the same typed `Runtime` (ContainerSpec.runtime), and its string-key reads
  (`c.runtime["python"]`, `rt.get("state_dir")`) are counted the same way: 0 outside the loader."""

import ast
import os
from dataclasses import FrozenInstanceError, fields

import pytest

from orchestrator.core import spec as S
from orchestrator.core.spec_schema import DEFAULT_STATE_DIR, DRAFTER, PLAYBOOK
from test_spec import edit, inv, work  # noqa: F401 - the fixture

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "orchestrator")


def _map(*path):
    m = PLAYBOOK
    for key in path:
        m = m.fields[key].type
    return m


@pytest.mark.parametrize("cls,schema,derived", [
    (S.Runtime, ("runtime",), ()), (S.Serve, ("serve",), ()), (S.Speculative, ("speculative",), ()),
    (S.Requires, ("requires",), ()), (S.Install, ("requires", "install"), ()), (S.Supervise, ("supervise",), ()),
    (S.SizingConf, ("sizing",), ()), (S.Fetch, ("fetch",), ()), (S.Gpu, ("gpu",), ()), (S.Weights, ("model",), ()),
    (S.Drafter, None, ()), (S.Target, ("target",), ()), (S.Acceptance, ("acceptance",), ()),
    (S.Probe, ("acceptance", "probe"), ("prompts_source",)), (S.Router, ("router",), ()),
    (S.RouterInstall, ("router", "install"), ()), (S.Tune, ("tune",), ()),
])
def test_each_typed_class_has_exactly_its_maps_keys(cls, schema, derived):
    keys = set((DRAFTER if schema is None else _map(*schema)).fields) | set(derived)
    assert {f.name for f in fields(cls)} == keys, cls.__name__
    assert set(f.name for f in fields(S.Conf)) <= set(PLAYBOOK.fields)


def test_conf_is_built_at_load_frozen_with_the_schema_defaults_derived_values_and_variants(work):
    pb = S.load_playbook(str(work / "playbooks" / "qwen36-dflash.yaml"), inv(work))
    assert "conf" in vars(pb)  # built by load_playbook, not on first use
    c = pb.conf
    assert c.serve.port == pb.data["serve"]["port"] and c.requires.install.installer == "auto"
    assert c.speculative.drafter.sha256 == pb.data["speculative"]["drafter"]["sha256"]
    assert c.runtime.state_dir == pb.data["runtime"]["state_dir"]
    assert c.serve.attention_backend == "flash_attn"
    with pytest.raises(FrozenInstanceError):
        c.serve.port = 1
    edit(work, "qwen36-dflash", "  max_num_batched_tokens: 32768\n", "")
    edit(work, "qwen36-dflash", "  attention_backend: flash_attn ", "  # ")
    pb = S.load_playbook(str(work / "playbooks" / "qwen36-dflash.yaml"), inv(work))
    assert pb.data["serve"]["max_num_batched_tokens"] is None  # unset in the file ...
    assert pb.conf.serve.max_num_batched_tokens == S.DFLASH_BATCHED_TOKENS  # ... derived once, at load
    assert pb.conf.serve.attention_backend == "flash_attn"
    mtp = S.load_playbook(str(work / "playbooks" / "qwen36-mtp.yaml"), inv(work))
    assert mtp.conf.serve.max_num_batched_tokens is None and mtp.conf.speculative.drafter is None
    # the sections deploy up, tune, compare and the router read: typed, with the load-time values
    a = mtp.conf.acceptance
    assert a.probe.prompts and a.probe.max_rounds == min(100, a.probe.rounds * 4) and a.probe.prompts_source
    assert a.on_low_acceptance == "fail" and a.min_mean_acceptance_length is None  # k-dependent: gate.thresholds
    assert mtp.targets == [mtp.conf.target] and mtp.where == mtp.conf.target.where == f"{mtp.host}/{mtp.vmid}"
    assert mtp.conf.targets is None and mtp.conf.router is None and mtp.conf.tune.expected_concurrency == 1
    # compare's and tune's launches (k, schedule, baseline): variants built by the loader, each with its own conf
    pb = S.load_playbook(str(work / "playbooks" / "qwen36-dflash.yaml"), inv(work))
    v = pb.variant(k=3, schedule=[(1, 4, 3), (5, 4096, 1)])
    assert v.conf.speculative.num_speculative_tokens == 3 and v.conf.speculative.schedule == ([1, 4, 3], [5, 4096, 1])
    assert v.conf.acceptance.on_low_acceptance == "fail" and v.fallback is None and not v.spec_off
    assert pb.conf.speculative.num_speculative_tokens == 15 and pb.conf.acceptance.on_low_acceptance == "fallback"
    assert v.variant(k=2).conf.speculative.schedule is None  # a fixed k drops the schedule
    off = pb.variant(off=True)
    assert off.spec_off and off.variant().spec_off  # the baseline stays the baseline (compare --baseline)


# ---- the ceiling on string-key reads of the playbook

PB_ATTRS = {"data", "serve", "spec", "drafter", "runtime", "targets"}  # Playbook's dict-valued accessors
PB_NAMES = {"pb", "playbook", "fb", "fallback", "m", "member", "mb"}  # what the code calls a Playbook
LOADER = {"core/spec.py", "core/spec_schema.py", "core/schema.py"}  # the loader reads the tree it builds


def _is_pb(node) -> bool:
    """pb / ctx.pb / self.pb / run.ctx.pb ..."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    return name in PB_NAMES


SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _own_scope(fn):
    """The nodes of fn's own body, in source order, not those of the functions defined in it."""
    todo = [c for c in ast.iter_child_nodes(fn) if not isinstance(c, SCOPES)]
    while todo:
        node = todo.pop(0)
        yield node
        todo[:0] = [c for c in ast.iter_child_nodes(node) if not isinstance(c, SCOPES)]


def _is_pb_root(e) -> bool:
    return isinstance(e, ast.Attribute) and e.attr in PB_ATTRS and _is_pb(e.value)


def _str_key_reads(tree, is_root=_is_pb_root, keys=None) -> int:
    """Subscripts with a string constant and .get("KEY") calls on a playbook's dict accessors (pb.data, pb.serve,
    ...), or on a local name bound to one (sv = pb.serve; sv["port"]) or to something read from one. `is_root`:
    what the data is read from; `keys`: only these keys count (None: any)."""
    n = 0
    for fn in [tree] + [f for f in ast.walk(tree) if isinstance(f, SCOPES)]:
        tainted = set()

        def rooted(e) -> bool:
            while True:
                if is_root(e):
                    return True
                if isinstance(e, ast.Name):
                    return e.id in tainted
                if isinstance(e, ast.BoolOp):
                    return any(rooted(v) for v in e.values)
                if isinstance(e, ast.Subscript):
                    e = e.value
                elif isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "get":
                    e = e.func.value
                elif isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id in ("dict", "list") \
                        and e.args:
                    e = e.args[0]
                else:
                    return False

        for node in _own_scope(fn):
            bound = (node.targets if isinstance(node, ast.Assign) and rooted(node.value) else
                     [node.target] if isinstance(node, (ast.For, ast.comprehension)) and rooted(node.iter) else [])
            tainted |= {x.id for t in bound for x in ast.walk(t) if isinstance(x, ast.Name)}
            key = None
            if isinstance(node, ast.Subscript) and rooted(node.value):
                key = node.slice
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "get" and node.args and rooted(node.func.value):
                key = node.args[0]
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and (keys is None or key.value in keys):
                n += 1
    return n


def reads_per_module(**how) -> dict:
    out = {}
    for root, _, files in os.walk(PKG):
        if "container" in root.split(os.sep):
            continue  # the agent never sees a Playbook
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), PKG)
            if f.endswith(".py") and rel not in LOADER:
                with open(os.path.join(root, f)) as fh:
                    n = _str_key_reads(ast.parse(fh.read()), **how)
                if n:
                    out[rel] = n
    return out


# measured on this tree (issue 51): lower these as modules move to Playbook.conf; a module over its number reads
# the playbook by string again (before: 330 reads in 23 modules; after plan_args.py and sizing.py: 236 in 21; after
# the steps, deploy, cli, core, observe/monitor and serving modules: 46 in 7, all in modules other sessions edit)
CEILING: dict = {}  # every module reads Playbook.conf now; a module that reads by string again fails here


def test_string_key_reads_of_the_playbook_only_go_down():
    got = reads_per_module()
    over = {m: (n, CEILING.get(m, 0)) for m, n in got.items() if n > CEILING.get(m, 0)}
    assert not over, (f"string-key reads of the playbook above the ceiling (module: (now, ceiling)): {over}; read "
                      "Playbook.conf (spec.py) instead, or add the key to it")
    assert not set(got) & {"steps/plan_args.py", "core/sizing.py", "steps/plan.py", "deploy/tune.py"}


def test_the_counter_sees_direct_aliased_and_looped_reads():
    src = ("def f(pb, ctx):\n"
           "    sv = pb.serve\n"
           "    x = sv['port'] + ctx.pb.data['model']['path'] + (pb.data.get('fetch') or {}).get('store')\n"
           "    for t in pb.targets:\n"
           "        t['host']\n"
           "    return pb.conf.serve.port, other['port']\n")
    assert _str_key_reads(ast.parse(src)) == 6


# ---- the inventory's runtime: typed like the playbook's (ContainerSpec.runtime is a spec.Runtime)

RT_KEYS = {f.name for f in fields(S.Runtime)}
RT_NAMES = {"rt", "runtime"}  # what the code calls a container's runtime (resolve_targets' records, parameters)


def _is_inventory_runtime(e) -> bool:
    """c.runtime, ct.runtime, self.runtime (pb.conf.runtime is the typed playbook's), or a name a runtime is in."""
    return isinstance(e, ast.Attribute) and e.attr == "runtime" and not (
        isinstance(e.value, ast.Attribute) and e.value.attr == "conf") or isinstance(e, ast.Name) and e.id in RT_NAMES


def test_the_inventory_runtime_is_typed_and_read_by_no_string_key(tmp_path):
    (tmp_path / "inv.yaml").write_text(
        "hosts:\n  - name: pve1\n    address: 127.0.0.1\n    containers:\n"
        "      - {vmid: 129, runtime: {python: /opt/v/bin/python}}\n"
        "      - {vmid: 130, runtime: {python: /opt/w/bin/python, vllm: /usr/bin/vllm, state_dir: /srv/vpd}}\n"
        "      - {vmid: 131}\n")
    h = S.load_inventory(str(tmp_path / "inv.yaml")).host("pve1")
    assert h.container(129).runtime == S.Runtime("/opt/v/bin/python", "/opt/v/bin/vllm", DEFAULT_STATE_DIR)
    assert h.container(130).runtime == S.Runtime("/opt/w/bin/python", "/usr/bin/vllm", "/srv/vpd")
    assert h.container(131).runtime is None
    with pytest.raises(FrozenInstanceError):
        h.container(129).runtime.python = "/x"
    # before (15aa653): 13 in 4 modules (status.py 5, doctor.py 5, plan.py 2, prepare.py 1), most with a default of
    # their own (`or DEFAULT_STATE_DIR`); the loader (spec.py) alone builds it now, from the schema's defaults
    got = reads_per_module(is_root=_is_inventory_runtime, keys=RT_KEYS)
    assert not got, f"string-key reads of a container's runtime (module: count): {got}; read its fields (spec.Runtime)"


def test_the_runtime_counter_sees_inventory_reads_but_not_agent_answers():
    src = ("def f(c, inv, pb, r):\n"
           "    x = c.runtime['python'], inv.hosts['a'].container(1).runtime.get('state_dir')\n"
           "    host, vmid, rt = scope[0]\n"
           "    y = rt.get('vllm') or rt['state_dir'], pb.conf.runtime.python\n"
           "    rt = r.runtime\n"
           "    return rt.get('venv_root'), rt['target']\n")
    assert _str_key_reads(ast.parse(src), _is_inventory_runtime, RT_KEYS) == 4
