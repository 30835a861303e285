"""What runs in the foreground until Ctrl-C, for the CLI: the tunnel of `deploy endpoint --tunnel` (one SSH
connection to the host; the host's sshd connects to the container, as `ssh -L` does). The CLI's commands only
parse options and call this; rendering of results is render.py's."""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading

import click

from orchestrator.core.endpoint import Tunnel, curl_line
from orchestrator.core.errors import EXIT_OK, EXIT_UNREACHABLE, CheckFailed, UsageError
from orchestrator.core.remote import AuditLog, HostSession


def run_tunnel(inv, pb, row: dict, local_port: int | None, *, as_json: bool = False) -> int:
    """deploy endpoint --tunnel: forward until Ctrl-C / SIGTERM (exit 0) or the connection drops (3)."""
    if not row["url"]:
        raise CheckFailed(f"the address of {row['where']} is unknown, so there is nothing to tunnel to",
                          where=row["where"], fix=row.get("note") or f"deploy discover {row['host']} --write")
    host = inv.host(row["host"])
    if local_port is None:  # the served port when it is free here, else any
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", row["port"]))
                local_port = row["port"]
            except OSError:
                local_port = 0
    session = HostSession(host, AuditLog())
    conn = session.connect()
    transport = conn.transport
    remote = (row["address"], row["port"])
    try:  # can the host reach it at all? (one TCP connection from the host, closed at once)
        transport.open_channel("direct-tcpip", remote, ("127.0.0.1", 0), timeout=15).close()
    except Exception as e:  # noqa: BLE001 - paramiko's ChannelException and friends: said with the fix
        session.close()
        raise CheckFailed(f"{host.name} cannot connect to {remote[0]}:{remote[1]} ({e})", where=row["where"],
                          fix=f"is it serving? deploy status {pb.name}; is {remote[0]} the container's address? "
                              f"deploy discover {host.name}") from None
    tun = Tunnel(transport, remote, local_port,
                 on_event=lambda kind, what: click.echo(f"tunnel: {what}", err=True) if kind == "error" else None)
    try:
        port = tun.start()
    except OSError as e:
        session.close()
        raise UsageError(f"cannot listen on 127.0.0.1:{local_port}: {e.strerror or e}",
                         fix="pick another --local-port (0: any free one)") from None
    local = f"http://127.0.0.1:{port}/v1"
    via = f"{host.user}@{host.ssh_config_alias or host.address}:{host.port}"
    if as_json:
        click.echo(json.dumps({"ok": True, "playbook": pb.name, "where": row["where"], "local_url": local,
                                "url": row["url"], "via": via, "curl": curl_line(local, row["model"],
                                                                                   row["api_key_env"])}), nl=True)
    else:
        click.echo(f"tunnel: {local} -> {remote[0]}:{remote[1]} ({pb.name} on {row['where']}) through {host.name} "
                   f"({via}); Ctrl-C closes it")
        click.echo(f"  {curl_line(local, row['model'], row['api_key_env'])}")
    sys.stdout.flush()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    code = EXIT_OK
    while not stop.wait(0.5):
        if not transport.is_active():
            click.echo(f"tunnel: the SSH connection to {host.name} ({via}) was lost; deploy endpoint {pb.name} "
                       "--tunnel opens a new one", err=True)
            code = EXIT_UNREACHABLE
            break
    tun.close()
    session.close()
    if code == EXIT_OK:
        click.echo(f"tunnel closed ({tun.connections} connection(s) carried)", err=True)
    return code
