"""Stop vLLM safely, free the GPUs, prove it by measurement; name any holder, inside or outside the container."""

from __future__ import annotations

import time

from ..agent.protocol import GpusFreeResult, StopResult
from orchestrator.core.errors import DeployError
from orchestrator.core.facts import (HOST_HOLDERS_SH, nvml_mismatch_fix, parse_host_holders, parse_pct_config_gpus,
                                     parse_pct_list)
from orchestrator.steps.plan import Step
from . import Context
from orchestrator.core.remote import shell_word
from orchestrator.core.spec import playbooks_targeting


def one_line(cmdline) -> str:
    """A process's argv as one line: a newline inside an argument (python -c 'SCRIPT') would break the FAILED
    block it is printed in (issue 53); each line break is shown as ⏎ and runs of spaces as one."""
    return " ".join(str(cmdline or "").replace("\r", "").replace("\n", " ⏎ ").split())


def fmt_mem(readings: dict | None) -> str:
    if not readings:
        return "-"
    return ", ".join(f"GPU{g} {r['used']} MiB" if r else f"GPU{g} ?" for g, r in sorted(readings.items(),
                                                                                         key=lambda x: int(x[0])))


NAMED_CMDLINE_MAX = 200  # as the agent caps them (agent/container/gpus.py); again here: the container's word


def signalled(fz: dict, which: str) -> str:
    """The processes fuser sent SIG{which} to, each named with its command line as the confirmation prompt names a
    holder, in gpus-free's form `PID n (comm: cmdline)`: from the agent's {which}_procs, read before the signal
    (the container's text: whitespace folded, capped; controls are stripped on output). Bare pids from an older
    agent."""
    procs = fz.get(f"{which}_procs")
    pids = fz.get(which) or []
    if not isinstance(procs, list) or not all(isinstance(p, dict) for p in procs):
        return ", ".join(f"PID {p}" for p in pids) or "none"
    out = []
    for p in procs:
        cmd = " ".join(str(p.get("cmdline") or "").split())
        cmd = cmd[:NAMED_CMDLINE_MAX] + "..." if len(cmd) > NAMED_CMDLINE_MAX + 3 else cmd
        comm = " ".join(str(p.get("comm") or "?").split())[:64]
        out.append(f"PID {p.get('pid')} ({comm}: {cmd or '?'})")
    return ", ".join(out) or "none"


def stop(ctx: Context, step: Step) -> StopResult:
    t0 = time.monotonic()
    rep: StopResult = ctx.call(step, on_event=lambda e: ctx.progress.say(ctx.where, "     " + e.get("message", "")))
    if rep.refused:
        ctx.fail(step.name, t0, rep.refused + "; nothing was stopped",
                 fix=f"deploy down {shell_word(rep.running)} stops that deployment")
    stopped = rep.terminated + rep.killed
    parts = []
    u = rep.unit
    if rep.unit_problem:
        ctx.fail(step.name, t0, rep.unit_problem, fix=f"pct exec {ctx.pb.vmid} -- systemctl status "
                                                        f"{shell_word((rep.state or {}).get('unit'))}", report=rep)
    if u:
        parts.append(f"systemctl stop {u['unit']}: {len(rep.terminated or [])} process(es) of its cgroup "
                     f"ended; unit now {u.get('active')}, {u.get('enabled')}")
        if rep.cgroup_left:
            ctx.fail(step.name, t0, f"{u['unit']} stopped but its cgroup still holds "
                                    + ", ".join(f"{p['pid']} ({p['comm']})" for p in rep.cgroup_left),
                     fix=f"pct exec {ctx.pb.vmid} -- systemctl kill -s KILL {shell_word(u['unit'])}", report=rep)
    elif rep.terminated:
        n, sent = len(rep.terminated), rep.sigterm
        pg = (rep.state or {}).get("pgid")
        parts.append(f"stopped the {n} process(es) deploy started in process group {pg}" +
                     (f" (SIGTERM to {len(sent)}; the other {n - len(sent)} were already exiting)"
                      if sent is not None and len(sent) != n else " with SIGTERM"))
    if rep.killed:
        parts.append("SIGKILLed " + ", ".join(f"{p['pid']} ({p.get('comm')})" for p in rep.killed))
    fz = rep.fuser or {}
    if fz.get("refused"):
        ctx.fail(step.name, t0, fz["refused"], fix="this must never run on the Proxmox host itself")
    if fz.get("term") or fz.get("kill"):
        parts.append(f"fuser -k freed the devices (TERM: {signalled(fz, 'term')}; KILL: {signalled(fz, 'kill')})")
    fuser_pids = set(fz.get("term") or []) | set(fz.get("kill") or [])
    foreign = [p for p in rep.foreign or [] if p["pid"] not in fuser_pids]  # killed by fuser: not "left alone"
    if foreign:
        parts.append(f"left alone {len(foreign)} vLLM process(es) deploy did not start ("
                     + ", ".join(f"{p['pid']} {p['comm']}" for p in foreign[:4]) + ")")
    left = rep.leftovers or []
    if left:
        names = "; ".join(f"PID {p['pid']} ({p['comm']}: {one_line(p['cmdline'])}) holds {', '.join(p['devices'])}"
                          for p in left)
        ctx.record(step.name, None, ("; ".join(parts) + "; " if parts else "") + f"still holding GPUs: {names}",
                   t0, report=rep)
    else:
        ctx.record(step.name, True, "; ".join(parts) or "nothing of ours was running", t0, report=rep)
    rep.stopped = stopped
    return rep


def gpus_free(ctx: Context, step: Step) -> GpusFreeResult:
    """Step `gpus-free` (agent action gpus_free): prove by measurement that the GPUs are free, or name the holder."""
    t0 = time.monotonic()

    def on_event(e):  # printed when the readings change, else every 10 s (one updating line on a TTY)
        mem = fmt_mem(e.get("readings"))
        ctx.progress.waiting(ctx.where, f"gpu {mem} {e.get('busy')}",
                             f"     waiting for GPU memory: {mem} (busy {e.get('busy')}, {e.get('elapsed')}s)")

    r: GpusFreeResult = ctx.call(step, on_event=on_event)
    v = r.verdict
    thr = step.args["threshold_mib"]
    if v == "free":
        ctx.record(step.name, True, f"all under {thr} MiB after {r.seconds:.1f}s: {fmt_mem(r.after)}",
                   t0, before=r.before, after=r.after)
        return r
    if v and v.startswith("nvidia_smi_"):
        mismatch = nvml_mismatch_fix(r.message, ctx.pb.host, ctx.pb.vmid)  # two versions, not a wedged driver
        ctx.fail(step.name, t0, f"`{r.command or 'nvidia-smi'}` {r.message} (timeout {r.timeout_s}s)",
                 fix=(mismatch + "; nothing was launched") if mismatch else
                 f"the NVIDIA driver may be wedged: run nvidia-smi on {ctx.pb.host} itself (a hung one needs the "
                 "driver reloaded or the host rebooted); nothing was launched",
                 result=r)
    if v == "gpu_missing":
        ctx.fail(step.name, t0, f"GPU(s) {r.missing} not visible in the container (nvidia-smi shows "
                                f"{r.seen})", fix="check the container's GPU passthrough (pct config)", result=r)
    busy = ", ".join(f"GPU{g} {r.after[str(g)]['used']} MiB" for g in r.busy or [])
    if v == "held_inside":
        holders = "; ".join(f"PID {h['pid']} ({h['comm']}: {one_line(h['cmdline'])}) holds {', '.join(h['devices'])}"
                            for h in r.holders)
        ctx.fail(step.name, t0, f"GPU memory still used after {r.seconds:.0f}s ({busy} > {thr} MiB); "
                                f"holders in this container: {holders}",
                 fix=f"deploy restart {ctx.pb.name} --clean-gpus -y (kills those holders; without -y it asks on a "
                     "terminal and kills nothing elsewhere), or stop them yourself",
                 result=r)
    # held outside: nothing in this container holds the devices
    others = other_containers_sharing(ctx, r.busy or step.args["gpus"])
    for o in others:
        o["playbooks"] = [name for name, _pb in playbooks_targeting(ctx.pb.host, o["vmid"])]
    holders = host_holders(ctx, r.busy or step.args["gpus"])
    extra = ("; other running containers on this host given the busy GPU(s): " +
             ", ".join(f"{o['vmid']} ({o['name']}, GPUs {o['gpus']}"
                       + (f"; targeted by playbook {', '.join(o['playbooks'])}" if o["playbooks"] else "") + ")"
                       for o in others)) if others else \
        "; no other running container on this host is given the busy GPU(s), so the holder is the host itself"
    if holders:
        extra += "; on the host: " + ", ".join(
            f"host PID {h['pid']} ({h.get('comm') or '?'}) uses {h['mib']} MiB of GPU {h['gpu']}"
            + (f" in container {h['vmid']}" if h.get("vmid") else " (the host itself)") for h in holders)
    downs = [f"deploy down {shell_word(p)}" for o in others for p in o["playbooks"]]
    if downs:
        fix = (f"{' or '.join(downs)} frees them (it runs in container "
               f"{', '.join(str(o['vmid']) for o in others if o['playbooks'])} on the same GPUs), then deploy up "
               f"{ctx.pb.name}; or give each container its own GPUs. deploy never kills outside the target container")
    elif holders and not others:
        fix = (f"stop host PID {', '.join(str(h['pid']) for h in holders)} on {ctx.pb.host} yourself (deploy never "
               "kills on the host), then deploy up again")
    else:
        fix = ("stop the holder on the host or in the other container; deploy never kills outside the target "
               "container, and will not launch until the GPUs are free")
    ctx.fail(step.name, t0, f"GPU memory is held OUTSIDE this container ({busy} > {thr} MiB after "
                            f"{r.seconds:.0f}s, and no process in container {ctx.pb.vmid} holds /dev/nvidia*)"
                            + extra, fix=fix, result=r, others=others, host_holders=holders)


def host_holders(ctx: Context, gpus: list[int]) -> list[dict]:
    """Read-only, on the Proxmox host: the processes nvidia-smi says use the busy GPUs, outside this container
    (host PID, MiB, the container by its cgroup, or none: the host itself), as deploy doctor names them."""
    try:
        r = ctx.session.run(["sh", "-c", HOST_HOLDERS_SH], timeout=25, label="gpus-free")
    except DeployError:  # naming the holder is extra information; the failure stands without it
        return []
    if not r.ok:
        return []
    return [h for h in parse_host_holders(r.out)["holders"] if h["gpu"] in gpus and h.get("vmid") != ctx.pb.vmid]


def other_containers_sharing(ctx: Context, gpus: list[int]) -> list[dict]:
    """From `pct list` and `pct config`: the other running containers that are given any of `gpus`."""
    s = ctx.session
    res = s.run(["pct", "list"], timeout=20)
    out = []
    for ct in parse_pct_list(res.out):
        if ct["vmid"] == ctx.pb.vmid or ct["status"] != "running":
            continue
        cfg = s.run(["pct", "config", str(ct["vmid"])], timeout=20)
        shared = sorted(set(parse_pct_config_gpus(cfg.out)) & set(gpus))
        if shared:
            out.append({"vmid": ct["vmid"], "name": ct["name"], "gpus": shared})
    return out

