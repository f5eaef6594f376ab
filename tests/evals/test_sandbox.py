"""The sandbox that runs model-written programs: each test runs a real program that tries something.

Every hostile program here is bounded on its own, so a failing sandbox cannot hurt the machine (which
is also the CI machine, running as root): the loops end by themselves after 30 s, the fork bomb stops
at 200 sleeping children that exit after 30 s, the 10 GiB allocation refuses to start unless an
address-space limit is in force, and the only file a program tries to delete is the test's own.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from kvwire.errors import KvwireError
from kvwire.evals import sandbox
from kvwire.evals.sandbox import Isolation, Limits, Outcome, isolation, run_program
from tests.support.netns import REQUIRE_ENV

FAST = Limits(wall_s=3.0, cpu_s=2.0)
ROOT = os.geteuid() == 0
TURNED_OFF = "namespaces turned off by the test"


@pytest.fixture(params=["host", "no-namespaces"])
def mode(request, monkeypatch) -> Isolation:
    """The isolation under test: this host's, and (where it has namespaces) the fallback without them."""
    iso = isolation()
    if request.param == "no-namespaces":
        if not (iso.network or iso.pid_namespace):
            pytest.skip(f"the host already runs programs without namespaces: {iso.describe()}")
        iso = replace(iso, network=False, pid_namespace=False, note=TURNED_OFF)
        monkeypatch.setattr(sandbox, "isolation", lambda: iso)
    return iso


def _pids(match) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                if match(name):
                    pids.append(int(name))
            except OSError:  # gone meanwhile
                continue
    return pids


def _survivors(*, cmdline: str | None = None, cwd: str | None = None, wait_s: float = 2.0) -> list[int]:
    """Live processes whose command line holds ``cmdline`` or whose cwd is ``cwd`` (or was, before it was
    deleted), waiting up to ``wait_s`` for ones already SIGKILLed to go. Whatever is found is killed, so that
    a failing test leaves nothing behind either."""

    def match(pid: str) -> bool:
        if cmdline is not None and cmdline.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
            return True
        return cwd is not None and os.readlink(f"/proc/{pid}/cwd").startswith(cwd)

    deadline = time.monotonic() + wait_s
    while (found := _pids(match)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in found:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    return found


def test_a_program_that_exits_0_passes():
    outcome = run_program("print('hello')\n", FAST)
    assert outcome.status == "passed" and outcome.passed and outcome.returncode == 0
    assert outcome.stdout == "hello\n" and outcome.reason() == "passed"
    assert 0 < outcome.seconds < FAST.wall_s


def test_a_failed_assertion_fails_with_its_line():
    outcome = run_program("def add(a, b):\n    return a - b\n\nassert add(2, 2) == 4, 'add is wrong'\n", FAST)
    assert outcome.status == "failed" and not outcome.passed and outcome.returncode == 1
    assert outcome.reason() == "AssertionError: add is wrong"
    assert "Traceback" in outcome.stderr


def test_stdin_is_fed_to_the_program():
    outcome = run_program("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n", FAST,
                          stdin="1 2\n3\n")
    assert outcome.passed and outcome.stdout == "6\n"


def test_the_environment_is_scrubbed_and_hashing_is_deterministic(monkeypatch):
    monkeypatch.setenv("KVWIRE_SECRET", "hunter2")
    source = ("import json, os, sys\n"
              "print(json.dumps({'env': dict(os.environ), 'cwd': os.getcwd(), 'hash': hash('kvwire'),\n"
              "                  'no_user_site': sys.flags.no_user_site, 'safe_path': sys.flags.safe_path}))\n")
    first, second = (json.loads(run_program(source, FAST).stdout) for _ in range(2))
    assert "KVWIRE_SECRET" not in first["env"] and "hunter2" not in json.dumps(first)
    assert first["env"] == {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": first["cwd"],
                            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
    assert first["no_user_site"] and first["safe_path"]
    assert first["hash"] == second["hash"], "PYTHONHASHSEED=0 is not honoured: set order changes run to run"


def test_limits_are_set_in_the_program():
    limits = Limits(wall_s=3.0, cpu_s=2.0, memory_bytes=512 << 20, file_bytes=1 << 20)
    source = ("import json, resource as r\n"
              "print(json.dumps({n: r.getrlimit(getattr(r, 'RLIMIT_' + n)) for n in\n"
              "                  ('CPU', 'AS', 'FSIZE', 'CORE', 'NOFILE', 'NPROC')}))\n")
    got = json.loads(run_program(source, limits).stdout)
    assert got["CPU"] == [2, 3] and got["AS"] == [512 << 20] * 2 and got["FSIZE"] == [1 << 20] * 2
    assert got["CORE"] == [0, 0] and got["NOFILE"] == [sandbox.OPEN_FILES] * 2
    assert limits.processes <= got["NPROC"][0] < 1 << 20


def test_the_working_directory_is_removed_afterwards():
    source = ("import os\n"
              "print(os.getcwd())\n"
              "os.makedirs('a/b')\n"
              "open('a/b/f', 'w').write('x')\n"
              "os.chmod('a/b', 0)\n"
              "os.chmod('a', 0o500)\n"
              "raise SystemExit(3)\n")
    outcome = run_program(source, FAST)
    assert outcome.status == "failed" and outcome.reason() == "exit code 3"
    work = Path(outcome.stdout.strip())
    assert work.name == "work" and not work.parent.exists()


def test_an_infinite_loop_is_killed_at_the_cpu_limit():
    source = ("import time\n"
              "end = time.monotonic() + 30  # bounded, were no limit in force\n"
              "while time.monotonic() < end:\n"
              "    pass\n")
    outcome = run_program(source, Limits(wall_s=15.0, cpu_s=1.0))
    assert outcome.status == "killed" and outcome.returncode == -24 and not outcome.passed
    assert outcome.reason() == "killed by SIGXCPU (CPU limit)"
    assert outcome.seconds < 10


def test_a_program_that_sleeps_times_out_at_the_wall_limit(mode):
    outcome = run_program("import os, time\nprint(os.getcwd(), flush=True)\ntime.sleep(30)\n",
                          Limits(wall_s=1.5, cpu_s=2.0))
    assert outcome.status == "timeout" and outcome.returncode is None
    assert outcome.reason().startswith("timed out after 1.")
    assert 1.5 <= outcome.seconds < 4.5
    assert _survivors(cwd=outcome.stdout.strip()) == []


def test_allocating_10_gib_raises_memory_error():
    source = ("import resource\n"
              "soft = resource.getrlimit(resource.RLIMIT_AS)[0]\n"
              "if soft == resource.RLIM_INFINITY or soft > 2 << 30:  # the test's own guard: never fill the host\n"
              "    raise SystemExit(f'refusing to allocate 10 GiB: RLIMIT_AS is {soft}')\n"
              "data = bytearray(10 * 2**30)\n")
    outcome = run_program(source, FAST)
    assert outcome.status == "failed" and outcome.reason() == "MemoryError"


def test_writing_past_the_file_size_limit_fails():
    source = "with open('big', 'wb') as f:\n    f.write(b'x' * (2 << 20))\n"
    outcome = run_program(source, replace(FAST, file_bytes=1 << 20))
    # Python ignores SIGXFSZ, so the write fails with EFBIG (other programs are killed by the signal)
    assert outcome.status == "failed" and outcome.reason() == "OSError: [Errno 27] File too large"


def test_huge_output_is_cut_to_its_head_and_tail():
    source = ("import sys\n"
              "sys.stdout.write('BEGIN' + 'o' * (1 << 20) + 'END\\n')\n"
              "sys.stderr.write('start' + 'e' * (1 << 20) + '\\nValueError: last line\\n')\n")
    outcome = run_program(source, replace(FAST, output_bytes=1000))
    assert outcome.passed, outcome.reason()
    for text, head, tail in ((outcome.stdout, "BEGIN", "END\n"), (outcome.stderr, "start", "last line\n")):
        assert len(text.encode()) <= 1000 and text.startswith(head) and text.endswith(tail)
        assert "bytes in all" in text
    assert Outcome("failed", 1, 0.1, "", outcome.stderr).reason() == "ValueError: last line"


def test_a_bounded_fork_bomb_fails_and_leaves_no_process(mode):
    source = ("import os, sys, time\n"
              "print(os.getcwd(), flush=True)  # the test finds the children by their cwd\n"
              "forked = 0\n"
              "try:\n"
              "    for _ in range(200):  # bounded: 200 sleeping children at most, were there no limit at all\n"
              "        if os.fork() == 0:\n"
              "            time.sleep(30)\n"
              "            os._exit(0)\n"
              "        forked += 1\n"
              "except OSError as err:\n"
              "    print(f'fork {forked + 1} failed: {type(err).__name__}', flush=True)\n"
              "    sys.exit(1)\n")
    outcome = run_program(source, FAST)
    work, message = outcome.stdout.splitlines()
    assert outcome.status == "failed", outcome
    assert message.endswith("failed: BlockingIOError") and int(message.split()[1]) <= FAST.processes + 1
    assert _survivors(cwd=work) == []
    subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=30)  # the host still forks


@pytest.mark.parametrize("detach", [False, True], ids=["child", "setsid-child"])
def test_a_child_that_outlives_the_program_is_killed(mode, detach):
    marker = f"kvwire-orphan-{uuid.uuid4().hex}"
    source = ("import os, sys\n"
              "r, w = os.pipe()\n"
              "if os.fork() == 0:\n"
              f"    {'os.setsid()' if detach else 'pass'}\n"
              "    os.set_inheritable(w, True)\n"
              "    code = 'import os, sys, time; os.write(int(sys.argv[1]), b\"x\"); time.sleep(60)'\n"
              f"    os.execv(sys.executable, [sys.executable, '-c', code, str(w), {marker!r}])\n"
              "os.close(w)\n"
              "assert os.read(r, 1) == b'x'  # the child runs, its marker in its command line\n"
              "print('child started')\n")
    outcome = run_program(source, FAST)
    assert outcome.passed and outcome.stdout == "child started\n", outcome
    assert outcome.seconds < FAST.wall_s, "the child held the program's pipes open until the wall limit"
    assert _survivors(cmdline=marker) == []


def test_the_survivor_check_sees_a_live_process():
    marker = f"kvwire-survivor-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)", marker],
                            stdout=subprocess.PIPE, text=True)
    try:
        # once it has printed, it has exec'd: before that /proc shows the forking parent's command line
        assert proc.stdout.readline() == "up\n"
        assert _survivors(cmdline=marker, wait_s=0) == [proc.pid]  # and it kills it
        assert proc.wait(timeout=10) == -9
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_the_program_cannot_delete_files_it_does_not_own(mode):
    if not ROOT or mode.unprivileged_user is None:
        pytest.skip(f"programs run as the calling user here, who may delete its own files: {mode.describe()}")
    victim_dir = Path(tempfile.mkdtemp(prefix="kvwire-test-victim-"))  # a sibling of the sandbox's directories
    try:
        victim_dir.chmod(0o755)
        victim = victim_dir / "keep.txt"
        victim.write_text("precious")
        victim.chmod(0o644)
        source = ("import os\n"
                  f"path = {str(victim)!r}\n"
                  "print('read:', open(path).read())\n"
                  "attempts = {'remove': lambda: os.remove(path),\n"
                  "            'remove ~': lambda: os.remove(os.path.expanduser('~')),\n"
                  "            'chmod': lambda: os.chmod(path, 0o666), 'write': lambda: open(path, 'w'),\n"
                  "            'create': lambda: open(path + '.new', 'w')}\n"
                  "for name, attempt in attempts.items():\n"
                  "    try:\n"
                  "        attempt()\n"
                  "        print(name, 'done')\n"
                  "    except OSError as err:\n"
                  "        print(name, type(err).__name__)\n"
                  "assert not os.path.exists(path), 'could not delete ' + path\n")
        outcome = run_program(source, FAST)
        assert outcome.status == "failed" and outcome.reason().startswith("AssertionError: could not delete")
        lines = outcome.stdout.splitlines()
        assert lines[0] == "read: precious"  # it could reach the file: the refusals below are permissions
        assert lines[1:] == ["remove PermissionError", "remove ~ PermissionError",  # ~ is in a directory of root's
                             "chmod PermissionError", "write PermissionError", "create PermissionError"]
        assert victim.read_text() == "precious" and stat.S_IMODE(victim.stat().st_mode) == 0o644
        assert sorted(p.name for p in victim_dir.iterdir()) == ["keep.txt"]
    finally:
        for path in victim_dir.iterdir():
            path.unlink()
        victim_dir.rmdir()


def test_the_network_is_out_of_reach_in_a_fresh_namespace(mode):
    """In a fresh netns a connection to a listener on the host's loopback fails, and the listener sees
    nothing; with the namespaces turned off (the control) the same program connects."""
    if not mode.network and mode.note != TURNED_OFF:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"no network namespace for programs ({REQUIRE_ENV}=1): {mode.describe()}")
        pytest.skip(f"no fresh network namespace for programs here: {mode.describe()}")
    expect_connection = not mode.network
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        source = ("import socket\n"
                  "try:\n"
                  f"    socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
                  "except OSError as err:\n"
                  "    raise SystemExit(f'no connection: {type(err).__name__}: {err}')\n"
                  "print('connected')\n")
        outcome = run_program(source, FAST)
        listener.setblocking(False)
        try:
            listener.accept()[0].close()
            accepted = True
        except BlockingIOError:
            accepted = False
    if expect_connection:
        assert outcome.passed and accepted, outcome
    else:
        assert outcome.status == "failed" and outcome.reason().startswith("no connection"), outcome
        assert not accepted


def test_isolation_is_probed_once_and_described():
    iso = isolation()
    assert isolation() is iso
    line = iso.describe()
    assert line.startswith("each program: own process group, rlimits, ") and "\n" not in line
    assert f"python {iso.python or sys.executable}" in line
    if ROOT and iso.unprivileged_user:
        assert iso.unprivileged_user == "nobody" and "user nobody" in line
    else:
        assert iso.unprivileged_user is None and not iso.network and not iso.pid_namespace
    assert ("no network (fresh netns)" in line) == iso.network
    assert ("own PID namespace" in line) == iso.pid_namespace
    full = Isolation("nobody", True, True)
    assert full.describe().startswith(
        "each program: own process group, rlimits, user nobody, no network (fresh netns), own PID namespace, python ")


def test_a_missing_interpreter_is_a_kvwire_error(monkeypatch):
    iso = replace(isolation(), python="/nonexistent/python3")
    monkeypatch.setattr(sandbox, "isolation", lambda: iso)
    with pytest.raises(KvwireError, match="no Python interpreter at '/nonexistent/python3'") as caught:
        run_program("pass\n", FAST)
    assert caught.value.hint


def test_root_without_an_unprivileged_user_refuses(monkeypatch):
    if not ROOT:
        pytest.skip("only root switches users")
    iso = Isolation(None, False, False, note="no user 'nobody' to run programs as: refused")
    monkeypatch.setattr(sandbox, "isolation", lambda: iso)
    with pytest.raises(KvwireError, match="refusing to run a model-written program as root"):
        run_program("pass\n", FAST)


def test_outcome_reasons():
    assert Outcome("timeout", None, 20.04, "", "").reason() == "timed out after 20.0 s"
    assert Outcome("killed", -9, 1.0, "", "").reason() == "killed by SIGKILL (CPU hard limit or out of memory?)"
    assert Outcome("killed", -15, 1.0, "", "").reason() == "killed by SIGTERM"
    assert Outcome("failed", 3, 1.0, "", "\n").reason() == "exit code 3"
    assert Outcome("failed", 1, 1.0, "", "Traceback ...\nKeyError: 'x'\n\n").reason() == "KeyError: 'x'"


def test_limits_must_be_positive():
    with pytest.raises(KvwireError, match="wall_s must be positive"):
        Limits(wall_s=0)
