"""Where a deployment answers: the container's real address (from the inventory, filled by `deploy discover`),
and the SSH tunnel command that reaches it when that address is not routable from this workstation.

Routability is decided locally, without sending anything: a loopback or public address is routable; a private
or link-local one is routable only when a route other than the default one covers it (Linux: /proc/net/route,
i.e. this machine sits on that network or a VPN to it). Otherwise the tunnel command is printed.
"""

from __future__ import annotations

import ipaddress
import json
import select
import shlex
import socket
import struct
import threading


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
    if ip.is_loopback or ip.is_global:
        return True
    if ip.version != 4:
        return None
    routes = _routes() if routes is None else routes
    if routes is None:
        return None
    n = int(ip)
    return any(n & mask == dest & mask for dest, mask in routes)


def tunnel_command(host, address: str, port: int) -> str:
    """`ssh -N -L PORT:ADDRESS:PORT user@pve-host` through the Proxmox host (HostSpec)."""
    target = host.ssh_config_alias or f"{host.user}@{host.address}"
    extra = "" if host.ssh_config_alias or host.port == 22 else f" -p {host.port}"
    ident = f" -i {host.identity_file}" if host.identity_file and not host.ssh_config_alias else ""
    return f"ssh -N -L {port}:{address}:{port}{extra}{ident} {target}"


def base_url(address: str, port: int) -> str:
    """http://ADDRESS:PORT (an IPv6 address in brackets): the one spelling of a server's URL, for the client URL
    below (+ /v1) and the router's replica URLs."""
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def endpoint(host, container, port: int) -> dict:
    """{url, address, routable, tunnel, local_url}: `url` is None when the inventory has no address for the
    container; then `note` says how to record it. With a tunnel, `local_url` is what to open once it runs."""
    address = getattr(container, "address", None) if container is not None else None
    if not address:
        return {"url": None, "address": None, "port": port, "routable": None, "tunnel": None, "local_url": None,
                "note": f"address unknown: none in the inventory; deploy discover {host.name} --write reads it, "
                        "or set address:"}
    url = base_url(address, port) + "/v1"
    r = routable(address)
    tunnel = None if r else tunnel_command(host, address, port)
    return {"url": url, "address": address, "port": port, "routable": r, "tunnel": tunnel,
            "local_url": base_url("127.0.0.1", port) + "/v1" if tunnel else None, "note": None}


def container_endpoint(inv, host_name: str, vmid: int, port: int) -> dict:
    """endpoint() of HOST_NAME/VMID's container from the inventory: the one place a deployment's (or a router's)
    client URL is computed (through server_endpoint and router_endpoint). A host not in the inventory gives url
    None with a note."""
    host = inv.hosts.get(host_name) if inv is not None else None
    if host is None:
        return {"url": None, "address": None, "port": port, "tunnel": None, "routable": None, "local_url": None,
                "note": f"host {host_name} is not in the inventory"}
    return endpoint(host, host.container(vmid), port)


def server_endpoint(inv, pb) -> dict:
    """The client endpoint of a one-target playbook's vLLM server (a fleet's member): its container, serve.port."""
    return container_endpoint(inv, pb.host, pb.vmid, pb.conf.serve.port)


def router_endpoint(inv, pb) -> dict:
    """The client endpoint of a playbook's router (router:): the router's container, router.port."""
    r = pb.conf.router
    return container_endpoint(inv, r.host, r.vmid, r.port)


def describe(ep: dict) -> str:
    """One line for people: the URL (and the tunnel), or where it listens when the address is unknown."""
    if not ep.get("url"):
        return f"port {ep.get('port')} in the container ({ep.get('note') or 'address unknown'})"
    if ep["tunnel"]:
        how = "not routable from here" if ep["routable"] is False else "may not be routable from here"
        return f"{ep['url']} ({how}: {ep['tunnel']}, then {ep['local_url']})"
    return ep["url"]


def curl_line(url: str, model: str, api_key_env: str | None = None) -> str:
    """A `curl` that asks the endpoint for a short completion (the API key, when the playbook has one, from the
    same local environment variable the playbook names: it never appears in the line)."""
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 16})
    auth = f' -H "Authorization: Bearer ${api_key_env}"' if api_key_env else ""
    return f"curl -s {url}/completions -H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}"


def playbook_endpoints(inv, pb) -> list[dict]:
    """One row per target of the playbook: where, the endpoint (see endpoint()), the served model and a curl line;
    for a playbook with router: one row, the router's (role "router"; clients use the replicas' key through it)."""
    r = pb.conf.router
    if r:
        return [_endpoint_row(r.host, r.vmid, "router", router_endpoint(inv, pb), pb.members[0])]
    return [_endpoint_row(m.host, m.vmid, "replica", server_endpoint(inv, m), m) for m in pb.members]


def _endpoint_row(host: str, vmid: int, role: str, ep: dict, member) -> dict:
    model, key = member.conf.serve.served_model_name, member.conf.serve.api_key_env
    return {"where": f"{host}/{vmid}", "host": host, "vmid": vmid, "role": role, **ep, "model": model,
            "api_key_env": key, "curl": curl_line(ep["url"], model, key) if ep.get("url") else None}


class Tunnel:
    """Local port forwarding over an open paramiko transport (the host's one SSH connection): every connection
    to 127.0.0.1:local_port becomes a `direct-tcpip` channel to remote=(address, port), opened by the host's sshd
    (what `ssh -L` does). start() binds (port 0: any free one) and serves in a thread; close() stops it."""

    def __init__(self, transport, remote: tuple[str, int], local_port: int = 0, bind: str = "127.0.0.1",
                 on_event=None):
        self.transport, self.remote, self.bind = transport, remote, bind
        self.local_port = local_port
        self.on_event = on_event or (lambda *_: None)
        self.connections = 0
        self.errors: list[str] = []
        self._sock = None
        self._stop = False

    def start(self) -> int:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.bind, self.local_port))
        s.listen(64)
        s.settimeout(0.5)  # the accept loop notices close() within that
        self._sock = s
        self.local_port = s.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="tunnel-accept", daemon=True).start()
        return self.local_port

    def _accept_loop(self):
        while not self._stop:
            try:
                client, peer = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client, peer), name="tunnel-conn", daemon=True).start()

    def _serve(self, client, peer):
        try:
            chan = self.transport.open_channel("direct-tcpip", self.remote, peer, timeout=15)
        except Exception as e:  # noqa: BLE001 - said, and the client sees its connection closed
            msg = f"the host could not connect to {self.remote[0]}:{self.remote[1]}: {e}"
            self.errors.append(msg)
            self.on_event("error", msg)
            client.close()
            return
        self.connections += 1
        self.on_event("open", peer)
        try:
            while not self._stop:
                r, _, _ = select.select([client, chan], [], [], 1.0)
                if client in r:
                    data = client.recv(65536)
                    if not data:
                        break
                    chan.sendall(data)
                if chan in r:
                    data = chan.recv(65536)
                    if not data:
                        break
                    client.sendall(data)
                if not self.transport.is_active():
                    break
        except OSError:
            pass
        finally:
            chan.close()
            client.close()

    def close(self):
        self._stop = True
        if self._sock is not None:
            self._sock.close()
