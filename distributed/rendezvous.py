"""Where the ranks of a job meet, checked before torch.distributed starts: it works, or the
job ends within seconds with one `error:` line saying which variable to set.

Left to itself, init_process_group(init_method="tcp://host:port") gives a user neither: a
MASTER_ADDR that does not resolve, or a port nobody listens on, makes torch's store client
retry for the whole timeout and then once more (9.5 minutes for a 300 s timeout), printing
dozens of warnings and C++ stack traces on the way. So the ranks meet here first, with
plain sockets and bounded waits, and torch's store is opened only once it is known to be
there (`join`):

  1. every rank resolves MASTER_ADDR, bounded by RESOLVE_TIMEOUT_SEC (a DNS server that does
     not answer would otherwise block for as long as the resolver's retries last);
  2. rank 0 listens on MASTER_PORT itself (a port in use is named at once), checks that
     MASTER_ADDR leads back to its own host (a name of another node would leave every rank
     waiting for nobody), and starts the store on that socket;
  3. the other ranks connect with plain sockets until the store answers, at most
     DIST_CONNECT_TIMEOUT_SEC, then open the store's client, which connects at once;
  4. rank 0 waits, with the same bound, until every rank has arrived, then releases them.

The store then gets the collective timeout (DIST_TIMEOUT_SEC) and becomes the process
group's (init_process_group(store=...)). The two timeouts differ on purpose: the connect
timeout only has to cover the ranks starting at different moments (each imports torch:
seconds, tens of seconds on a cold parallel file system), while a collective may
legitimately wait for a slow peer much longer (a checkpoint, a long validation).

Only rank 0 reports a failed rendezvous: every failure reaches it (an unresolvable name
fails there too; a rank that cannot connect never arrives, and rank 0 names it). The other
ranks stay silent for as long as rank 0 may still be waiting (`UserError.defer`): when it
exits, the launcher (srun, mpirun) ends them. One still running after that reports the
failure itself (rank 0 may never have started). Under torchrun, whose agent hosts
the store before any rank starts (TORCHELASTIC_USE_AGENT_STORE), torch's env:// rendezvous
is used as it is.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from distributed.launch_env import LaunchEnv
from utils.errors import LaunchError

RESOLVE_TIMEOUT_SEC = 10.0  # an answer takes milliseconds; a dead DNS server, 5 s per try
CONNECT_TIMEOUT_SEC = 60.0  # default DIST_CONNECT_TIMEOUT_SEC: ranks start this far apart
COLLECTIVE_TIMEOUT_SEC = 300.0  # default DIST_TIMEOUT_SEC
SELF_CHECK_SEC = 5.0  # rank 0: a connection to its own host takes milliseconds
RELEASE_GRACE_SEC = 1.0  # rank 0 keeps the store up this long after saying "fail"
DEFER_MARGIN_SEC = 5.0  # a silent rank outwaits rank 0's own wait by this much
ARRIVED, RESULT = "rendezvous/arrived", "rendezvous/result"


class RendezvousError(LaunchError):
    """The ranks cannot meet at MASTER_ADDR:MASTER_PORT. Rank 0's line is the job's line."""


@dataclass(frozen=True)
class Timeouts:
    connect: float     # seconds to reach the rendezvous (DIST_CONNECT_TIMEOUT_SEC)
    collective: float  # seconds a collective may wait for a peer (DIST_TIMEOUT_SEC)


def _seconds(environ: Mapping[str, str], key: str, default: float) -> float:
    text = environ.get(key, "")
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise LaunchError(f"{key}={text!r} is not a number of seconds > 0", every_rank=True)
    return value


def timeouts(environ: Mapping[str, str] | None = None) -> Timeouts:
    """The connect and collective timeouts from the environment (or their defaults)."""
    env = os.environ if environ is None else environ
    return Timeouts(_seconds(env, "DIST_CONNECT_TIMEOUT_SEC", CONNECT_TIMEOUT_SEC),
                    _seconds(env, "DIST_TIMEOUT_SEC", COLLECTIVE_TIMEOUT_SEC))


def what_to_set(environ: Mapping[str, str] | None = None) -> str:
    """The variable a user sets to choose the rendezvous address, for this launcher."""
    env = os.environ if environ is None else environ
    if "SLURM_JOB_ID" in env:
        return ("set DDP_MASTER_ADDR to an address of the job's first node that every node "
                "can reach (or SITE_MASTER_IFACE to its network interface in the site preset)")
    if "OMPI_COMM_WORLD_RANK" in env and "RANK" not in env:
        return "pass the first node's address with mpirun -x MASTER_ADDR=<address>"
    return "set MASTER_ADDR to an address of rank 0's node that every node can reach"


def resolve(host: str, port: int, timeout: float = RESOLVE_TIMEOUT_SEC) -> list[str]:
    """The numeric addresses of `host` (IPv4/IPv6, the resolver's order), or a one-line
    RendezvousError within `timeout` seconds. The lookup runs in a daemon thread: a resolver
    that hangs is abandoned, not waited for."""
    found: dict[str, object] = {}

    def lookup() -> None:
        try:
            found["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            found["error"] = e

    worker = threading.Thread(target=lookup, name="resolve-master-addr", daemon=True)
    worker.start()
    worker.join(timeout)
    where = f"MASTER_ADDR={host} (port {port})"
    if worker.is_alive():
        raise RendezvousError(f"{where} did not resolve within {timeout:g} s (no answer from "
                              "the name service)")
    if "error" in found:
        error = found["error"]
        reason = getattr(error, "strerror", None) or str(error)
        raise RendezvousError(f"{where} does not resolve ({reason})")
    addresses = [info[4][0] for info in found["infos"]  # type: ignore[union-attr]
                 if info[0] in (socket.AF_INET, socket.AF_INET6)]
    if not addresses:
        raise RendezvousError(f"{where} has no IPv4 or IPv6 address")
    return list(dict.fromkeys(addresses))


def _listener(port: int) -> socket.socket:
    """A listening TCP socket on `port` of every local address (IPv6 and IPv4 where the
    host has IPv6, IPv4 otherwise)."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        any_address = "::"
    except OSError:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        any_address = "0.0.0.0"
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server
        sock.bind((any_address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def _leads_here(address: str, timeout: float = SELF_CHECK_SEC) -> bool:
    """Whether a connection to `address` arrives at this process: a token sent through a
    listening socket on a port only this process knows comes back."""
    token = os.urandom(16)
    try:
        with _listener(0) as listener:
            listener.settimeout(timeout)
            port = listener.getsockname()[1]
            with socket.create_connection((address, port), timeout=timeout) as probe:
                probe.sendall(token)
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(timeout)
                    return conn.recv(len(token)) == token
    except OSError:
        return False


def _connect(addresses: list[str], port: int, deadline: float) -> str | None:
    """The first address where something accepts a connection on `port`, retried until
    `deadline` (rank 0 may still be starting); None if none did."""
    delay = 0.05
    while True:
        for address in addresses:
            left = deadline - time.monotonic()
            try:
                with socket.create_connection((address, port), timeout=max(0.1, min(2.0, left))):
                    return address
            except OSError:
                pass
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(delay, left))
        delay = min(2 * delay, 1.0)


def _missing_ranks(store: dist.Store, world_size: int, limit: int = 8) -> str:
    missing = [r for r in range(1, world_size) if not store.check([f"{ARRIVED}/{r}"])]
    shown = ", ".join(str(r) for r in missing[:limit])
    return shown + (f" and {len(missing) - limit} more" if len(missing) > limit else "")


def _host_store(env: LaunchEnv, addresses: list[str], connect: float,
                hint: str) -> dist.Store:
    """Rank 0: listen on MASTER_PORT, check MASTER_ADDR leads here, host the store, and wait
    until every other rank has arrived."""
    where = f"{env.master_addr}:{env.master_port}"
    here = socket.gethostname()
    try:
        listener = _listener(env.master_port)
    except OSError as e:
        raise RendezvousError(f"rank 0 cannot listen on MASTER_PORT={env.master_port} on "
                              f"{here} ({e.strerror}): set MASTER_PORT to a free port") from None
    mine = next((a for a in addresses if _leads_here(a)), None)
    if mine is None:
        listener.close()
        raise RendezvousError(
            f"MASTER_ADDR={env.master_addr} ({', '.join(addresses)}) is not the host of rank 0 "
            f"({here}): the ranks would wait at {where} for nobody; {hint}")
    store = dist.TCPStore(mine, env.master_port, env.world_size, is_master=True,
                          timeout=timedelta(seconds=connect), wait_for_workers=False,
                          master_listen_fd=listener.detach())
    deadline = time.monotonic() + connect
    while int(store.add(ARRIVED, 0)) < env.world_size - 1:
        if time.monotonic() > deadline:
            missing = _missing_ranks(store, env.world_size)
            store.set(RESULT, "fail")
            time.sleep(RELEASE_GRACE_SEC)  # the ranks that arrived read "fail", then it closes
            loopback = " (a loopback address, which ranks on other nodes cannot reach)" \
                if mine.startswith("127.") or mine == "::1" else ""
            raise RendezvousError(
                f"ranks {missing} did not reach MASTER_ADDR={where}{loopback} within "
                f"{connect:g} s (DIST_CONNECT_TIMEOUT_SEC): {hint}; raise "
                "DIST_CONNECT_TIMEOUT_SEC if ranks start slowly")
        time.sleep(0.05)
    store.set(RESULT, "ok")
    return store


def _join_store(env: LaunchEnv, addresses: list[str], connect: float, started: float,
                hint: str) -> dist.Store:
    """Any rank but 0: connect to rank 0's store, say so, and wait until rank 0 releases
    the ranks."""
    where = f"MASTER_ADDR={env.master_addr}:{env.master_port}"
    address = _connect(addresses, env.master_port, started + connect)
    if address is None:
        raise RendezvousError(f"nothing listens at {where} after {connect:g} s "
                              f"(DIST_CONNECT_TIMEOUT_SEC): {hint}")
    # The server answered a moment ago, so the client connects at once; the timeout covers
    # rank 0's wait for the last rank to arrive.
    store = dist.TCPStore(address, env.master_port, env.world_size, is_master=False,
                          timeout=timedelta(seconds=connect + DEFER_MARGIN_SEC))
    store.set(f"{ARRIVED}/{env.rank}", socket.gethostname())
    store.add(ARRIVED, 1)
    if store.get(RESULT) != b"ok":
        raise RendezvousError(f"not every rank reached {where} within {connect:g} s: {hint}")
    return store


def _who_reports(error: RendezvousError, rank: int, defer: float) -> RendezvousError:
    """Rank 0 reports `error` as the job's line; any other rank waits `defer` seconds first
    (rank 0 is reporting the same failure, and the launcher then ends this rank)."""
    if rank == 0:
        error.every_rank = True
    else:
        error.defer = max(0.0, defer)
    return error


def join(env: LaunchEnv, limits: Timeouts,
         environ: Mapping[str, str] | None = None) -> dist.Store | None:
    """The store every rank of `env`'s job shares, ready for init_process_group(store=...,
    timeout=limits.collective); None under torchrun (its agent's store, env://).

    Raises a one-line RendezvousError when the ranks cannot meet: rank 0's is the job's
    error line, the others wait (`defer`) for rank 0 to report it and the job to end."""
    env_vars = os.environ if environ is None else environ
    if env_vars.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    started = time.monotonic()
    hint = what_to_set(env_vars)
    outwait = started + limits.connect + DEFER_MARGIN_SEC  # rank 0 has reported by then
    try:
        try:
            addresses = resolve(env.master_addr, env.master_port)
        except RendezvousError as e:
            raise RendezvousError(f"{e}: {hint}") from None
        if env.rank == 0:
            store = _host_store(env, addresses, limits.connect, hint)
        else:
            store = _join_store(env, addresses, limits.connect, started, hint)
    except RendezvousError as e:
        raise _who_reports(e, env.rank, outwait - time.monotonic()) from None
    except (RuntimeError, OSError) as e:  # a store operation failed: rank 0 is gone
        why = (str(e).splitlines() or [type(e).__name__])[0]
        error = RendezvousError(f"the rendezvous at MASTER_ADDR={env.master_addr}:"
                                f"{env.master_port} ended ({why})")
        raise _who_reports(error, env.rank, DEFER_MARGIN_SEC) from None
    store.set_timeout(timedelta(seconds=limits.collective))
    return store
