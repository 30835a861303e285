"""Where a deployment answers: the container's real address (from the inventory, filled by `deploy discover`),
and the SSH tunnel command that reaches it when that address is not routable from this workstation.

Routability is decided locally, without sending anything: a loopback or public address is routable; a private
or link-local one is routable only when a route other than the default one covers it (Linux: /proc/net/route,
i.e. this machine sits on that network or a VPN to it). Otherwise the tunnel command is printed.
"""

from __future__ import annotations

import ipaddress
import struct


def _routes(path: str = "/proc/net/route") -> list[tuple[int, int]] | None:
    """[(network, mask)] of the non-default IPv4 routes as integers, None when unknown (not Linux).
    The file has each address as the hex of its bytes read as a little-endian word: 192.168.1.0 is 0001A8C0."""
    try:
        with open(path) as fh:
            rows = fh.read().splitlines()[1:]
    except OSError:
        return None
    out = []
    for r in rows:
        f = r.split()
        if len(f) < 8:
            continue
        dest, mask = (struct.unpack("<I", bytes.fromhex(x))[0] for x in (f[1], f[7]))
        if mask:
            out.append((dest, mask))
    return out


def routable(address: str | None, routes: list[tuple[int, int]] | None = None) -> bool | None:
    """True/False, or None when it cannot be told (a DNS name, no route table)."""
    if not address:
        return False
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None  # a name: leave it to the resolver
    if ip.is_loopback:
        return True
    if ip.is_global:
        return True
    if ip.version != 4:
        return None
    routes = _routes() if routes is None else routes
    if routes is None:
        return None
    n = int(ip)
    for dest, mask in routes:
        if n & mask == dest & mask:
            return True
    return False


def tunnel_command(host, address: str, port: int) -> str:
    """`ssh -N -L PORT:ADDRESS:PORT user@pve-host` through the Proxmox host (HostSpec)."""
    target = host.ssh_config_alias or f"{host.user}@{host.address}"
    extra = "" if host.ssh_config_alias or host.port == 22 else f" -p {host.port}"
    ident = f" -i {host.identity_file}" if host.identity_file and not host.ssh_config_alias else ""
    return f"ssh -N -L {port}:{address}:{port}{extra}{ident} {target}"


def endpoint(host, container, port: int) -> dict:
    """{url, address, routable, tunnel, local_url}: `url` is None when the inventory has no address for the
    container; then `note` says how to record it. With a tunnel, `local_url` is what to open once it runs."""
    address = getattr(container, "address", None) if container is not None else None
    if not address:
        return {"url": None, "address": None, "port": port, "routable": None, "tunnel": None, "local_url": None,
                "note": f"address unknown: none in the inventory; deploy discover {host.name} --write reads it, "
                        "or set address:"}
    shown = f"[{address}]" if ":" in address else address
    url = f"http://{shown}:{port}/v1"
    r = routable(address)
    tunnel = None if r else tunnel_command(host, address, port)
    return {"url": url, "address": address, "port": port, "routable": r, "tunnel": tunnel,
            "local_url": f"http://127.0.0.1:{port}/v1" if tunnel else None, "note": None}


def describe(ep: dict) -> str:
    """One line for people: the URL (and the tunnel), or where it listens when the address is unknown."""
    if not ep.get("url"):
        return f"port {ep.get('port')} in the container ({ep.get('note') or 'address unknown'})"
    if ep["tunnel"]:
        how = "not routable from here" if ep["routable"] is False else "may not be routable from here"
        return f"{ep['url']} ({how}: {ep['tunnel']}, then {ep['local_url']})"
    return ep["url"]
