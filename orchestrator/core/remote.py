"""The one transport: one SSH connection per host per invocation, `pct exec` wrapping, quoting, timeouts, audit.

A host named by an `ssh_config_alias` is opened with Fabric, which resolves the alias from ~/.ssh/config
(HostName, Port, User, IdentityFile, ProxyJump...). A host given by address needs none of that and is opened
with paramiko's SSHClient directly: importing Fabric and Invoke costs ~55 ms, a sixth of `deploy status`.
paramiko itself is imported without Invoke where no alias needs it (`paramiko_module`), and its TCP connection is
started before that import (`_Dial`), so sshd accepts, forks and sends its banner while this process imports.
Either way host keys are checked with paramiko (RejectPolicy unless the inventory opts in to new keys). Commands run on a raw paramiko channel: bytes in, bytes out, stdout and stderr apart, no pty, a
deadline on every command. (Invoke's runner decodes to text and feeds stdin in small chunks with sleeps; a
deploy tool that pipes whole scripts and compares sha256 of bytes wants neither.)

Quoting happens in exactly one function, `shell_join`, applied once per shell layer.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import importlib
import importlib.util
import json
import os
import select
import shlex
import socket
import stat
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Iterable

from orchestrator.core.errors import DeployError, HostKeyError, OutputTooLarge, RemoteTimeout, Unreachable
from orchestrator.core.spec import HostSpec

CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def shell_join(argv: Iterable[str]) -> str:
    """The only quoting function: an argument list -> one string a POSIX shell splits back into that list."""
    return " ".join(shlex.quote(str(a)) for a in argv)


def shell_word(word) -> str:
    """One word of a command printed for a person to run (a fix line): quoted whatever it holds, so a name that came
    from a container (a unit, a playbook) cannot carry shell syntax into it (issue 36 item 8)."""
    return shell_join([word])


def pct_exec_argv(vmid: int, argv: list[str], keep_env: bool = True) -> list[str]:
    """The host-side argv that runs `argv` inside container `vmid` (one program after `--`, never a string)."""
    if keep_env:
        return ["pct", "exec", str(vmid), "--keep-env", "0", "--", *argv]
    # Old pct forwards our SSH environment into the container; give the program a clean one instead.
    return ["pct", "exec", str(vmid), "--", "env", "-i", f"PATH={CONTAINER_PATH}", "HOME=/root",
            "LANG=C.UTF-8", *argv]


@dataclass
class Result:
    host: str
    vmid: int | None
    argv: list[str]
    exited: int
    stdout: bytes
    stderr: bytes
    duration: float

    @property
    def ok(self) -> bool:
        return self.exited == 0

    @property
    def out(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", "replace")

    def where(self) -> str:
        return f"{self.host}/{self.vmid}" if self.vmid is not None else self.host


class Redactor:
    """Secrets registered here never reach the audit log, the plan or the terminal."""

    def __init__(self):
        self._secrets: set[str] = set()

    def add(self, secret: str | None) -> None:
        if secret and len(secret) >= 4:
            self._secrets.add(secret)

    def __call__(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return text


def state_dir() -> str:
    """The workstation's state directory (audit log, status samples): 0700, like ~/.ssh."""
    d = os.environ.get("DEPLOY_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "vllm-pve-deploy")
    os.makedirs(d, mode=0o700, exist_ok=True)
    try:  # the default directory from an older version (0755) is tightened; a directory the user named is not
        st = os.stat(d)
        if os.path.basename(d.rstrip("/")) == "vllm-pve-deploy" and st.st_uid == os.geteuid() and st.st_mode & 0o077:
            os.chmod(d, 0o700)
    except OSError:
        pass
    return d


class AuditLog:
    """JSON lines, 0600: time, host, vmid, argv (secrets redacted), exit status, duration. Per remote command one
    `starting` line before it runs (so a Ctrl-C or a kill leaves a trace) and one line with the exit status."""

    def __init__(self, path: str | None = None, redact: Redactor | None = None):
        self.path = path or os.path.join(state_dir(), "audit.jsonl")
        self.redact = redact or Redactor()
        self._lock = threading.Lock()
        self.invocation = f"{os.getpid()}-{int(time.time() * 1000)}"

    def write(self, **entry) -> None:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "invocation": self.invocation, **entry}
        for key in ("argv", "starting"):
            if key in entry:
                entry[key] = [self.redact(a) for a in entry[key]]
        for key in ("error", "message"):
            if isinstance(entry.get(key), str):
                entry[key] = self.redact(entry[key])
        line = json.dumps(entry, ensure_ascii=False)
        with self._lock:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    st = os.fstat(fd)
                    if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
                        os.fchmod(fd, 0o600)  # an audit log from an older version was 0644 (never a device)
                    os.write(fd, (line + "\n").encode("utf-8"))
                finally:
                    os.close(fd)
            except OSError:
                pass  # an unwritable audit log must not break a deployment


# Connection-level failures that are worth another try: nothing ran yet.
_RETRYABLE = (ConnectionRefusedError, ConnectionResetError, socket.timeout, TimeoutError, EOFError)


_PARAMIKO = None
_PARAMIKO_LOCK = threading.Lock()
# set when this process's first SSH connection is up: from then on it mostly waits on the network, and work it will
# need afterwards (status's imports, `warm_when_connected`) can run without delaying a handshake
CONNECTED = threading.Event()


def warm_when_connected(*modules, timeout: float = 30.0) -> None:
    """Import `modules` (names, or functions that import) in a daemon thread once the first connection is up
    (bounded wait): a command that will need them after a remote answer gets them while the remote side works."""
    def warm():
        if CONNECTED.wait(timeout):
            for m in modules:
                try:
                    m() if callable(m) else importlib.import_module(m)
                except Exception:  # noqa: BLE001 - only a warm-up: the real import reports any error
                    pass

    threading.Thread(target=warm, name="warm-imports", daemon=True).start()


def paramiko_module():
    """paramiko, imported (once) without Invoke unless something already loaded it: paramiko.config imports Invoke
    only to run ssh_config `Match exec` lines, which matter to Fabric's alias resolution alone, and Invoke costs
    ~40 ms (asyncio, unittest.mock) of every `deploy status`. `_with_invoke` gives paramiko.config its Invoke back
    when an alias host brings Fabric in."""
    global _PARAMIKO
    if _PARAMIKO is not None:
        return _PARAMIKO
    with _PARAMIKO_LOCK:
        if _PARAMIKO is None:
            block = "invoke" not in sys.modules
            if block:
                sys.modules["invoke"] = None  # `import invoke` in paramiko.config raises ImportError, as it handles
            shim = _VersionOnlyMetadata() if "importlib.metadata" not in sys.modules else None
            if shim is not None:
                sys.modules["importlib.metadata"] = shim
            try:
                import paramiko  # lazy: start-up time (~60 ms), and the dial starts first (see _Dial)
            finally:
                if block and "invoke" in sys.modules and sys.modules["invoke"] is None:
                    del sys.modules["invoke"]
                if shim is not None and sys.modules.get("importlib.metadata") is shim:
                    del sys.modules["importlib.metadata"]
            _PARAMIKO = paramiko
    return _PARAMIKO


class _VersionOnlyMetadata(types.ModuleType):
    """Stands in for `importlib.metadata` while paramiko is imported. paramiko/__init__ runs
    `metadata.version("paramiko")` for its __version__ and nothing else; the real module imports `email`,
    `zipfile`, `csv` and more (~20 ms of a quiet `deploy status`, ~40 ms under load; issue 54). version() reads the
    name of the package's installed .dist-info folder beside it (NAME-VERSION.dist-info, the wheel spec's layout)
    and hands anything else (another name, no such folder) to the real module, so a value is never made up."""

    def __init__(self):
        super().__init__("importlib.metadata")

    @staticmethod
    def version(name: str) -> str:
        try:
            spec = importlib.util.find_spec(name)
            folder = os.path.dirname(os.path.dirname(spec.origin)) if spec and spec.origin else None
            prefix = name.replace("-", "_").lower() + "-"
            found = [e for e in os.listdir(folder) if e.lower().startswith(prefix) and e.endswith(".dist-info")] \
                if folder else []
        except (ImportError, ValueError, OSError):
            found = []
        if len(found) == 1:
            return found[0][len(prefix):-len(".dist-info")]
        return _real_metadata().version(name)  # not one clear answer: ask the real thing

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(_real_metadata(), attr)  # anything else paramiko (or a plugin) asks for


def _real_metadata():
    """The real importlib.metadata (imported now if the stand-in is where it would be)."""
    if isinstance(sys.modules.get("importlib.metadata"), _VersionOnlyMetadata):
        del sys.modules["importlib.metadata"]
    return importlib.import_module("importlib.metadata")


def _with_invoke():
    """After `import fabric` (which imports Invoke): let paramiko.config run `Match exec` again."""
    pc = sys.modules.get("paramiko.config")
    if pc is not None and getattr(pc, "invoke", None) is None and sys.modules.get("invoke") is not None:
        pc.invoke, pc.invoke_import_error = sys.modules["invoke"], None


def _no_delay(conn) -> None:
    """TCP_NODELAY on the connection's socket. Without it every command pays a ~40 ms stall: our small SSH
    packets (the exec request, stdin's EOF) wait in Nagle's algorithm for the ACK of the one before, which sshd's
    side delays (delayed ACK). Measured on the test bed: `pct exec 129 -- true` 69 -> 21 ms, `sleep 0.02` 70 -> 27
    ms over a kept-open connection. (A ProxyJump connection rides a channel, not a socket: nothing to set.)"""
    sock = getattr(getattr(conn, "transport", None), "sock", None)
    if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


class _Dial:
    """A TCP connection to a host, started without waiting (non-blocking connect) so that the round trip and
    sshd's fork and banner overlap this process's import of paramiko. `take()` hands the connected socket to
    paramiko; where the dial failed at once (refused, no route, a name that does not resolve) it returns None and
    the caller connects as it always did, so every error reads as before. A dial that is not connected by the
    connect timeout raises socket.timeout, as paramiko's own connect would have."""

    def __init__(self, address: str, port: int, timeout: float):
        self.sock = None
        self.deadline = time.monotonic() + timeout
        try:
            try:  # an ASCII name as bytes: getaddrinfo then skips the idna codec (~1 ms to import)
                host = address.encode("ascii")
            except UnicodeEncodeError:
                host = address
            fam, typ, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            self.sock = socket.socket(fam, typ, proto)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the handshake too (_no_delay)
            self.sock.setblocking(False)
            err = self.sock.connect_ex(addr)
            if err not in (0, errno.EINPROGRESS):
                self._drop()
        except OSError:
            self._drop()

    def _drop(self):
        if self.sock is not None:
            self.sock.close()
        self.sock = None

    def take(self):
        if self.sock is None:
            return None
        try:
            _, ready, _ = select.select([], [self.sock], [], max(0.0, self.deadline - time.monotonic()))
            if not ready:
                self._drop()
                raise socket.timeout("timed out")
            if self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self._drop()
                return None
            self.sock.setblocking(True)
            sock, self.sock = self.sock, None
            return sock
        except (OSError, ValueError) as e:
            if isinstance(e, socket.timeout):
                raise
            self._drop()
            return None

    def close(self):
        self._drop()


@dataclass
class HostSession:
    """One SSH connection to one Proxmox host, opened on first use and reused for every command."""

    host: HostSpec
    audit: AuditLog
    connect_attempts: int = 3
    _conn: object = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    keep_env_supported: bool | None = field(default=None, init=False)
    connects: int = field(default=0, init=False)
    _spare: object = field(default=None, init=False, repr=False)
    _closed: bool = field(default=False, init=False, repr=False)
    _kept: dict = field(default_factory=dict, init=False, repr=False)
    last_connect_error: BaseException | None = field(default=None, init=False, repr=False)
    _ahead_error: BaseException | None = field(default=None, init=False, repr=False)

    # -------------------------------------------------------------- connection

    def _connection(self, sock=None):
        h = self.host
        kwargs = {"look_for_keys": h.identity_file is None, "allow_agent": h.identity_file is None}
        if h.identity_file:
            kwargs["key_filename"] = [h.identity_file]
        kwargs["banner_timeout"] = h.connect_timeout_s
        kwargs["auth_timeout"] = h.connect_timeout_s
        if h.ssh_config_alias:
            import fabric  # lazy: start-up time (~55 ms, with Invoke); only aliases need ssh_config resolution

            _with_invoke()
            conn = fabric.Connection(host=h.ssh_config_alias, connect_timeout=max(1, round(h.connect_timeout_s)),
                                     connect_kwargs=kwargs)
        else:
            conn = _DirectConnection(h.address, h.port, h.user, h.connect_timeout_s, kwargs, sock=sock)
        known = os.path.expanduser(h.known_hosts)
        # the final client, and every ProxyJump gateway on the way (Fabric gives those its AutoAddPolicy)
        c = conn
        while c is not None and hasattr(c, "client"):
            self._check_keys(c.client, known)
            c = getattr(c, "gateway", None)
        return conn

    def _check_keys(self, client, known: str) -> None:
        paramiko = paramiko_module()

        h = self.host
        if os.path.exists(known):
            client.load_host_keys(known)
        elif h.accept_new_host_keys:
            os.makedirs(os.path.dirname(known) or ".", mode=0o700, exist_ok=True)
            open(known, "a").close()
            client.load_host_keys(known)
        if h.accept_new_host_keys:
            client.set_missing_host_key_policy(_AcceptNew(known, self.audit, h.name))
        else:
            client.set_missing_host_key_policy(paramiko.RejectPolicy())

    def connect(self, ahead: bool = False):
        """The connection, opened on first use. ahead=True (Fleet.connect_ahead, in a thread of its own): an error
        is kept for the next connect() to raise (once, as if it met it itself: no second round of attempts), and
        the first command's session channel is opened too (its open waits on sshd setting up the session)."""
        with self._lock:
            if self._ahead_error is not None:
                e, self._ahead_error = self._ahead_error, None
                raise e
            if self._conn is not None and self._conn.is_connected:
                return self._conn
            self._closed = False
            try:
                self._conn = self._open_with_retries()
                _no_delay(self._conn)
                CONNECTED.set()
                if self._closed:  # closed by the caller while connecting (its deadline passed)
                    conn, self._conn = self._conn, None
                    conn.close()
                    raise Unreachable("connection closed: the caller's deadline passed while connecting",
                                      where=self.host.name)
            except BaseException as e:
                if not ahead:
                    raise
                self._ahead_error = e
                return None
            if ahead:
                try:
                    self._spare = self._conn.transport.open_session(timeout=10)
                except Exception:  # noqa: BLE001 - a spare is an optimisation only (see open_spare)
                    pass
            return self._conn

    def _open_with_retries(self):
        h = self.host
        started = time.monotonic()
        dial = None if h.ssh_config_alias else _Dial(h.address, h.port, h.connect_timeout_s)
        try:
            return self._open_dialled(dial, started)
        finally:
            if dial is not None:
                dial.close()  # a no-op once taken

    def _open_dialled(self, dial, started):
        paramiko = paramiko_module()
        h = self.host
        retryable = _RETRYABLE + (paramiko.ssh_exception.NoValidConnectionsError,)

        def attempt():
            nonlocal dial, first_error
            if first_error is not None:  # the first attempt, made before tenacity was imported
                e, first_error = first_error, None
                raise e
            first, dial = dial, None  # only the first attempt uses the early dial
            try:
                sock = first.take() if first is not None else None
            except OSError as e:
                self.last_connect_error = e
                raise
            try:
                conn = self._connection(sock=sock)
            except BaseException:
                if sock is not None:
                    sock.close()
                raise
            try:
                conn.open()
            except Exception as e:  # noqa: BLE001 - remembered for a caller whose deadline ends the retries
                self.last_connect_error = e
                raise
            self.last_connect_error = None
            return conn

        where = f"{h.name} ({h.user}@{h.ssh_config_alias or h.address}:{h.port})"
        first_error = None
        try:
            try:
                conn = attempt()
            except retryable as e:
                # lazy: tenacity (~25 ms with concurrent.futures) only once a first attempt failed; it replays that
                # failure as its own attempt 1, so the policy (attempts, backoff, overall bound) is unchanged
                from tenacity import retry, retry_if_exception_type, stop_after_attempt, stop_after_delay, wait_exponential

                first_error = e
                conn = retry(retry=retry_if_exception_type(retryable), reraise=True,
                             stop=stop_after_attempt(self.connect_attempts) | stop_after_delay(
                                 h.connect_timeout_s * 2 - (time.monotonic() - started)),
                             wait=wait_exponential(multiplier=0.2, max=2))(attempt)()
        except paramiko.BadHostKeyException as e:
            raise HostKeyError(
                f"host key CHANGED: known_hosts has {e.expected_key.get_name()} {sha256_fingerprint(e.expected_key)}, "
                f"the server sent {e.key.get_name()} {sha256_fingerprint(e.key)}",
                where=where, fix=f"if the host was reinstalled, remove the old key: ssh-keygen -f "
                                 f"{h.known_hosts} -R '{_known_hosts_name(h)}'; otherwise do not connect") from e
        except paramiko.AuthenticationException as e:
            raise Unreachable(f"authentication failed: {e}", where=where,
                              fix="check identity_file in the inventory and the host's authorized_keys") from e
        except paramiko.SSHException as e:
            msg = str(e)
            if "not found in known_hosts" in msg:
                raise HostKeyError(f"unknown host key ({msg})", where=where,
                                   fix=f"add the host's key to {h.known_hosts} (ssh-keyscan -p {h.port} "
                                       f"{h.address or h.ssh_config_alias}, then compare its fingerprint), or set "
                                       "accept_new_host_keys: true for this host") from e
            if "private key" in msg or "key file" in msg or "not a valid" in msg:
                raise Unreachable(f"the key file {h.identity_file} cannot be used: {msg}", where=where,
                                  fix=f"point identity_file at a real private key, or make one: ssh-keygen -t ed25519 "
                                      f"-f {h.identity_file} (and add its .pub to the host's authorized_keys)") from e
            if "banner" in msg.lower() or "timed out" in msg.lower() or "timeout" in msg.lower():
                err = Unreachable(f"no SSH answer within {h.connect_timeout_s:g} s ({msg})", where=where,
                                  fix=f"the host is slow or overloaded: raise connect_timeout_s for {h.name} in the "
                                      "inventory, or check it directly")
                err.timed_out = True
                raise err from e
            raise Unreachable(f"SSH error: {msg}", where=where,
                              fix=f"check that sshd runs on the host: ssh -p {h.port} {h.user}@"
                                  f"{h.address or h.ssh_config_alias} true") from e
        except (OSError, EOFError) as e:
            reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
            if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)) and h.identity_file:
                raise Unreachable(f"cannot read the key file {h.identity_file}: {reason}", where=where,
                                  fix=f"correct identity_file in the inventory, or make the key: ssh-keygen -t ed25519 "
                                      f"-f {h.identity_file}") from e
            if isinstance(e, (socket.timeout, TimeoutError)):
                err = Unreachable(f"no answer to the connection within {h.connect_timeout_s:g} s ({reason})",
                                  where=where, fix=f"a slow or overloaded host: raise connect_timeout_s for {h.name} in "
                                                   "the inventory; an unroutable one: check the address")
                err.timed_out = True
                raise err from e
            raise Unreachable(f"cannot connect: {reason}", where=where,
                              fix="check the address/port in the inventory and that the host is up") from e
        self.connects += 1
        self.audit.write(host=h.name, event="connect", duration=round(time.monotonic() - started, 4))
        return conn

    def open_spare(self) -> None:
        """Open a session channel now, for the next command to use (`deploy status --watch` calls this
        between refreshes, so a refresh skips the channel-open round trip). Best effort: on any failure the
        next command opens its own channel, as without a spare. Opening a channel runs nothing remotely."""
        conn = self._conn
        if conn is None or self._spare is not None or not conn.is_connected:
            return
        try:
            chan = conn.transport.open_session(timeout=10)
        except Exception:  # noqa: BLE001 - a spare is an optimisation only
            return
        with self._lock:
            if self._spare is None and self._conn is conn:
                self._spare, chan = chan, None
        if chan is not None:
            chan.close()

    def _take_spare(self):
        with self._lock:
            chan, self._spare = self._spare, None
            transport = self._conn.transport if self._conn is not None else None
        if chan is None:
            return None
        if chan.closed or not chan.active or chan.transport is not transport:
            chan.close()
            return None
        return chan

    def close(self) -> None:
        # A connect still in progress (a slow or dead host past its deadline) holds the lock: do not wait for it.
        # The connecting thread sees `_closed` when it is done and closes what it opened.
        self._closed = True
        for a in list(getattr(self, "_kept", {}).values()):
            a.close()
        if not self._lock.acquire(timeout=0.5):
            return
        try:
            self._spare = None
            if self._conn is not None:
                try:
                    self._conn.close()
                except Exception:
                    pass
                self._conn = None
        finally:
            self._lock.release()

    # -------------------------------------------------------------- commands

    def _where(self, vmid: int | None) -> str:
        return self.host.name + (f"/{vmid}" if vmid is not None else "")

    def _lost(self, when: str, e: BaseException) -> Unreachable:
        """The connection broke mid-command: closed here (the next command reconnects); what to raise."""
        self.close()
        return Unreachable(f"SSH connection lost {when}: {e or type(e).__name__}", where=self.host.name,
                           fix="check the host; run `deploy status` to see what state was left")

    def run(self, argv: list[str], *, stdin: bytes | str | None = None, timeout: float = 60.0,
            vmid: int | None = None, label: str | None = None, audit_argv: list[str] | None = None,
            on_line=None, max_output: int | None = None) -> Result:
        """Run argv on the host (quoted once for the login shell). Returns the exit status as is."""
        if isinstance(stdin, str):
            stdin = stdin.encode("utf-8")
        command = shell_join(argv)
        conn = self.connect()
        started = time.monotonic()
        self.audit.write(host=self.host.name, vmid=vmid, starting=audit_argv or argv, label=label)
        try:
            exited, out, err = _exec(conn.transport, command, stdin, timeout, on_line, spare=self._take_spare,
                                     max_bytes=max_output)
        except RemoteTimeout as e:
            e.message = self.audit.redact(e.message)
            e.args = (e.message,)
            self.audit.write(host=self.host.name, vmid=vmid, argv=audit_argv or argv, exit=None,
                             duration=round(time.monotonic() - started, 4), error=e.message[:300], label=label)
            e.where = self._where(vmid)
            raise
        except OutputTooLarge as e:
            self.audit.write(host=self.host.name, vmid=vmid, argv=audit_argv or argv, exit=None,
                             duration=round(time.monotonic() - started, 4), error=e.message, label=label)
            e.where = self._where(vmid)
            raise
        except (OSError, EOFError, _ssh_exception()) as e:
            raise self._lost("during a command", e) from e
        dur = time.monotonic() - started
        self.audit.write(host=self.host.name, vmid=vmid, argv=audit_argv or argv, exit=exited,
                         duration=round(dur, 4), label=label,
                         **({"stdin_bytes": len(stdin)} if stdin else {}))
        return Result(self.host.name, vmid, argv, exited, out, err, dur)

    def open_exec(self, argv: list[str], *, vmid: int | None = None, audit_argv: list[str] | None = None,
                  label: str | None = None, stdin_bytes: int | None = None, timeout: float = 60.0):
        """Start argv on the host on a channel of its own and hand the channel over (agent sessions: one process
        for many requests, each written to the audit log by its user)."""
        conn = self.connect()
        self.audit.write(host=self.host.name, vmid=vmid, starting=audit_argv or argv, label=label)
        try:
            chan = conn.transport.open_session(timeout=min(timeout, 30))
            chan.settimeout(None)
            chan.exec_command(shell_join(argv))
        except (OSError, EOFError, _ssh_exception()) as e:
            raise self._lost("while starting a command", e) from e
        self.audit.write(host=self.host.name, vmid=vmid, argv=audit_argv or argv, exit="started", label=label,
                         **({"stdin_bytes": stdin_bytes} if stdin_bytes else {}))
        return chan

    def alive(self) -> bool:
        conn = self._conn
        transport = getattr(conn, "transport", None) if conn is not None else None
        return bool(transport is not None and transport.is_active())

    def keep(self, key, make):
        """What a layer above keeps open on this connection for the invocation (an agent session per container):
        made by make() on first use, closed (its .close()) with the connection."""
        with self._lock:
            obj = self._kept.get(key)
            if obj is None:
                obj = self._kept[key] = make()
        return obj

    def ct(self, vmid: int, argv: list[str], **kw) -> Result:
        """Run argv inside container vmid with `pct exec`; probes once whether this pct knows --keep-env."""
        keep = self.keep_env_supported is not False
        audit_argv = kw.pop("audit_argv", None) or argv  # what the audit log shows (an abbreviated program)
        res = self.run(pct_exec_argv(vmid, argv, keep), vmid=vmid, audit_argv=audit_argv, **kw)
        if keep and self.keep_env_supported is None:
            if res.exited == 255 and b"Unknown option: keep-env" in res.stderr:
                # pct rejected the option while parsing, so the command did not run: safe to send again.
                self.keep_env_supported = False
                return self.run(pct_exec_argv(vmid, argv, False), vmid=vmid, audit_argv=audit_argv, **kw)
            if b"unable to parse option" not in res.stderr:
                self.keep_env_supported = True
        return res


def _known_hosts_name(h) -> str:
    host = h.address or h.ssh_config_alias
    return host if h.port == 22 else f"[{host}]:{h.port}"


def _ssh_exception():
    return paramiko_module().SSHException


MAX_OUTPUT = 64 << 20  # bytes of stdout of one remote command; far above any agent result
MAX_ERR = 1 << 20  # bytes of its stderr: only read for an error message (as an agent session's; issue 36, Low)


def _exec(transport, command: str, stdin: bytes | None, timeout: float, on_line=None,
          spare=None, max_bytes: int | None = None) -> tuple[int, bytes, bytes]:
    """Run one command on a new channel of the shared transport. on_line(bytes) sees each stdout line as it
    arrives (progress of long waits); a line it returns False for is not kept (so `logs -f` holds only the line
    in progress). The rest of stdout is returned, capped at max_bytes per stream; the deadline is checked while
    data keeps arriving. spare() may hand over a session channel opened ahead of time (--watch), saving the
    channel-open round trip. (Sending the exec request without waiting for its reply saves nothing against
    OpenSSH: sshd opens a session channel with a zero window and grants it only once the exec is running, so stdin
    waits that round trip anyway; measured.)"""
    cap = max_bytes or MAX_OUTPUT
    err_cap = min(cap, MAX_ERR)
    deadline = time.monotonic() + timeout
    chan = (spare or (lambda: None))() or transport.open_session(timeout=min(timeout, 30))

    def check(out, err):
        if len(out) > cap or len(err) > err_cap:
            raise OutputTooLarge(f"the command wrote more than {cap if len(out) > cap else err_cap} bytes to "
                                 f"{'stdout' if len(out) > cap else 'stderr'}; stopped reading: {command[:120]}",
                                 fix="the remote side misbehaves (a runaway log?); check it directly")
        if time.monotonic() > deadline:
            raise RemoteTimeout(f"command did not finish within {timeout:g} s: {command[:200]}",
                                fix="the remote side may be hung (e.g. a wedged nvidia-smi); check the host")

    try:
        chan.settimeout(max(0.1, timeout))
        chan.exec_command(command)
        if stdin:
            chan.sendall(stdin)
        chan.shutdown_write()
        out, err = bytearray(), bytearray()
        line = bytearray()  # the stdout line in progress, for on_line
        # sshd sends all stream data before the exit status, so once the status is here the buffers are complete.
        while True:
            while chan.recv_ready():
                chunk = chan.recv(65536)
                if on_line is not None:
                    line += chunk
                    if b"\n" in chunk:  # split only when a line ended: linear in the bytes received
                        *done, rest = bytes(line).split(b"\n")
                        line = bytearray(rest)
                        for ln in done:
                            if on_line(ln) is not False:
                                out += ln + b"\n"
                    check(line, err)
                else:
                    out += chunk
                check(out, err)
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
                check(out, err)
            if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                break
            if chan.closed:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                check(out, err)
            if chan.eof_received:
                # no more data after EOF, but the channel's event pipe stays set, so select would return at once
                # until the exit status came (a busy loop on the workstation's CPU, ~300 turns per status row on
                # the test bed; issue 54): wait for the status (or the close, which sets it too) instead
                chan.status_event.wait(min(max(remaining, 0.01), 1.0))
            else:
                select.select([chan], [], [], min(max(remaining, 0.01), 1.0))
        out += line
        status = chan.recv_exit_status() if chan.exit_status_ready() else -1
        if status == -1 and not transport.is_active():
            raise EOFError("the SSH connection closed before the command finished")
        return status, bytes(out), bytes(err)
    finally:
        chan.close()


class _DirectConnection:
    """The part of fabric.Connection this module uses, on paramiko's SSHClient (see the module docstring)."""

    def __init__(self, address: str, port: int, user: str, timeout: float, connect_kwargs: dict, sock=None):
        self.client = paramiko_module().SSHClient()
        self.transport = None
        self._args = dict(connect_kwargs, hostname=address, port=port, username=user, timeout=timeout)
        if sock is not None:
            self._args["sock"] = sock  # connected already (_Dial)

    def open(self):
        self.client.connect(**self._args)
        self.transport = self.client.get_transport()

    @property
    def is_connected(self) -> bool:
        return self.transport is not None and self.transport.is_active()

    def close(self):
        self.client.close()


def sha256_fingerprint(key) -> str:
    """SHA256:... as OpenSSH prints it (ssh-keygen -lf), not paramiko's MD5 hex."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


class _AcceptNew:
    """Like OpenSSH's StrictHostKeyChecking=accept-new: record a new key (and audit it), refuse a changed one."""

    def __init__(self, path: str, audit: "AuditLog | None" = None, host: str = ""):
        self.path, self.audit, self.host = path, audit, host

    def missing_host_key(self, client, hostname, key):
        client.get_host_keys().add(hostname, key.get_name(), key)
        with open(self.path, "a") as fh:
            fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        if self.audit is not None:
            self.audit.write(host=self.host, event="host key accepted", hostname=hostname, key_type=key.get_name(),
                             fingerprint=sha256_fingerprint(key), known_hosts=self.path)


class Fleet:
    """The sessions of one `deploy` invocation: at most one connection per host, closed at the end."""

    def __init__(self, inventory, audit: AuditLog | None = None, redact: Redactor | None = None):
        self.inventory = inventory
        self.redact = redact or Redactor()
        self.audit = audit or AuditLog(redact=self.redact)
        self._sessions: dict[str, HostSession] = {}
        self._lock = threading.Lock()

    def session(self, host_name: str) -> HostSession:
        with self._lock:
            if host_name not in self._sessions:
                self._sessions[host_name] = HostSession(self.inventory.host(host_name), self.audit)
            return self._sessions[host_name]

    def connect_ahead(self, hosts) -> None:
        """Start connecting to these hosts now, each in a daemon thread (HostSession.connect(ahead=True)): what
        the caller does meanwhile (imports, reading files) overlaps the handshakes instead of preceding them."""
        for h in hosts:
            threading.Thread(target=self.session(h).connect, kwargs={"ahead": True}, daemon=True).start()

    def open_spares(self) -> None:
        """In the background, open one spare session channel per connected host (see HostSession.open_spare)."""
        with self._lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            threading.Thread(target=s.open_spare, daemon=True).start()

    def close(self) -> None:
        for s in self._sessions.values():
            s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_parallel(items, fn, *, deadline_s: float):
    """Run fn(item) for every item in threads; return [(item, value, error)] in order, each bounded by deadline_s.

    An item whose call has not finished by the deadline gets a RemoteTimeout; its thread is left to end on its
    own (it holds only its own channel), so one bad host never delays the others' rows.
    """
    results: list = [None] * len(items)
    done = [threading.Event() for _ in items]

    def work(i, item):
        try:
            results[i] = (item, fn(item), None)
        except BaseException as e:  # noqa: BLE001 - every failure becomes that item's row
            results[i] = (item, None, e)
        finally:
            done[i].set()

    threads = [threading.Thread(target=work, args=(i, it), daemon=True) for i, it in enumerate(items)]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline_s
    for i, ev in enumerate(done):
        if not ev.wait(max(0.0, end - time.monotonic())):
            results[i] = (items[i], None, RemoteTimeout(f"no answer within {deadline_s:g} s",
                                                        fix="the host is slow or hung: give it more time "
                                                            f"(--deadline {max(2 * deadline_s, 30):g}) or check it "
                                                            "directly"))
    return results


__all__ = ["shell_join", "pct_exec_argv", "Result", "HostSession", "Fleet", "AuditLog", "Redactor",
           "run_parallel", "DeployError"]
