"""A real, private SLURM cluster on this machine, for tests of the submit scripts.

    with SlurmCluster(nodes=1) as cluster:
        job = cluster.submit("submit_pm.sh", ["--config=tiny"], env={...}, cwd=repo)
        state, code = cluster.wait(job, timeout=240)
        print(cluster.output(job))

Needs root on Linux (the daemons run as root, like SlurmUser=root below). Missing packages
(slurmctld slurmd slurm-client munge) are installed with apt-get. Everything else lives in
one temporary directory: a private munge key and socket, slurm.conf, state, spool, logs and
pid files; nothing under /etc is used. The daemons are stopped by the PIDs in their pid
files, never by process name. Python standard library only.

When the cluster cannot exist here (not root, not Linux, packages not installable) start()
raises ClusterUnavailable with the reason; any other start-up failure raises RuntimeError
with the daemons' log tails, because it is a bug rather than a missing capability.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel")
FINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "BOOT_FAIL", "DEADLINE",
})
# Seconds between the SIGTERM that ends a job's tasks and the SIGKILL that follows.
KILL_WAIT = 5
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_FIELD = re.compile(r"([A-Za-z][A-Za-z0-9_:/]*)=(.*?)(?= [A-Za-z][A-Za-z0-9_:/]*=|$)")


class ClusterUnavailable(RuntimeError):
    """A SLURM cluster cannot run on this machine; the message says why."""


class SubmitError(RuntimeError):
    """sbatch refused a job; the message holds sbatch's error output."""


def _path() -> str:
    parts = os.environ.get("PATH", "").split(os.pathsep) + _SYSTEM_PATH.split(os.pathsep)
    return os.pathsep.join(dict.fromkeys(p for p in parts if p))


def _which(name: str) -> str | None:
    return shutil.which(name, path=_path())


def _free_ports(count: int) -> list[int]:
    """`count` consecutive TCP ports that are free right now (slurmd ports are a range)."""
    for _ in range(200):
        base = 20000 + int.from_bytes(os.urandom(2), "little") % 30000
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return list(range(base, base + count))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free TCP ports found")


def parse_fields(line: str) -> dict[str, str]:
    """`Key=value Key2=value two` (scontrol -o, jobcomp/filetxt) -> dict."""
    return {k: v for k, v in _FIELD.findall(line.strip())}


def _exit_code(value: str) -> int | None:
    """ExitCode=rc:sig -> rc, or -sig when a signal ended the job (as subprocess does)."""
    m = re.fullmatch(r"(\d+):(\d+)", value or "")
    if not m:
        return None
    rc, sig = int(m.group(1)), int(m.group(2))
    return -sig if sig else rc


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _pid_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def ensure_packages(timeout: float = 300.0, log=print) -> None:
    """Install the SLURM and munge packages with apt-get when a binary is missing."""
    missing = [b for b in DAEMONS + CLIENTS + ("munge",) if _which(b) is None]
    if not missing:
        return
    if _which("apt-get") is None:
        raise ClusterUnavailable(f"missing {', '.join(missing)} and no apt-get to install "
                                 f"{' '.join(PACKAGES)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", PATH=_path())
    deadline = time.monotonic() + timeout
    log(f"slurm_cluster: installing {' '.join(PACKAGES)} (missing: {', '.join(missing)})")
    steps = (["apt-get", "-q", "-o", "DPkg::Lock::Timeout=60", "update"],
             ["apt-get", "-q", "-y", "-o", "DPkg::Lock::Timeout=60", "install",
              "--no-install-recommends", *PACKAGES])
    notes = []
    for cmd in steps:
        left = deadline - time.monotonic()
        try:
            r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, timeout=max(left, 1.0))
        except subprocess.TimeoutExpired:
            raise ClusterUnavailable(f"`{' '.join(cmd[:5])}` took over {timeout:.0f} s "
                                     f"(no package access?) {' '.join(notes)}") from None
        if r.returncode != 0:
            tail = " | ".join(r.stdout.strip().splitlines()[-3:])
            notes.append(f"`{' '.join(cmd[:5])}` failed ({r.returncode}): {tail}")
            if cmd[-1] != "update":  # a failed update may still leave usable package lists
                raise ClusterUnavailable(" ".join(notes))
    still = [b for b in DAEMONS + CLIENTS if _which(b) is None]
    if still:
        raise ClusterUnavailable(f"{', '.join(still)} still missing after installing "
                                 f"{' '.join(PACKAGES)}")


class SlurmCluster:
    """`nodes` slurmd daemons on this machine behind one slurmctld, one partition `debug`.

    With one node the node is named after this host, as on a real cluster, so a job's node
    list resolves; with several the nodes are node1..nodeN, all at 127.0.0.1 on their own
    ports (tell them apart in a job by SLURM_NODEID / SLURMD_NODENAME).
    """

    def __init__(self, nodes: int = 1, cpus_per_node: int = 8, install: bool = True,
                 keep_dir: bool | None = None, log=print):
        if nodes < 1:
            raise ValueError("nodes must be >= 1")
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node
        self.install = install
        self.keep_dir = bool(os.environ.get("SLURM_TEST_KEEP")) if keep_dir is None else keep_dir
        self.log = log
        self.host = socket.gethostname().split(".")[0]
        self.node_names = [self.host] if nodes == 1 else [f"node{i + 1}" for i in range(nodes)]
        self.dir: str | None = None
        self.conf: str | None = None
        self.env: dict[str, str] = {}
        self._stdout: dict[int, str] = {}
        self._started = False

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        if not sys.platform.startswith("linux"):
            raise ClusterUnavailable(f"needs Linux, this is {sys.platform}")
        if os.geteuid() != 0:
            raise ClusterUnavailable("needs root (slurmd and munged run as root)")
        if self.install:
            ensure_packages(log=self.log)
        else:
            missing = [b for b in DAEMONS + CLIENTS if _which(b) is None]
            if missing:
                raise ClusterUnavailable(f"missing {', '.join(missing)}")
        self.dir = tempfile.mkdtemp(prefix="slurm-test-")
        os.chmod(self.dir, 0o755)
        self._started = True
        atexit.register(self.stop)
        try:
            self._start_munge()
            self._write_conf()
            pid_files = self._pid_files()
            self._run_daemon(["slurmctld", "-f", self.conf], pid_files[-2])
            for name, pid_file in zip(self.node_names, pid_files[:self.nodes], strict=True):
                self._run_daemon(["slurmd", "-f", self.conf, "-N", name], pid_file)
            self._wait_idle(timeout)
        except BaseException as e:
            logs = self.daemon_logs()
            self.stop()
            if isinstance(e, (ClusterUnavailable, KeyboardInterrupt)):
                raise
            raise RuntimeError(f"SLURM cluster did not start: {e}\n{logs}") from e
        return self

    def _mkdir(self, name: str, mode: int = 0o755) -> str:
        path = os.path.join(self.dir, name)
        os.makedirs(path, exist_ok=True)
        os.chmod(path, mode)
        return path

    def _start_munge(self) -> None:
        key_dir = self._mkdir("munge-key", 0o700)   # the key: root only
        run_dir = self._mkdir("munge-run", 0o755)   # the socket: reachable by everyone
        key = os.path.join(key_dir, "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400), "wb") as f:
            f.write(os.urandom(1024))
        self.munge_socket = os.path.join(run_dir, "munge.socket")
        pid_file = os.path.join(run_dir, "munged.pid")
        self._run_daemon([
            "munged", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={pid_file}", f"--seed-file={os.path.join(key_dir, 'munged.seed')}",
            f"--log-file={os.path.join(self._mkdir('log'), 'munged.log')}",
        ], pid_file)
        deadline = time.monotonic() + 10
        while not os.path.exists(self.munge_socket):
            if time.monotonic() > deadline:
                raise RuntimeError("munged did not create its socket within 10 s")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        etc, state, spool, log, run = (self._mkdir(n) for n in ("etc", "state", "spool", "log",
                                                                 "run"))
        for name in self.node_names:
            self._mkdir(os.path.join("spool", name))
        ctld_port, *node_ports = _free_ports(1 + self.nodes)
        plugstack = os.path.join(etc, "plugstack.conf")   # empty: no site SPANK plugins
        open(plugstack, "w").close()
        real_host = socket.gethostname()
        lines = [
            "ClusterName=testcluster",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={state}",
            f"SlurmdSpoolDir={spool}/%n",
            f"SlurmctldPidFile={run}/slurmctld.pid",
            f"SlurmdPidFile={run}/slurmd-%n.pid",
            f"SlurmctldLogFile={log}/slurmctld.log",
            f"SlurmdLogFile={log}/slurmd-%n.log",
            f"PlugStackConfig={plugstack}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={log}/jobcomp.txt",
            "MpiDefault=none",
            "MailProg=/bin/true",
            # Impossible requests are rejected at submission instead of pending forever.
            "EnforcePartLimits=ALL",
            # Start jobs within about a second of submission.
            "SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=5",
            "ReturnToService=2",
            "MinJobAge=600",
            f"KillWait={KILL_WAIT}",
            "SlurmdDebug=info",
            "SlurmctldDebug=info",
        ]
        for name, port in zip(self.node_names, node_ports, strict=True):
            lines.append(f"NodeName={name} NodeHostname={real_host} NodeAddr=127.0.0.1 "
                         f"Port={port} CPUs={self.cpus_per_node} State=UNKNOWN")
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf = os.path.join(etc, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SLURMD_"))}
        env.update(SLURM_CONF=self.conf, PATH=_path())
        self.env = env

    def _run_daemon(self, cmd: list[str], pid_file: str) -> None:
        """Start a self-daemonising program and wait for its pid file (a full path)."""
        env = dict(self.env or os.environ, PATH=_path())
        r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` exited {r.returncode}: {r.stdout.strip()}")
        deadline = time.monotonic() + 15
        while self._read_pid(pid_file) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} wrote no pid file {pid_file} within 15 s")
            time.sleep(0.05)

    @staticmethod
    def _read_pid(path: str) -> int | None:
        try:
            with open(path) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def _pid_files(self) -> list[str]:
        """Daemons in stop order: slurmd(s), slurmctld, munged."""
        run = os.path.join(self.dir, "run")
        return ([os.path.join(run, f"slurmd-{n}.pid") for n in self.node_names]
                + [os.path.join(run, "slurmctld.pid"),
                   os.path.join(self.dir, "munge-run", "munged.pid")])

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states: list[str] = []
        while time.monotonic() < deadline:
            r = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
            states = r.stdout.split()
            idle = {states[i] for i in range(0, len(states) - 1, 2)
                    if states[i + 1].rstrip("*~#") == "idle"}
            if idle >= set(self.node_names):
                return
            time.sleep(0.2)
        raise RuntimeError(f"nodes not idle after {timeout:.0f} s: {' '.join(states)}")

    def stop(self) -> None:
        """Cancel all jobs, then SIGTERM the daemons by pid file; SIGKILL after ~10 s."""
        if not self._started:
            return
        self._started = False
        try:
            if self.conf:
                self._cancel_all(timeout=15)
        except (OSError, subprocess.SubprocessError) as e:
            self.log(f"slurm_cluster: cancelling the jobs failed ({e}); stopping anyway")
        finally:
            self._stop_daemons()
            if self.dir and not self.keep_dir:
                shutil.rmtree(self.dir, ignore_errors=True)
            elif self.dir:
                self.log(f"slurm_cluster: kept {self.dir}")

    def _stop_daemons(self) -> None:
        """SIGTERM each daemon of this cluster (by its pid file), SIGKILL after ~10 s."""
        pids = []
        for path in self._pid_files():
            pid = self._read_pid(path)
            # Only a live process started from this cluster's directory (no PID reuse).
            if pid and _pid_alive(pid) and self.dir in _pid_cmdline(pid):
                pids.append(pid)
                _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in pids:
            if _pid_alive(pid):
                _signal(pid, signal.SIGKILL)

    def _cancel_all(self, timeout: float) -> None:
        r = self.run(["squeue", "-h", "-o", "%i"], check=False)
        jobs = r.stdout.split()
        if not jobs:
            return
        self.run(["scancel", *jobs], check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.run(["squeue", "-h", "-o", "%i"], check=False)
            if r.returncode == 0 and not r.stdout.split():
                return
            time.sleep(0.3)

    # ------------------------------------------------------------------ jobs
    def run(self, cmd: Sequence[str], check: bool = True, timeout: float = 30,
            env: Mapping[str, str | None] | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster (SLURM_CONF set); `env` adds to the
        cluster's environment (a None value removes the variable)."""
        full_env = dict(self.env)
        for key, value in (env or {}).items():
            if value is None:
                full_env.pop(key, None)
            else:
                full_env[key] = value
        r = subprocess.run(list(cmd), env=full_env, cwd=cwd, capture_output=True, text=True,
                           timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` exited {r.returncode}: {r.stderr.strip()}")
        return r

    def submit(self, script: str, args: Iterable[str] = (),
               env: Mapping[str, str | None] | None = None, sbatch_opts: Iterable[str] = (),
               cwd: str | None = None) -> int:
        """sbatch [sbatch_opts] script [args] with this environment plus `env` (None values
        unset a variable), from directory `cwd`; returns the job id.

        The job sees the submitting environment (sbatch's default --export=ALL). Raises
        SubmitError when sbatch refuses the job.
        """
        cmd = ["sbatch", "--parsable", *sbatch_opts, script, *args]
        r = self.run(cmd, check=False, env=env, cwd=cwd)
        if r.returncode != 0:
            raise SubmitError(f"`{' '.join(cmd)}` exited {r.returncode}: {r.stderr.strip()}")
        job_id = int(r.stdout.strip().split(";")[0])
        info = self.job_info(job_id)
        if info and info.get("StdOut"):
            self._stdout[job_id] = info["StdOut"]
        return job_id

    def job_info(self, job_id: int) -> dict[str, str] | None:
        """`scontrol show job -o` as a dict; the job completion record once that is gone;
        None when neither knows the job."""
        r = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if r.returncode == 0 and r.stdout.strip():
            return parse_fields(r.stdout.splitlines()[0])
        comp = os.path.join(self.dir, "log", "jobcomp.txt")
        found = None
        try:
            with open(comp) as f:
                for line in f:
                    fields = parse_fields(line)
                    if fields.get("JobId") == str(job_id):
                        found = fields
        except OSError:
            pass
        return found

    def wait(self, job_id: int, timeout: float = 300.0,
             poll: float = 0.5) -> tuple[str, int | None]:
        """Wait for a final state; (JobState, exit code: rc, or -signal). TimeoutError when
        the job is not finished after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while True:
            info = self.job_info(job_id) or {}
            state = info.get("JobState", state)
            if state in FINAL_STATES:
                return state, _exit_code(info.get("ExitCode", ""))
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s "
                                   f"(reason {info.get('Reason', '?')})")
            time.sleep(poll)

    def output(self, job_id: int) -> str:
        """The job's standard output file (empty when it does not exist yet)."""
        path = self._stdout.get(job_id)
        if not path:
            info = self.job_info(job_id) or {}
            path = info.get("StdOut")
        if not path:
            return ""
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def wait_output(self, job_id: int, text: str, timeout: float = 60.0) -> str:
        """Wait until the job's output contains `text`; the output. TimeoutError if it does
        not within `timeout` seconds, or the job ends without it."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.output(job_id)
            if text in out:
                return out
            info = self.job_info(job_id) or {}
            ended = info.get("JobState") in FINAL_STATES
            if ended or time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} ({info.get('JobState', '?')}): no {text!r} "
                                   f"in its output after {timeout:.0f} s:\n{out[-2000:]}")
            time.sleep(0.2)

    def signal(self, job_id: int, sig: int | str, batch: bool = False) -> None:
        """Send a signal to the job's step tasks, or with batch=True to the batch shell only."""
        name = sig if isinstance(sig, str) else signal.Signals(sig).name
        name = name.upper().removeprefix("SIG")
        self.run(["scancel", f"--signal={name}", *(["--batch"] if batch else []), str(job_id)])

    def requeue(self, job_id: int) -> None:
        """Requeue the job (it reruns after cred_expire + 1 s, about 11 s)."""
        self.run(["scontrol", "requeue", str(job_id)])

    def daemon_logs(self, lines: int = 20) -> str:
        """Tails of the daemons' log files, for failure messages."""
        if not self.dir:
            return ""
        out = []
        log_dir = os.path.join(self.dir, "log")
        for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []:
            try:
                with open(os.path.join(log_dir, name), errors="replace") as f:
                    tail = f.read().splitlines()[-lines:]
            except OSError:
                continue
            out.append(f"--- {name}\n" + "\n".join(tail))
        return "\n".join(out)


if __name__ == "__main__":  # smoke test: python tests/slurm_cluster.py [nodes]
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    t0 = time.monotonic()
    with SlurmCluster(nodes=n) as c, tempfile.TemporaryDirectory() as tmp:
        print(f"up in {time.monotonic() - t0:.1f} s: nodes {' '.join(c.node_names)}")
        script = os.path.join(tmp, "hello.sh")
        with open(script, "w") as f:
            f.write("#!/bin/bash\nsrun bash -c 'echo task $SLURM_PROCID on $SLURMD_NODENAME'\n")
        job = c.submit(script, sbatch_opts=["-N", str(n), "--ntasks-per-node=2",
                                            f"--output={tmp}/%j.out"])
        print(c.wait(job, timeout=60), f"{time.monotonic() - t0:.1f} s")
        print(c.output(job))


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it ended meanwhile
        pass
