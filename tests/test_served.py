"""The user's command server (controller/launch/server.py, served.py): the installed `ctl` hands its command line to
a process that forked from a server with ctl already imported. Real processes throughout: the venv's `ctl`
script (or a script of the same shape over a copy of the package), its server, a local-transport container,
a pty, signals. Each test has its own socket directory (XDG_RUNTIME_DIR), so its servers are its own."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from controller.launch import served
from tests.served_world import CTL, World
from tests.served_world import served_world as _served_world

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not CTL.exists(), reason=f"no installed ctl script at {CTL} (pip install -e .)")


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    yield from _served_world(tmp_path)


def _masked(text: str) -> str:
    return re.sub(r'("seconds": )[\d.]+', r"\1N", re.sub(r"\d+\.\d+s", "N.NNs", text))


CASES = [("config", "show"), ("--json", "config", "show"), ("config", "path"), ("deploy", "loc", "--allow-dirty"),
         ("--json", "deploy", "loc", "--allow-dirty"), ("deploy", "--nosuch"), ("-i", "missing.yaml", "ping"),
         ("status", "nosuch"), ("runs",)]


def test_a_served_command_is_the_same_command(world: World) -> None:
    first = world("deploy", "loc", "--allow-dirty")  # runs here, and starts the server; the cases find it deployed
    assert first.returncode == 0, first.stderr
    before = world.up()
    for case in CASES:
        here, there = world.here(*case), world(*case)
        assert (there.returncode, _masked(there.stdout), _masked(there.stderr)) == (
            here.returncode, _masked(here.stdout), _masked(here.stderr)), case
    after = world.servers()[0]
    # each case once, and each `mux status` that read the counts
    assert after["pid"] == before["pid"] and after["served"] == int(before["served"]) + len(CASES) + 1  # type: ignore[call-overload]
    assert world("deploy", "loc", "--allow-dirty").stdout.startswith("loc")
    assert (world.root / "root" / "sub" / "a.txt").read_text() == "a\n"


def test_it_runs_in_the_clients_directory_environment_and_umask(world: World) -> None:
    world("config", "path")
    world.up()
    other = world.tmp / "elsewhere"
    other.mkdir()
    shutil.copy(world.tmp / "inventory.yaml", other / "inv2.yaml")
    shutil.copy(world.tmp / "a.txt", other / "a.txt")
    env = {**world.env, "CTL_INVENTORY": "inv2.yaml", "CTL_STATE_DIR": str(other / "state")}
    r = subprocess.run([*world.ctl, "--json", "config", "show"], capture_output=True, text=True, cwd=other, env=env,
                       timeout=60)
    shown = {s["name"]: s for s in json.loads(r.stdout)["settings"]}
    assert shown["inventory"] == {"name": "inventory", "value": "inv2.yaml", "source": "env CTL_INVENTORY"}
    r = subprocess.run([*world.ctl, "deploy", "loc", "--allow-dirty"], capture_output=True, text=True, cwd=other,
                       env=env, timeout=60, preexec_fn=lambda: os.umask(0o027))
    assert r.returncode == 0, r.stderr  # inv2.yaml found in the client's directory
    assert (other / "state").is_dir()  # the client's CTL_STATE_DIR
    assert oct((world.root / "root" / "sub").stat().st_mode & 0o777) == oct(0o750)  # made under the client's umask
    assert world.servers()[0]["served"] >= 3  # type: ignore[operator]


def _on_a_pty(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, bytes]:
    master, slave = pty.openpty()
    p = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 30)
        if not ready:
            p.kill()
            raise AssertionError("no output on the pty in 30 s")
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        out += data
    os.close(master)
    return p.wait(timeout=30), out


def test_on_a_terminal_it_writes_what_it_writes_here(world: World) -> None:
    world("config", "path")
    world.up()
    env = {**world.env, "TERM": "xterm-256color", "COLUMNS": "120"}
    here = _on_a_pty([sys.executable, "-m", "controller", "config", "show"], world.tmp, env)
    there = _on_a_pty([*world.ctl, "config", "show"], world.tmp, env)
    assert here == there and b"\x1b[" in there[1]  # the same bytes, colour included: it saw a terminal


def _dashboard(world: World, env: dict[str, str], preexec: Callable[[], object] | None = None,
               ) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen([*world.ctl, "--json", "dashboard", "--port", "0"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=world.tmp, env=env, preexec_fn=preexec)
    assert p.stdout is not None
    text = ""
    for line in p.stdout:  # one JSON document, indented: read to its closing brace
        text += line
        if line.startswith("}"):
            break
    assert text, p.stderr.read() if p.stderr else ""
    return p, int(json.loads(text)["port"])


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize("how", ["here", "served"])
def test_ctrl_c_reaches_the_served_command(world: World, how: str) -> None:
    world("config", "path")
    world.up()
    p, port = _dashboard(world, {**world.env, "CTL_PERSIST": "0"} if how == "here" else world.env)  # 0: not served
    assert _listening(port)
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=30) == 0  # the dashboard stops on Ctrl-C and exits 0, in both
    assert not _listening(port)
    if how == "served":
        assert world.servers()[0]["running"] == 1  # only the `mux status` asking


def test_a_killed_client_takes_its_command_along(world: World) -> None:
    world("config", "path")
    world.up()
    p, port = _dashboard(world, world.env)
    assert world.servers()[0]["running"] == 2  # the dashboard, and the `mux status` asking
    p.kill()
    p.wait(timeout=10)
    deadline = time.time() + 10
    while _listening(port) and time.time() < deadline:
        time.sleep(0.05)
    assert not _listening(port)
    assert world.servers()[0]["running"] == 1


def _limits(pid: int, what: str) -> tuple[str, str]:
    with open(f"/proc/{pid}/limits") as f:
        row = next(line for line in f if line.startswith(what))
    soft, hard = row[len(what):].split()[:2]
    return soft, hard


def test_a_served_command_has_the_clients_resource_limits(world: World) -> None:
    """`ulimit -n N; ctl ...` holds for the command the server forks, not the limits of whichever command started
    the server: a soft limit is set in the forked command; other hard limits (which only CAP_SYS_RESOURCE may
    raise) get a server of their own."""
    import resource

    world("config", "path")
    server = int(world.up()["pid"])  # type: ignore[call-overload]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, 300)
    p, _ = _dashboard(world, world.env, preexec=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)))
    try:
        assert world.servers()[0]["running"] == 2  # served: the dashboard, and the `mux status` asking
        kids = [pid for pid in _pids() if _ppid(pid) == server]
        assert len(kids) == 1, kids
        assert _limits(kids[0], "Max open files") == (str(low), str(hard))
        assert _limits(server, "Max open files") == (str(soft), str(hard))  # the server's own are its own
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(timeout=30)
    lower = min(hard, 3000)
    r = world("config", "path",
              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, lower), lower)))
    assert r.returncode == 0, r.stderr
    deadline = time.time() + 20
    while len(found := world.servers()) < 2 and time.time() < deadline:  # it ran itself, and started its own
        time.sleep(0.05)
    assert len(found) == 2, found
    other = next(int(d["pid"]) for d in found if d["pid"] != server)  # type: ignore[call-overload]
    assert _limits(other, "Max open files")[1] == str(lower)


def _pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def test_limits_a_server_cannot_give_are_refused() -> None:
    import resource

    from controller.launch.server import limits_refusal

    mine = served.rlimits()
    assert limits_refusal(mine) == ""
    assert limits_refusal({**mine, "RLIMIT_CORE": [0, 0]}) == ""  # lower: what setrlimit allows anyone
    soft, hard = mine["RLIMIT_NOFILE"]
    if hard != resource.RLIM_INFINITY:
        for above in (hard + 1, resource.RLIM_INFINITY):
            assert limits_refusal({**mine, "RLIMIT_NOFILE": [soft, above]}) == (
                "RLIMIT_NOFILE: a hard limit above the server's")
    for bad in (None, [], {**mine, "RLIMIT_NOFILE": [1]}, {**mine, "RLIMIT_NOFILE": [1, "2"]},
                {k: v for k, v in mine.items() if k != "RLIMIT_AS"}):
        assert limits_refusal(bad) == "a request without its resource limits"


def test_a_killed_server_is_replaced_and_a_stopped_one_is_gone(world: World) -> None:
    world("config", "path")
    first = world.up()
    os.kill(int(first["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
    r = world("config", "path")  # its socket is left behind: refused, so this runs here and starts another
    assert r.returncode == 0 and r.stdout.strip().endswith("no-config.yaml"), r.stderr
    second = world.up()
    assert second["pid"] != first["pid"]
    stop = world("mux", "stop")
    assert f"command server: stopped (pid {second['pid']})" in stop.stdout or (
        "command server: stopping" in stop.stdout), stop.stdout
    deadline = time.time() + 10
    while time.time() < deadline and list(world.sockets.glob("cmd-*.sock")):
        time.sleep(0.05)
    assert not list(world.sockets.glob("cmd-*.sock"))
    r = world("mux", "status")
    assert "command server" not in r.stdout  # `mux` commands start none
    assert not [p.name for p in world.sockets.glob("cmd-*")]  # nor is its lock or (empty) log left behind


def test_json_mux_status_and_stop_name_the_command_server(world: World) -> None:
    """`ctl --json mux status` says what the text says of the command server; `ctl --json mux stop` which it
    stopped. No host was used here: no session."""
    world("config", "path")
    pid = world.up()["pid"]
    doc = json.loads(world("--json", "mux", "status").stdout)
    assert doc["sessions"] == [] and doc["servers_failed"] == []
    assert [(d["pid"], d["running"]) for d in doc["servers"]] == [(pid, 1)]  # that status, served by it
    assert [d["pid"] for d in world.servers()] == [pid]
    stop = json.loads(world("--json", "mux", "stop").stdout)
    assert stop == {"sessions": [], "servers": [{"pid": pid, "running": 0}]}


def test_a_variable_its_imports_read_must_match(world: World) -> None:
    world("config", "path")
    before = world.up()
    r = world("config", "show", env={**world.env, "TYPER_USE_RICH": "0"})  # typer reads it at import
    assert r.returncode == 0
    after = world.servers()
    assert len(after) == 1 and after[0]["served"] == int(before["served"]) + 1  # type: ignore[call-overload]
    # only the `mux status` above was served; the command with TYPER_USE_RICH ran here, and started no server


def _forked_deploy(world: World) -> socket.socket:
    """A client of its own (not ctl's) that asks the server to run `ctl deploy loc` and reads "pid N": the
    server has forked, and the fork waits for this client's go."""
    world("config", "path")
    world.up()
    path = next(world.sockets.glob("cmd-*.sock"))
    msg = served.request({"op": "run", "key": path.name[4:-5], "argv": [str(CTL), "deploy", "loc", "--allow-dirty"],
                          "env": world.env, "umask": 0o022, "rlimits": served.rlimits()})
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    cwd = os.open(world.tmp, os.O_PATH | os.O_DIRECTORY)
    devnull = os.open(os.devnull, os.O_RDWR)
    socket.send_fds(s, [msg], [devnull, devnull, devnull, cwd])
    os.close(cwd)
    os.close(devnull)
    assert s.recv(100).startswith(b"pid ")
    return s


def test_no_go_no_command(world: World) -> None:
    """A client that gives up after the fork (no "go") never has its command run there."""
    s = _forked_deploy(world)
    s.close()
    deadline = time.time() + 10
    while time.time() < deadline and world.servers()[0]["running"] != 1:
        time.sleep(0.05)
    assert world.servers()[0]["running"] == 1
    assert not (world.root / "root" / "sub").exists()  # the deploy never ran
    # the same request from its owner is run: the uid, not the request, was refused
    s = _forked_deploy(world)
    s.sendall(b"go\n")
    s.settimeout(60)
    assert s.recv(100) == b"exit 0\n"
    s.close()
    assert (world.root / "root" / "sub" / "a.txt").read_text() == "a\n"


PEER = """\
import os, socket, sys
msg = sys.stdin.buffer.read()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
s.connect(sys.argv[1])
devnull, cwd = os.open(os.devnull, os.O_RDWR), os.open("/", os.O_PATH | os.O_DIRECTORY)
try:
    socket.send_fds(s, [msg], [devnull, devnull, devnull, cwd])
    got = s.recv(100)
except OSError as e:  # the server closed it before reading everything: a reset
    got = type(e).__name__.encode()
print(os.getuid(), got)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK),
                    reason="a peer of another uid needs root (to become `nobody`) and /usr/bin/python3")
def test_a_peer_of_another_uid_is_dropped_unanswered(world: World) -> None:
    """The socket's 0600 in a 0700 directory keep other users out; behind them the server checks the peer's uid
    (SO_PEERCRED) itself. Here `nobody` gets through to the very socket (a hard link, the socket's mode opened for
    the test), sends a whole, valid request, and is dropped: no fork, nothing run; the owner's next command is
    served by the same server."""
    world("config", "path")
    before = world.up()
    path = next(world.sockets.glob("cmd-*.sock"))
    msg = served.request({"op": "run", "key": path.name[4:-5], "argv": [str(CTL), "deploy", "loc", "--allow-dirty"],
                          "env": world.env, "umask": 0o022, "rlimits": served.rlimits()})
    door = Path(tempfile.mkdtemp(prefix="ctl-peer-"))
    os.chmod(door, 0o711)
    mode = path.stat().st_mode & 0o777
    try:
        os.link(path, door / "s.sock")
        os.chmod(path, 0o666)
        r = subprocess.run(["/usr/bin/python3", "-I", "-S", "-c", PEER, str(door / "s.sock")], input=msg,
                           capture_output=True, timeout=60, user=65534, group=65534, extra_groups=[])
    finally:
        os.chmod(path, mode)
        shutil.rmtree(door)
    assert r.returncode == 0, r.stderr
    # closed unanswered: an empty read, or (closed before it read it all) a reset or a broken pipe on the send
    assert r.stdout.decode().split(" ", 1) in (["65534", "b''\n"], ["65534", "b'ConnectionResetError'\n"],
                                               ["65534", "b'BrokenPipeError'\n"]), r.stdout
    after = world.servers()
    assert [d["pid"] for d in after] == [before["pid"]]
    assert after[0]["served"] == int(before["served"]) + 1  # type: ignore[call-overload]  # the `mux status` only
    assert after[0]["running"] == before["running"]  # nothing forked for it
    assert not (world.root / "root" / "sub").exists()  # the deploy never ran


def _own_copy(world: World) -> Path:
    """A copy of the package and a `ctl` script of pip's shape over it: files a test may change."""
    lib = world.tmp / "lib"
    shutil.copytree(REPO / "controller", lib / "controller", ignore=shutil.ignore_patterns("__pycache__"))
    script = world.tmp / "bin" / "ctl"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(1, {str(lib)!r})\n"
                      "from controller.launch.main import main\nsys.exit(main())\n")
    script.chmod(0o755)
    return lib


def test_a_changed_ctl_gets_a_server_of_its_own(world: World) -> None:
    lib = _own_copy(world)
    world.ctl = [str(world.tmp / "bin" / "ctl")]
    world("config", "path")
    first = world.up()
    r = world("--json", "config", "show")
    assert r.returncode == 0 and world.servers()[0]["served"] == int(first["served"]) + 2  # type: ignore[call-overload]
    changed = lib / "controller" / "cli" / "config.py"
    changed.write_text(changed.read_text() + "\n# changed\n")
    r = world("config", "path")  # the old server is not this ctl's: runs here, and starts this one's
    assert r.returncode == 0
    deadline = time.time() + 20
    while time.time() < deadline and len(list(world.sockets.glob("cmd-*.sock"))) < 2:
        time.sleep(0.05)
    pids = {int(d["pid"]) for d in world.servers()}  # type: ignore[call-overload]
    assert len(pids) == 2 and int(first["pid"]) in pids  # type: ignore[call-overload]


def test_python_dash_m_is_never_served(world: World) -> None:
    r = subprocess.run([sys.executable, "-m", "controller", "config", "path"], capture_output=True, text=True,
                       cwd=world.tmp, env={**world.env, "PYTHONPATH": str(REPO)}, timeout=60)
    assert r.returncode == 0
    assert not (world.sockets.exists() and list(world.sockets.glob("cmd-*.sock")))
    # nor later: a start it had asked for would be under way by now; the installed ctl's, asked for after it,
    # comes up alone, and only one server's log was ever opened (a start opens its log first)
    assert world("config", "path").returncode == 0
    world.up()
    assert len(list(world.sockets.glob("cmd-*.sock"))) == 1 and len(list(world.sockets.glob("cmd-*.log"))) == 1


def test_many_commands_at_once(world: World) -> None:
    world("config", "path")
    before = world.up()
    procs = [subprocess.Popen([*world.ctl, "--json", "config", "show"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=world.tmp, env=world.env) for _ in range(32)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs if e]
    assert all(json.loads(o)["settings"][0]["value"] == "inventory.yaml" for o, _ in outs)
    assert world.servers()[0]["served"] == int(before["served"]) + 33  # type: ignore[call-overload]



def test_a_client_that_trickles_its_request_holds_back_no_other_and_is_dropped(world: World) -> None:
    """A process of the same user that connects and sends its request a byte at a time (or nothing: hung,
    stopped with Ctrl-Z) is read as its bytes come, beside every other client, and dropped once REQUEST_WAIT
    has passed without the whole request."""
    import threading

    world("config", "path")
    before = world.up()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(next(world.sockets.glob("cmd-*.sock"))))
    ended = threading.Event()
    head = served.MAGIC + (1000).to_bytes(4, "big")  # a request of 1000 bytes, that never comes whole

    def trickle() -> None:
        deadline = time.time() + 30
        try:
            for b in head + b"x" * 1000:
                sock.sendall(bytes([b]))
                if time.time() > deadline:
                    return
                time.sleep(0.3)
        except OSError:  # the server closed it
            ended.set()

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:
        r = world("--json", "config", "show")
        assert r.returncode == 0, r.stderr
        assert trickler.is_alive() and not ended.is_set()  # served while the trickle went on (it held the server)
        assert world.servers()[0]["served"] == int(before["served"]) + 2  # type: ignore[call-overload]
        assert ended.wait(20), "the trickling connection was never dropped"
    finally:
        sock.close()
    logs = "".join(p.read_text() for p in world.sockets.glob("cmd-*.log"))
    assert "a request dropped: not all of it came within 5 s" in logs, logs


def test_a_signal_ignored_by_the_client_is_ignored_by_its_command(world: World) -> None:
    """`nohup ctl dashboard`: SIGHUP is ignored by the client and by the command the server forked for it."""
    world("config", "path")
    server = int(world.up()["pid"])  # type: ignore[call-overload]
    p, port = _dashboard(world, world.env, preexec=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    forked = [int(c) for c in Path(f"/proc/{server}/task/{server}/children").read_text().split()]
    assert len(forked) == 1
    p.send_signal(signal.SIGHUP)
    os.kill(forked[0], signal.SIGHUP)
    time.sleep(0.5)
    assert p.poll() is None and _listening(port)
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=30) == 0 and not _listening(port)


def test_a_go_that_comes_late_still_runs_the_command(world: World) -> None:
    """The fork waits for its client's go as long as the client is there (stopped by Ctrl-Z, a loaded machine)."""
    s = _forked_deploy(world)
    time.sleep(5.5)  # past the 5 s a client itself waits for "pid": no deadline of its own on the server side
    s.sendall(b"go\n")
    s.settimeout(60)
    assert s.recv(100) == b"exit 0\n"
    s.close()
    assert (world.root / "root" / "sub" / "a.txt").read_text() == "a\n"


def test_the_server_keeps_nothing_of_the_command_that_started_it(world: World) -> None:
    """Neither a descriptor (a lock, a pipe) nor a signal the first command was started ignoring lives on in the
    server, or in the commands it forks later."""
    r, w = os.pipe()
    try:
        p = subprocess.Popen([*world.ctl, "config", "path"], cwd=world.tmp, env=world.env, pass_fds=(w,),
                             stdout=subprocess.DEVNULL,
                             preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN))
        os.close(w)
        assert p.wait(timeout=60) == 0
        server = int(world.up()["pid"])  # type: ignore[call-overload]
        ready, _, _ = select.select([r], [], [], 10)
        assert ready and os.read(r, 1) == b""  # nobody holds the pipe's write end any more
    finally:
        os.close(r)
    d, port = _dashboard(world, world.env)
    (forked,) = [int(c) for c in Path(f"/proc/{server}/task/{server}/children").read_text().split()]
    os.kill(forked, signal.SIGUSR1)  # default action: it ends, as ctl in its own process would
    assert d.wait(timeout=30) == -signal.SIGUSR1  # and its client leaves the same way
    assert not _listening(port)


def test_a_symlinked_ctl_is_served(world: World) -> None:
    """pipx and `uv tool` put a link to the script on PATH."""
    link = world.tmp / "bin-link" / "ctl"
    link.parent.mkdir()
    link.symlink_to(CTL)
    world.ctl = [str(link)]
    world("config", "path")
    before = world.up()
    assert world("config", "path").returncode == 0
    assert world.servers()[0]["served"] == int(before["served"]) + 2  # type: ignore[call-overload]


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_server_idles_while_a_long_command_runs_and_a_dead_one_leaves_it_stoppable(world: World) -> None:
    world.env["CTL_PERSIST"] = "1"  # the server's idle time: a command outlives it
    world("config", "path")
    server = int(world.up()["pid"])  # type: ignore[call-overload]
    p, port = _dashboard(world, world.env)
    before = _cpu(server)
    time.sleep(3)
    assert _cpu(server) - before < 0.5  # waiting, not spinning (a spinning one uses ~3 s: a wide bound, no speed)
    os.kill(server, signal.SIGKILL)
    p.send_signal(signal.SIGINT)  # the client signals its command itself: no server needed
    assert p.wait(timeout=30) == 1  # its exit status went with the server: said, and 1
    assert p.stderr is not None and "ended without the command's exit status" in p.stderr.read()
    assert not _listening(port)


def test_a_request_still_coming_when_the_idle_time_ends_is_waited_for_not_spun_on(world: World) -> None:
    world.env["CTL_PERSIST"] = "1"  # the server's idle time ends while the request below is still pending
    world("config", "path")
    server = int(world.up()["pid"])  # type: ignore[call-overload]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(next(world.sockets.glob("cmd-*.sock"))))  # and says nothing
    try:
        before = _cpu(server)
        time.sleep(3)
        assert _cpu(server) - before < 0.5  # waiting, not spinning (a spinning one uses ~3 s: a wide bound, no speed)
        assert sock.recv(1) == b""  # dropped at its deadline, and the idle server gone with it
    finally:
        sock.close()
    deadline = time.time() + 10
    while os.path.exists(f"/proc/{server}") and time.time() < deadline:
        time.sleep(0.05)
    assert not world.servers()


@pytest.mark.parametrize("body", [b"[1]", b'"run"', b"{", b"\xff"])
def test_a_request_that_is_not_a_json_object_is_dropped_and_the_server_goes_on(world: World, body: bytes) -> None:
    world("config", "path")
    before = world.up()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(next(world.sockets.glob("cmd-*.sock"))))
        sock.sendall(served.MAGIC + len(body).to_bytes(4, "big") + body)
        assert sock.recv(1) == b""  # dropped
    r = world("config", "path")
    assert r.returncode == 0, r.stderr
    after = world.servers()
    assert [d["pid"] for d in after] == [before["pid"]]
    assert after[0]["served"] == int(before["served"]) + 2  # type: ignore[call-overload]


def test_times_are_shown_in_the_clients_time_zone(world: World) -> None:
    (world.tmp / "rb.yaml").write_text("name: t\nsteps:\n  - deploy: {containers: [loc], allow_dirty: true}\n")
    assert world("runbook", "run", "rb.yaml").returncode == 0  # starts the server (no TZ in its environment)
    world.up()
    shown = {}
    for tz in ("UTC", "Asia/Tokyo"):
        env = {**world.env, "TZ": tz}
        there = world("runbook", "history", env=env)
        here = subprocess.run([sys.executable, "-m", "controller", "runbook", "history"], capture_output=True,
                              text=True, cwd=world.tmp, env=env, timeout=60)
        assert there.returncode == 0 and there.stdout == here.stdout, (tz, there.stdout, here.stdout)
        shown[tz] = there.stdout
    assert shown["UTC"] != shown["Asia/Tokyo"]  # the hours differ: the served command read its client's TZ


def test_what_a_fan_out_and_a_supervisor_import_is_already_in_the_server() -> None:
    """A module imported inside a served command is imported again by every command (its fork keeps nothing):
    what a fan-out over several containers and `supervise --once` use comes with the server's preload."""
    code = """
import sys
from controller.launch import server
server._preload()
before = set(sys.modules)
from controller.commands import fanout
assert fanout._side_by_side(lambda i: i * 2, [1, 0], 2) == [0, 2]
import controller.commands.supervise, controller.commands.notify, controller.launch.compspec
print(sorted(set(sys.modules) - before))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_server_that_cannot_start_is_not_started_again_and_says_why(world: World) -> None:
    """A broken install (here: a module the server preloads fails to import; the commands below never need it)
    runs every command in its own process, and only the first one tries a server: each try costs ~0.5 s of CPU
    and would fail alike. `ctl mux status` says why; `ctl mux stop` lets the next command try again."""
    lib = _own_copy(world)
    world.ctl = [str(world.tmp / "bin" / "ctl")]
    broken = lib / "controller" / "core" / "render.py"
    whole = broken.read_text()
    broken.write_text(whole + "\nraise RuntimeError('half an upgrade')\n")
    assert world("config", "path").returncode == 0
    deadline = time.time() + 20
    while time.time() < deadline and not list(world.sockets.glob("cmd-*.sock.failed")):
        time.sleep(0.05)
    [marker] = list(world.sockets.glob("cmd-*.sock.failed"))
    assert "RuntimeError: half an upgrade" in marker.read_text()
    log = Path(str(marker)[:-len(".sock.failed")] + ".log")
    assert "Traceback" in log.read_text()
    size = log.stat().st_size
    for _ in range(3):
        r = world("config", "path")
        assert r.returncode == 0, r.stderr
    time.sleep(1.0)  # a server start, had one been asked for, writes to the log at once
    assert log.stat().st_size == size and not list(world.sockets.glob("cmd-*.sock"))
    status = world("mux", "status")
    assert "command server: could not start (RuntimeError: half an upgrade)" in status.stdout
    doc = json.loads(world("--json", "mux", "status").stdout)
    assert doc["servers"] == [] and [(d["why"], d["log"]) for d in doc["servers_failed"]] == [
        ("RuntimeError: half an upgrade", str(log))]
    broken.write_text(whole)  # mended: another key, whose server starts; the old key's failure is not this ctl's
    assert world("config", "path").returncode == 0
    world.up()
    assert "could not start" not in world("mux", "status").stdout and marker.exists()
    assert world("mux", "stop").returncode == 0
    assert not marker.exists()
