"""Step `gpu-plumbing`: does the container see the GPUs its playbook assigns, through the right nodes, with the
host's driver version, a CUDA the driver supports and enough /dev/shm? The host's facts in one exec over the
operation's SSH connection, the container's over its agent session; orchestrator/steps/plumbing_check.py decides."""

from __future__ import annotations

import re
import time

from orchestrator.steps import plumbing_check as PL
from orchestrator.core import sizing as Z
from orchestrator.steps.plan import Step
from . import Context


def run_check(ctx: Context, step: Step) -> tuple[list[dict], dict]:
    """-> (findings, facts {host, container}); raises only when the container's agent cannot be reached."""
    host = PL.read_host(ctx.session, ctx.pb.vmid, smi_timeout_s=ctx.pb.conf.gpu.nvidia_smi_timeout_s)
    r = ctx.call(step)
    ct = r.plumbing if isinstance(r.plumbing, dict) else {}
    pb = ctx.pb
    found = PL.findings(None if host.get("error") else host, ct, host_name=pb.host, vmid=pb.vmid, gpus=list(pb.gpus),
                        tp=pb.conf.serve.tensor_parallel_size)
    return found, {"host": host, "container": ct}


def container_gpu_count(ct_facts: dict | None) -> int | None:
    """How many GPUs the container has: its /dev/nvidiaN nodes (the agent's plumbing facts), None unknown."""
    nodes = PL.sane_container(ct_facts)["nodes"] if isinstance(ct_facts, dict) and "nodes" in ct_facts else {}
    n = sum(1 for p, v in nodes.items() if re.fullmatch(r"/dev/nvidia\d+", p) and v["kind"] == "char")
    return n or None


def sized_on_measured_gpus(ctx: Context, host_facts: dict | None, ct_facts: dict | None = None) -> dict | None:
    """The sizing check with the GPU memory the host's nvidia-smi just reported (sizing.check_measured); a
    suggested tensor_parallel_size is bounded by the container's GPUs (else the host's)."""
    if not host_facts or host_facts.get("error"):
        return None
    return Z.check_measured(ctx.pb, host_facts.get("gpu_mem"), container_gpu_count(ct_facts))


def gpu_plumbing(ctx: Context, step: Step) -> list[dict]:
    t0 = time.monotonic()
    found, facts = run_check(ctx, step)
    herr = (facts["host"] or {}).get("error")
    if found:
        names = ", ".join(dict.fromkeys(f["problem"] for f in found))
        ctx.fail(step.name, t0, f"{len(found)} GPU plumbing problem(s) in container {ctx.pb.vmid} ({names}); "
                                "nothing was stopped\n" + PL.render(found),
                 fix="; ".join(dict.fromkeys(f["fix"] for f in found)), findings=found)
    note = f" (host side not read: {herr})" if herr else ""
    for n in PL.notes(None if herr else facts["host"], host_name=ctx.pb.host, vmid=ctx.pb.vmid):
        ctx.progress.say(ctx.where, "     " + n)
    fits = sized_on_measured_gpus(ctx, facts["host"], facts["container"])
    if fits and fits["level"] == "warn":
        ctx.progress.say(ctx.where, f"     warning: sizing on the measured GPUs: {fits['line']}")
    ctx.record(step.name, True, f"container {ctx.pb.vmid} sees GPUs {list(ctx.pb.gpus)}, nvidia-uvm, the "
                                f"host's driver version and enough /dev/shm{note}", t0)
    if fits and fits["level"] == "refuse":  # filed under `sizing`, as verify files it (issue 53)
        msg, fix = Z.measured_refusal(ctx.pb, fits)
        ctx.fail("sizing", time.monotonic(), msg + "; nothing was stopped", fix=fix, fits=fits)
    return found
