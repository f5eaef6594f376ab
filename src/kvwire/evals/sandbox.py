"""Run one untrusted Python program -- model-written code plus its task's tests -- and say how it ended.

This module is the security boundary of ``kvwire eval``. It runs a program and nothing else: no
scoring, no task parsing. Each :func:`run_program` call

- writes the source to ``program.py`` in a fresh directory, the program's cwd and HOME, inside a
  temporary parent the program cannot rename or write (so it cannot move its directory away); the
  whole tree is removed afterwards, whatever happened;
- starts ``python -s -P program.py`` as one subprocess (the interpreter running kvwire; as root, where
  ``nobody`` cannot run that one -- pyenv's lives under /root -- the system's ``python3``, which
  :attr:`Isolation.python` names), with a scrubbed environment and nothing of the parent's:
  PATH=/usr/bin:/bin, LANG=C.UTF-8, HOME, PYTHONDONTWRITEBYTECODE=1, PYTHONHASHSEED=0. ``-s -P`` is
  ``-I`` less ``-E``: the environment is ours alone, and ``-E`` would ignore the last two (set and
  dict order would then change from run to run);
- sets rlimits in the child before exec: CPU seconds (SIGXCPU, SIGKILL one second later), address
  space (large allocations raise MemoryError), file size (Python ignores SIGXFSZ: the write fails
  with EFBIG), no core files, 256 open files, and at most ``Limits.processes`` processes (threads
  count) beyond those its user already runs;
- gives it its own session and process group. When it exits, or the wall-clock limit passes,
  SIGKILL goes to it and its whole group, then to any process left whose environment names this
  run's HOME or whose cwd is in its directory (one that called ``setsid``);
- reads stdout and stderr as they come (a full pipe never blocks it) and keeps at most
  ``Limits.output_bytes`` of each: the head and the tail (where the traceback's last line is).

As root, and only as root, more; :func:`isolation` probes what this host allows once per process,
and every report repeats its :meth:`Isolation.describe` line:

- the program runs as ``nobody`` (its own group, no supplementary groups): it cannot write or
  delete what root owns, and RLIMIT_NPROC binds (it never does for root);
- where ``unshare`` and ``setpriv`` (util-linux) work, in fresh network, PID and mount namespaces:
  no network at all (a loopback that is down), host processes out of sight (/proc is the
  namespace's), and a small trusted init as pid 1 that starts the program and reports its exit
  status. SIGKILL to that init ends every process the program started, however detached::

      unshare --fork --kill-child --net --pid --mount-proc -- \\
          setpriv --reuid=nobody --regid=nogroup --clear-groups --no-new-privs --pdeathsig=SIGKILL -- \\
          python -I -S -c INIT FD  python -s -P program.py

  Where the container refuses namespaces, the program still runs as nobody (``Popen(user=...)``,
  without no-new-privs), with the network and the host's processes within reach, and
  :class:`Isolation` says so and why.

Not isolated, on any host: the filesystem beyond file permissions (a program reads whatever is
world-readable -- the source tree, /etc -- and writes where anyone may, /tmp and /dev/shm, which
nothing cleans up); CPU and memory shares (rlimits are per process, there are no cgroups); programs
that run as nobody at the same time share its process count. A **non-root host gets only the
rlimits, the process group and the sweep**: the program runs as the calling user, with that user's
files, network and processes within its reach. Run evaluations of code you do not trust as root in
a container (or in a VM), where the namespaces apply.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import pwd
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import KvwireError, reason as error_reason

log = logging.getLogger(__name__)

UNPRIVILEGED_USER = "nobody"
PROGRAM_NAME = "program.py"
OPEN_FILES = 256
PYTHON_FLAGS = ("-s", "-P")  # -I without -E: no user site, no script dir on sys.path; our env is honoured
_TOOL_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
_SYSTEM_PYTHON_PATH = "/usr/local/bin:/usr/bin:/bin"
_POLL_S = 0.02  # how often the exit is checked where pidfds are missing
_DRAIN_S = 2.0  # how long output is read after the kill
_PROBE_TIMEOUT_S = 10.0
_SWEEP_ROUNDS = 20
_REASON_CHARS = 300
_KILL_HINTS = {signal.SIGXCPU: "CPU limit", signal.SIGXFSZ: "file size limit",
               signal.SIGKILL: "CPU hard limit or out of memory?", signal.SIGSEGV: "stack overflow?"}

# pid 1 of the PID namespace: starts the program as its child, reaps orphans until the program ends,
# then writes its raw wait status to fd argv[1]. Its exit tears the namespace down (every process in it
# gets SIGKILL). The program cannot signal it: pid 1 ignores signals it has no handler for.
_INIT = """\
import os, sys
fd = int(sys.argv[1])
os.set_inheritable(fd, False)
pid = os.fork()
if pid == 0:
    try:
        os.execv(sys.argv[2], sys.argv[2:])
    except OSError as err:
        os.write(2, ("sandbox init: cannot run %s: %s\\n" % (sys.argv[2], err.strerror)).encode())
    os._exit(127)
while True:
    done, status = os.waitpid(-1, 0)
    if done == pid:
        os.write(fd, b"%d\\n" % status)
        break
"""

Status = Literal["passed", "failed", "timeout", "killed"]


@dataclass(frozen=True)
class Limits:
    """What one program may use. Each limit applies per process (rlimits), except ``wall_s`` and ``processes``."""

    wall_s: float = 20.0  # wall-clock limit for the whole program
    cpu_s: float = 10.0  # RLIMIT_CPU (rounded up to whole seconds): SIGXCPU, SIGKILL one second later
    memory_bytes: int = 1 << 30  # RLIMIT_AS (address space), 1 GiB
    processes: int = 32  # RLIMIT_NPROC: processes and threads beyond those the user already runs
    output_bytes: int = 64 << 10  # stdout/stderr kept (each: its head and its tail)
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_bytes", "processes", "output_bytes", "file_bytes"):
            value = getattr(self, name)
            if not value > 0:
                raise KvwireError(f"sandbox limit {name} must be positive, got {value!r}")


@dataclass(frozen=True)
class Outcome:
    """How a program ended.

    ``status``: passed (exit code 0), failed (another exit code), timeout (the wall-clock limit hit;
    ``returncode`` is None), killed (ended by a signal: ``returncode`` is minus its number).
    """

    status: Status
    returncode: int | None
    seconds: float
    stdout: str  # at most Limits.output_bytes (before decoding with errors="replace")
    stderr: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def reason(self) -> str:
        """One line a report can show: "passed", the last line of stderr ("AssertionError"), "timed out
        after 20.0 s", "killed by SIGXCPU (CPU limit)"."""
        if self.status == "passed":
            return "passed"
        if self.status == "timeout":
            return f"timed out after {self.seconds:.1f} s"
        if self.status == "killed" and self.returncode is not None:
            number = -self.returncode
            try:
                name = signal.Signals(number).name
            except ValueError:
                name = f"signal {number}"
            hint = _KILL_HINTS.get(number)
            return f"killed by {name} ({hint})" if hint else f"killed by {name}"
        lines = [line.strip() for line in self.stderr.splitlines() if line.strip()]
        return lines[-1][:_REASON_CHARS] if lines else f"exit code {self.returncode}"


@dataclass(frozen=True)
class Isolation:
    """What this host allows; said in every eval report."""

    unprivileged_user: str | None  # e.g. "nobody" when running as root, None otherwise
    network: bool  # True: the program runs in a fresh network namespace (no network)
    pid_namespace: bool  # True: in a fresh PID namespace, with a trusted init as pid 1
    note: str = ""  # why a user switch or a namespace is missing, where one is
    python: str = ""  # the interpreter programs run with ("": this process's, sys.executable)

    def describe(self) -> str:
        """One line, e.g. "each program: own process group, rlimits, user nobody, no network (fresh
        netns), own PID namespace"."""
        parts = ["each program: own process group", "rlimits"]
        parts.append(f"user {self.unprivileged_user}" if self.unprivileged_user else "runs as the calling user")
        parts.append("no network (fresh netns)" if self.network else "network reachable")
        parts.append("own PID namespace" if self.pid_namespace else "host processes visible")
        parts.append(f"python {self.python or sys.executable}")
        line = ", ".join(parts)
        return f"{line} ({self.note})" if self.note else line


@functools.cache
def isolation() -> Isolation:
    """What this host allows, probed once per process (as root: an interpreter ``nobody`` can run, then one
    short run of the namespace chain)."""
    if os.geteuid() != 0:
        return Isolation(None, network=False, pid_namespace=False,
                         note="not root: no user switch, no namespaces; rlimits and the process group only",
                         python=sys.executable)
    try:
        account = pwd.getpwnam(UNPRIVILEGED_USER)
    except KeyError:
        return Isolation(None, network=False, pid_namespace=False,
                         note=f"no user {UNPRIVILEGED_USER!r} to run programs as: refused")
    python, why_not = _interpreter(account)
    if python is None:
        return Isolation(None, network=False, pid_namespace=False,
                         note=f"user {account.pw_name} can run no Python ({why_not}): refused")
    why = _namespaces_refused(account, python)
    if why:
        log.warning("sandbox: programs will run without namespaces: %s", why)
    return Isolation(account.pw_name, network=not why, pid_namespace=not why, note=why, python=python)


def run_program(source: str, limits: Limits = Limits(), *, stdin: str = "") -> Outcome:
    """Run ``source`` as a Python program under ``limits`` (see the module docstring) and say how it ended.

    Raises :class:`KvwireError` only when the host cannot run programs at all (no interpreter, root
    without an unprivileged user, a temporary directory others cannot enter); whatever the program
    does is in the :class:`Outcome`.
    """
    iso = isolation()
    account = None
    if os.geteuid() == 0:
        if iso.unprivileged_user is None:
            raise KvwireError(f"refusing to run a model-written program as root ({iso.note})",
                              f"create a user {UNPRIVILEGED_USER!r}, or run kvwire eval as an unprivileged user")
        account = pwd.getpwnam(iso.unprivileged_user)
    python = iso.python or sys.executable
    if not python or not os.access(python, os.X_OK):
        raise KvwireError(f"cannot run programs: no Python interpreter at {python!r}",
                          "run kvwire with a regular Python installation")
    top = Path(tempfile.mkdtemp(prefix="kvwire-sandbox-"))
    try:
        work = top / "work"
        work.mkdir()
        program = work / PROGRAM_NAME
        program.write_text(source, encoding="utf-8", errors="surrogatepass")
        if account is not None:
            _check_reachable(top, account.pw_name)
            top.chmod(0o755)  # root's: nobody may enter, not write
            for path in (work, program):
                os.chown(path, account.pw_uid, account.pw_gid)
        return _run(work, python, iso, account, limits, stdin)
    finally:
        _remove(top)


def _run(work: Path, python: str, iso: Isolation, account: pwd.struct_passwd | None, limits: Limits,
         stdin: str) -> Outcome:
    uid = account.pw_uid if account is not None else os.getuid()
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work),
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
    argv = [python, *PYTHON_FLAGS, PROGRAM_NAME]
    extra: dict = {}
    status_r = status_w = None
    if account is not None and (iso.network or iso.pid_namespace):
        status_r, status_w = os.pipe()
        argv = _chain(iso, account, python, status_w) + argv
        extra["pass_fds"] = (status_w,)
    elif account is not None:
        extra.update(user=account.pw_uid, group=account.pw_gid, extra_groups=[])
    log.debug("sandbox: running %s in %s", argv[0], work)
    start = time.monotonic()
    try:
        proc = _start(argv, work, env, _rlimits(limits, uid), stdin, extra)
    except KvwireError:
        if status_r is not None:
            os.close(status_r)
        raise
    finally:
        if status_w is not None:
            os.close(status_w)
    out, err = _Capture(limits.output_bytes), _Capture(limits.output_bytes)
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ, out)  # type: ignore[arg-type]
    selector.register(proc.stderr, selectors.EVENT_READ, err)  # type: ignore[arg-type]
    timed_out = False
    raw_status = None
    try:
        timed_out = _wait(proc.pid, start + limits.wall_s, selector)
        seconds = time.monotonic() - start
    finally:
        _kill(proc.pid)  # before it is reaped: its pid and group id cannot have been reused
        swept = _sweep(work, uid)
        if swept:
            log.warning("sandbox: killed %d process(es) that left the program's process group", swept)
        _read_until(selector, time.monotonic() + _DRAIN_S)
        selector.close()
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
        proc.wait()
        if status_r is not None:
            raw_status = _read_status(status_r)
            os.close(status_r)
    if timed_out:
        status, returncode = "timeout", None
    else:
        returncode = proc.returncode if raw_status is None else os.waitstatus_to_exitcode(raw_status)
        status = "passed" if returncode == 0 else "killed" if returncode < 0 else "failed"
    outcome = Outcome(status, returncode, seconds, out.text(), err.text())
    log.debug("sandbox: %s in %.2f s: %s", status, seconds, outcome.reason())
    return outcome


def _start(argv: list[str], work: Path, env: dict[str, str], rlimits: list[tuple[int, int, int]], stdin: str,
           extra: dict) -> subprocess.Popen[bytes]:
    """Popen in its own session, rlimits set between fork and exec, ``stdin`` from an unlinked file."""
    with tempfile.TemporaryFile() as stdin_file:
        stdin_file.write(stdin.encode("utf-8", "surrogatepass"))
        stdin_file.seek(0)
        try:
            return subprocess.Popen(argv, cwd=work, env=env, stdin=stdin_file, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
                                    preexec_fn=functools.partial(_apply_rlimits, rlimits), **extra)
        except (OSError, subprocess.SubprocessError) as err:
            raise KvwireError(f"cannot start a sandboxed program with {argv[0]}: {error_reason(err)}",
                              "check that this Python (and util-linux's unshare and setpriv, as root) can run "
                              "here") from err


def _chain(iso: Isolation, account: pwd.struct_passwd, python: str, status_fd: int) -> list[str]:
    """``unshare ... -- setpriv ... -- python INIT status_fd`` (the program's argv goes after it)."""
    unshare, setpriv = _tools()
    if unshare is None or setpriv is None:
        raise KvwireError("namespaces asked for, but util-linux's unshare or setpriv is missing",
                          "install util-linux")
    flags = ["--fork", "--kill-child"]
    if iso.network:
        flags.append("--net")
    if iso.pid_namespace:
        flags += ["--pid", "--mount-proc"]
    return [unshare, *flags, "--",
            setpriv, f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--clear-groups",
            "--no-new-privs", "--pdeathsig=SIGKILL", "--",
            python, "-I", "-S", "-c", _INIT, str(status_fd)]


@functools.cache
def _tools() -> tuple[str | None, str | None]:
    return shutil.which("unshare", path=_TOOL_PATH), shutil.which("setpriv", path=_TOOL_PATH)


def _interpreter(account: pwd.struct_passwd) -> tuple[str | None, str]:
    """The first Python that ``account`` can start with :data:`PYTHON_FLAGS`: this process's, else the
    system's ``python3`` (a Python installed under /root, pyenv's, is out of nobody's reach), with why not.

    Probed with ``Popen(user=...)``, not setpriv: setpriv keeps root's capabilities until its exec, so it
    starts a binary nobody cannot reach -- which then loads whatever libpython and stdlib nobody can."""
    candidates = [sys.executable, shutil.which("python3", path=_SYSTEM_PYTHON_PATH)]
    reasons = []
    for python in dict.fromkeys(c for c in candidates if c):
        try:
            done = subprocess.run([python, *PYTHON_FLAGS, "-c", "pass"], cwd="/", env={"PATH": "/usr/bin:/bin"},
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=_PROBE_TIMEOUT_S,
                                  user=account.pw_uid, group=account.pw_gid, extra_groups=[])
        except (OSError, subprocess.SubprocessError) as err:
            reasons.append(f"{python}: {error_reason(err)}")
            continue
        if done.returncode == 0:
            if python != sys.executable:
                log.warning("sandbox: user %s cannot run %s (%s); programs run with %s", account.pw_name,
                            sys.executable, "; ".join(reasons), python)
            return python, ""
        lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
        reasons.append(f"{python}: {lines[-1] if lines else f'exit code {done.returncode}'}")
    return None, "; ".join(reasons)


def _namespaces_refused(account: pwd.struct_passwd, python: str) -> str:
    """Why the namespace chain cannot run a trivial program here ("" when it can)."""
    unshare, setpriv = _tools()
    missing = [name for name, path in (("unshare", unshare), ("setpriv", setpriv)) if path is None]
    if missing:
        return f"{' and '.join(missing)} not found (util-linux)"
    status_r, status_w = os.pipe()
    try:
        argv = _chain(Isolation(account.pw_name, True, True), account, python, status_w)
        done = subprocess.run([*argv, python, *PYTHON_FLAGS, "-c", "pass"], cwd="/", env={"PATH": "/usr/bin:/bin"},
                              stdin=subprocess.DEVNULL, capture_output=True, pass_fds=(status_w,),
                              timeout=_PROBE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as err:
        return f"unshare failed: {error_reason(err)}"
    finally:
        os.close(status_w)
        raw = _read_status(status_r)
        os.close(status_r)
    if done.returncode == 0 and raw == 0:
        return ""
    lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
    code = done.returncode if raw is None else os.waitstatus_to_exitcode(raw)
    return f"unshare refused: {lines[-1] if lines else f'exit code {code}'}"


def _check_reachable(top: Path, user: str) -> None:
    for parent in top.parents:
        if not parent.stat().st_mode & stat.S_IXOTH:
            raise KvwireError(f"user {user} cannot enter {parent}, where the sandbox's temporary directories are",
                              "set TMPDIR to a directory every user may enter, such as /tmp")


def _rlimits(limits: Limits, uid: int) -> list[tuple[int, int, int]]:
    """(resource, soft, hard) for the child, never above the limits this process already has."""
    cpu = max(1, math.ceil(limits.cpu_s))
    nproc = _tasks_of(uid) + limits.processes
    wanted = [(resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes),
              (resource.RLIMIT_FSIZE, limits.file_bytes, limits.file_bytes), (resource.RLIMIT_CORE, 0, 0),
              (resource.RLIMIT_NPROC, nproc, nproc), (resource.RLIMIT_NOFILE, OPEN_FILES, OPEN_FILES)]
    result = []
    for which, soft, hard in wanted:
        current = resource.getrlimit(which)[1]
        if current != resource.RLIM_INFINITY:
            soft, hard = min(soft, current), min(hard, current)
        result.append((which, soft, hard))
    return result


def _apply_rlimits(rlimits: list[tuple[int, int, int]]) -> None:
    """Runs in the child between fork and exec: nothing but setrlimit calls (no imports, no locks)."""
    for which, soft, hard in rlimits:
        resource.setrlimit(which, (soft, hard))


def _proc_pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def _tasks_of(uid: int) -> int:
    """How many processes and threads run with real uid ``uid`` (what RLIMIT_NPROC counts)."""
    count = 0
    for pid in _proc_pids():
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        fields = {key: value.split() for key, _, value in (line.partition(":") for line in lines)}
        if fields.get("Uid", ["-1"])[0] == str(uid):
            count += int(fields.get("Threads", ["1"])[0])
    return count


def _exited(pid: int) -> bool:
    """Whether child ``pid`` has ended, without reaping it."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _wait(pid: int, deadline: float, selector: selectors.BaseSelector) -> bool:
    """Read output until child ``pid`` ends (False) or ``deadline`` passes (True)."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None  # no pidfds here (Linux < 5.3): poll
    if pidfd is not None:
        selector.register(pidfd, selectors.EVENT_READ, None)
    try:
        while not _exited(pid):
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            _read_ready(selector, left if pidfd is not None else min(left, _POLL_S))
        return False
    finally:
        if pidfd is not None:
            selector.unregister(pidfd)
            os.close(pidfd)


def _read_ready(selector: selectors.BaseSelector, timeout: float) -> None:
    for key, _ in selector.select(timeout):
        if key.data is None:  # the pidfd: the process ended
            continue
        data = os.read(key.fd, 1 << 16)
        if data:
            key.data.add(data)
        else:
            selector.unregister(key.fileobj)


def _read_until(selector: selectors.BaseSelector, deadline: float) -> None:
    """Read what is left in the pipes until both end or ``deadline`` passes."""
    while selector.get_map() and (left := deadline - time.monotonic()) > 0:
        _read_ready(selector, left)


def _read_status(fd: int) -> int | None:
    """The raw wait status the namespace's init wrote, if it did."""
    os.set_blocking(fd, False)
    try:
        return int(os.read(fd, 64).split()[0])
    except (BlockingIOError, IndexError, ValueError):
        return None


def _kill(pid: int) -> None:
    """SIGKILL child ``pid`` and its process group (which it may have left for another)."""
    for kill in (os.kill, os.killpg):
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError as err:
            log.debug("sandbox: %s(%d): %s", kill.__name__, pid, err)


def _belongs(pid: int, home: bytes, work: str) -> bool:
    try:
        if home in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
            return True
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    return cwd == work or cwd.startswith(work + "/")


def _sweep(work: Path, uid: int) -> int:
    """SIGKILL every process of ``uid`` whose environment has HOME=``work``, or whose cwd is in ``work``,
    until none is left: those that escaped the process group with ``setsid``. Returns how many."""
    home = b"\0HOME=" + os.fsencode(work) + b"\0"
    killed = 0
    for _ in range(_SWEEP_ROUNDS):
        found = []
        for pid in _proc_pids():
            try:
                owner = os.stat(f"/proc/{pid}").st_uid
            except OSError:
                continue
            if owner == uid and pid != os.getpid() and _belongs(pid, home, str(work)):
                found.append(pid)
        if not found:
            return killed
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed += len(found)
        time.sleep(0.01)  # let them die before looking again
    log.warning("sandbox: processes of %s still appear after %d rounds of SIGKILL", work, _SWEEP_ROUNDS)
    return killed


def _remove(top: Path) -> None:
    """Remove the run's directory, also where the program took permissions away from parts of it."""
    try:
        shutil.rmtree(top)
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    for root, dirs, _files in os.walk(top):
        for name in dirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(root, name), 0o700)
    try:
        shutil.rmtree(top)
    except OSError as err:
        log.warning("sandbox: could not remove %s: %s", top, error_reason(err))


class _Capture:
    """One output stream: its first and its last ``limit`` bytes, and how many came in all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.head = bytearray()
        self.tail = bytearray()  # what came after the head, its last ``limit`` bytes
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = max(0, self.limit - len(self.head))
        self.head += data[:room]
        self.tail += data[room:]
        if len(self.tail) > self.limit:
            del self.tail[: len(self.tail) - self.limit]

    def text(self) -> str:
        """All of it if it fits in ``limit`` bytes, else its head, a line saying so, and its tail."""
        if self.total <= self.limit:
            return self.head.decode("utf-8", "replace")
        marker = f"\n[... {self.total} bytes in all: only the head and the tail are kept ...]\n".encode()
        budget = self.limit - len(marker)
        if budget < 2:
            return self.head.decode("utf-8", "replace")
        head, tail = budget // 2, budget - budget // 2
        end = self.tail[-tail:] if len(self.tail) >= tail else (self.head + self.tail)[-tail:]
        return (self.head[:head] + marker + end).decode("utf-8", "replace")
