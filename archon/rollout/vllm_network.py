"""The network between the trainer and its vLLM servers: ports (a free one; one already in use),
hosts (loopback ones, this machine's), this machine's address towards a server, one probe of a
server's health, and the threads that requests to servers run on."""

from __future__ import annotations

import concurrent.futures
import errno
import http.client
import ipaddress
import random
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path


class VLLMServerError(RuntimeError):
    """A vLLM server cannot be launched, reached or used."""


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIRST_CHOSEN_PORT = 10000
"""free_port chooses among ports from here up to the kernel's ephemeral range."""


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands out for bind(port 0) and outgoing connections (Linux's setting;
    elsewhere the IANA range, which macOS and Windows use)."""
    try:
        low, high = (int(part) for part in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 49152, 65535
    return low, high


def bind_error(host: str, port: int) -> OSError | None:
    """What binding `port` on `host` as a server does (with SO_REUSEADDR, so a port whose earlier
    connections linger in TIME_WAIT, a minute after a server stops, counts as free) raises; None
    when it binds."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def free_port(host: str) -> int:
    """A port on `host` that nothing is bound to, for a process started next to listen on.

    It is chosen at random below the kernel's ephemeral range. A port the kernel handed out (bind
    to port 0) returns to that range when the probe closes, and any process's next outgoing
    connection or bind(0) may take it in the seconds before the new process binds it (a vLLM
    server binds its port a few seconds after its start); a port below the range is never handed
    out that way."""
    low, _ = ephemeral_port_range()
    if low > FIRST_CHOSEN_PORT + 1000:
        chooser = random.SystemRandom()
        for _ in range(100):
            port = chooser.randrange(FIRST_CHOSEN_PORT, low)
            if bind_error(host, port) is None:
                return port
    with socket.socket() as s:  # no room below the range, or all taken: one the kernel picks
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Refuse to launch on a port something already listens on: the new server would fail to bind,
    and its health checks would reach the other process instead."""
    error = bind_error(host, port)
    if error is None or error.errno != errno.EADDRINUSE:  # e.g. an address of another machine: vLLM reports it
        return
    raise VLLMServerError(
        f"cannot launch a vLLM server on {host}:{port}: the port is in use ({error.strerror}), perhaps by a "
        f"server of an earlier run; stop that process or set rollout.vllm.port"
    )


def is_loopback_host(host: str) -> bool:
    """True when `host` (an address or a name) resolves to loopback addresses only."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def is_local_address(host: str) -> bool:
    """True when `host` (an address or a name) is an address of this machine: a socket binds to it."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, _, _, address in infos:
        with socket.socket(family, kind) as s:
            try:
                s.bind((address[0], 0, *address[2:]))
            except OSError:
                continue
            return True
    return False


def address_towards(url: str) -> str:
    """This machine's address on its route to the server at `url`: the address that server sees its
    connections come from, so one it can connect back to."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        family, _, _, _, address = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(address)  # a datagram socket's connect sends nothing: it only picks the route
            return s.getsockname()[0]
    except OSError as e:
        raise VLLMServerError(
            f"cannot tell this machine's address towards vLLM server {url} ({e.strerror or e}); set "
            "rollout.vllm.sync_host to the address of trainer rank 0's machine that the servers reach"
        ) from None


def probe_health(url: str, timeout: float) -> tuple[str, str]:
    """One GET of `url`/health: (state, what was seen). States: "healthy" (HTTP 200); "refused"
    (nothing listens on the port: a launched server that is still loading, else a wrong URL or a
    server that is not started); "starting" (HTTP 503, which vLLM's servers answer while they
    load); "silent" (the connection was accepted but no answer came within `timeout`: a stopped or
    hung process); "wrong" (what a vLLM server never does: a host name that does not resolve, an
    answer that is not HTTP, another HTTP status)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            if response.status == 200:
                return "healthy", "HTTP 200"
            return "wrong", f"it answered GET /health with HTTP {response.status} (a vLLM server answers 200)"
    except urllib.error.HTTPError as e:
        if e.code == 503:
            return "starting", "it answers GET /health with HTTP 503 (not ready)"
        return "wrong", f"it answered GET /health with HTTP {e.code} {e.reason} (a vLLM server answers 200)"
    except http.client.HTTPException as e:  # before OSError: a connection closed without an answer is both
        answer = f"{type(e).__name__}: {str(e).strip()[:200]}"
        return "wrong", f"it answered GET /health with something that is not HTTP ({answer})"
    except urllib.error.URLError as e:
        if isinstance(e.reason, ConnectionRefusedError):
            return "refused", "the connection was refused: nothing listens on that port"
        if isinstance(e.reason, socket.gaierror):
            return "wrong", f"its host name does not resolve ({e.reason.strerror})"
        if isinstance(e.reason, TimeoutError):
            return "silent", f"no connection within {timeout:g} s"
        return "wrong", f"it cannot be reached ({e.reason})"
    except TimeoutError:
        return "silent", f"it accepted the connection but did not answer GET /health within {timeout:g} s"
    except OSError as e:
        return "wrong", f"the connection failed ({e})"
    except ValueError as e:  # not a URL urllib can open
        return "wrong", str(e)


class RequestThreads:
    """Runs calls (requests to servers) each on a daemon thread of its own, returning futures.

    The interpreter joins a ThreadPoolExecutor's threads at exit, so a request stuck on a server
    that stopped answering would keep the trainer from exiting until the request's timeout. These
    threads are never joined, and close() fails the calls still running, so that whoever waits on
    them goes on at once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._running: set[concurrent.futures.Future] = set()
        self._closed = False

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise VLLMServerError(f"{self.name}: the vLLM client is closed")
            self._running.add(future)
        threading.Thread(target=self._run, args=(future, fn, args), name=self.name, daemon=True).start()
        return future

    def _run(self, future: concurrent.futures.Future, fn, args: tuple) -> None:
        if not future.set_running_or_notify_cancel():  # cancelled before it started
            with self._lock:
                self._running.discard(future)
            return
        try:
            result, error = fn(*args), None
        except BaseException as e:  # handed to the waiter
            result, error = None, e
        with self._lock:
            self._running.discard(future)
            if future.done():  # failed by close()
                return
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def close(self) -> None:
        """Accept no more calls; the calls still running fail now (their threads end with their
        requests' timeouts)."""
        with self._lock:
            self._closed = True
            for future in self._running:
                if not future.cancel():  # running already
                    why = f"{self.name}: the vLLM client was closed while a request was in flight"
                    future.set_exception(VLLMServerError(why))
            self._running.clear()
