"""Staying agents: ctl's real host relay (controller/farside/relay/, run here as on a host) answering agent
requests (A frames) with agents that stay, spoken to frame by frame. The real agent's answers are compared with
the ones of its own exec; misbehaving agents (sources written here) die, hang, flood or lie."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import resource
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from controller.remote.client import VERB_AT, agent_argv, agent_source
from controller.transport.relay import BOOT, HEADER, frames, relay_source
from tests.helpers import wait_for
from tests.relay_fakes import FAKE, FAKE_AT, fake

Answer = tuple[bytes, bytes, int]  # stdout, stderr, exit status


class Relay:
    """hostrelay.py in a subprocess, its frames read by a thread and kept per stream id."""

    def __init__(self, nofile: int | None = None) -> None:
        """nofile: the relay's limit of open descriptors (a host's own may be as low as 1024)."""
        src = relay_source()

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

        self.p = subprocess.Popen([sys.executable, "-I", "-S", "-c", BOOT, str(len(src))], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, preexec_fn=limit)
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(src)
        self.p.stdin.flush()
        self.cond = threading.Condition()
        self.got: dict[int, list[tuple[bytes, bytes]]] = {}
        self.stats: list[dict[str, Any]] = []
        self.next = 1
        out = self.p.stdout
        threading.Thread(target=self._read, args=(out,), daemon=True).start()
        self.wait(0, lambda fs: any(k == b"H" for k, _ in fs))

    def _read(self, out: Any) -> None:
        for kind, sid, data in frames(iter(lambda: os.read(out.fileno(), 1 << 16), b"")):
            with self.cond:
                if kind == b"T":
                    self.stats.append(json.loads(data))
                self.got.setdefault(sid, []).append((kind, data))
                self.cond.notify_all()

    def wait(self, sid: int, done: Any, timeout: float = 30.0) -> list[tuple[bytes, bytes]]:
        with self.cond:
            assert self.cond.wait_for(lambda: done(self.got.get(sid, [])), timeout), (sid, self.got.get(sid))
            return list(self.got[sid])

    def send(self, kind: bytes, sid: int, data: bytes = b"") -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(HEADER.pack(kind, sid, len(data)) + data)
        self.p.stdin.flush()

    def start(self, argv: Sequence[str], stdin: bytes, *, n: int | None = None, at: int = VERB_AT,
              retry: bool = True, sha: str = "") -> int:
        """Send one A request (stdin: the agent's n-byte source, then the verb's input; n: all of it unless
        given) and its input; its stream id."""
        n = len(stdin) if n is None else n
        sid, self.next = self.next, self.next + 1
        self.send(b"A", sid, json.dumps({"argv": list(argv), "at": at, "n": n, "retry": retry, "sha": sha}).encode())
        self.send(b"I", sid, stdin)
        self.send(b"C", sid)
        return sid

    def answer(self, sid: int, timeout: float = 30.0) -> Answer:
        fs = self.wait(sid, lambda fs: any(k == b"X" for k, _ in fs), timeout)
        return (b"".join(d for k, d in fs if k == b"O"), b"".join(d for k, d in fs if k == b"E"),
                int(next(d for k, d in fs if k == b"X")))

    def request(self, argv: Sequence[str], stdin: bytes, *, timeout: float = 30.0, **kw: Any) -> Answer:
        return self.answer(self.start(argv, stdin, **kw), timeout)

    def agents(self) -> list[dict[str, Any]]:
        with self.cond:
            seen = len(self.stats)
        self.send(b"T", 0)
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.stats) > seen, 10)
            return list(self.stats[-1]["agents"])

    def close(self, timeout: float = 10.0) -> int:
        assert self.p.stdin is not None
        self.p.stdin.close()
        return self.p.wait(timeout)


@pytest.fixture
def relay() -> Any:
    r = Relay()
    yield r
    if r.p.poll() is None:
        r.p.kill()
        r.p.wait()


def exec_answer(argv: Sequence[str], stdin: bytes) -> Answer:
    """What the same request gives as its own exec (no relay, no staying agent)."""
    p = subprocess.run([sys.executable if argv[0] == "python3" else argv[0], *argv[1:]], input=stdin,
                       capture_output=True, timeout=60)
    return p.stdout, p.stderr, p.returncode


def real(verb: str, *args: str, src: bytes | None = None) -> list[str]:
    """The argv ctl sends for an agent verb (for `src`, a source of another length: its N)."""
    argv = agent_argv(verb, *args)
    if src is not None:
        argv[VERB_AT - 1] = str(len(src))
    return argv


def timeless(out: bytes) -> bytes:
    """An answer without its "now" (the agent's clock when it answered), the rest byte for byte."""
    head, sep, rest = out.partition(b"\n")
    try:
        doc = json.loads(head)
    except ValueError:
        return out
    if isinstance(doc, dict):
        doc.pop("now", None)
    return json.dumps(doc, sort_keys=True).encode() + sep + rest


def test_a_staying_agent_answers_as_its_exec_would_and_stays(relay: Relay, tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"".join(b"step %d loss 1.0\n" % i for i in range(50)))
    src = agent_source()
    requests = [
        real("tailinfo", json.dumps({"root": "/", "log": str(log), "lines": 5})),
        real("tailinfo", json.dumps({"root": "/", "log": str(tmp_path / "missing.log"), "lines": 5})),
        real("hashes", "/", str(log), str(tmp_path / "nothing")),
        real("nosuchverb", "{}"),
        real("tailinfo", "{not json"),  # an exception: its traceback on stderr, status 1, the agent stays
        real("logread", json.dumps({"root": "/", "log": str(log), "offset": 10, "max_bytes": 64})),
    ]
    for argv in requests:
        staying = relay.request(argv, src)
        alone = exec_answer(argv, src)
        assert timeless(staying[0]) == timeless(alone[0]) and staying[2] == alone[2], argv[VERB_AT]
        assert staying[1].splitlines()[-1:] == alone[1].splitlines()[-1:], argv[VERB_AT]  # the same last line
    agents = relay.agents()
    assert len(agents) == 1 and agents[0]["requests"] == len(requests), agents
    assert relay.close() == 0  # end of input: the staying agent ends, and so does the relay


def test_a_staying_agent_says_how_many_requests_it_took_and_an_exec_says_nothing(relay: Relay) -> None:
    """`ctl ping` counts a first answer as a round trip only when its agent was up before: the hello says so."""
    src = agent_source()
    argv = real("hello", json.dumps({"root": "/"}))
    served = [json.loads(relay.request(argv, src)[0])["served"] for _ in range(3)]
    assert served == [1, 2, 3]
    alone = json.loads(exec_answer(argv, src)[0])
    assert alone["staying"] is False and "served" not in alone


def test_a_staying_agent_no_request_took_for_its_idle_time_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """After an upgrade, agents of the old source would stay as long as the session (a supervisor keeps it up):
    one that no request took for CTL_AGENT_IDLE_S ends when a later request comes, and is reaped; one still in
    use stays."""
    monkeypatch.setenv("CTL_AGENT_IDLE_S", "1.0")
    r = Relay()
    try:
        src, other = agent_source(), agent_source() + b"\n# the ctl before an upgrade\n"
        hello = real("hello", json.dumps({"root": "/"}))
        old_pid = json.loads(r.request(real("hello", json.dumps({"root": "/"}), src=other), other)[0])["pid"]
        new_pid = json.loads(r.request(hello, src)[0])["pid"]
        assert len(r.agents()) == 2
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # the new source's agent is used every 0.2 s; the old one is not
            assert json.loads(r.request(hello, src)[0])["pid"] == new_pid
            time.sleep(0.2)
        assert [a["pid"] for a in r.agents()] == [new_pid]
        deadline = time.monotonic() + 10
        while Path(f"/proc/{old_pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{old_pid}").exists()  # it exited and the relay reaped it: no zombie left
    finally:
        r.p.kill()
        r.p.wait()


def test_another_agent_source_gets_its_own_staying_agent(relay: Relay) -> None:
    src = agent_source()
    other = src + b"\n# another ctl build\n"
    for s in (src, other, src, other):
        assert relay.request(real("hashes", "/", "/", src=s), s)[2] == 0
    assert sorted(a["requests"] for a in relay.agents()) == [2, 2]


def test_what_a_verb_s_children_print_never_reaches_the_frames(relay: Relay) -> None:
    """A verb's child (tmux, nvidia-smi) inherits fds 0-2: a staying agent points them at /dev/null, so a child
    writing there (or reading stdin) cannot forge or eat a frame."""
    src = agent_source().replace(b'\nif __name__ == "__main__":', b'''
def tailinfo(args):
    os.system("echo forged-stdout; echo forged-stderr >&2; head -c 100 >/dev/null")
    return {"ok": True, "said": "only this"}

if __name__ == "__main__":''')
    argv = real("tailinfo", "{}", src=src)
    for _ in range(3):
        out, err, code = relay.request(argv, src)
        assert (json.loads(out), err, code) == ({"ok": True, "said": "only this"}, b"", 0)
    assert [a["requests"] for a in relay.agents()] == [3]




def test_an_agent_that_ends_is_replaced_for_a_read_and_reported_for_a_write(relay: Relay) -> None:
    argv = real("hashes", "/", "/")
    src = agent_source()
    assert relay.request(argv, src)[2] == 0
    first = relay.agents()[0]["pid"]
    os.kill(first, signal.SIGKILL)  # the container restarted, say
    time.sleep(0.2)
    assert relay.request(argv, src)[2] == 0  # a read is answered all the same, by a new staying agent
    assert [a["pid"] for a in relay.agents()] not in ([first], [])

    # One that takes the request, then dies before answering: a read runs again as its own exec; a write is not
    # run twice, and says why.
    out, err, code = relay.request(fake("die"), FAKE, n=len(FAKE), at=FAKE_AT, retry=True)
    assert (json.loads(out)["via"], code) == ("exec", 0)
    out, err, code = relay.request(fake("die"), FAKE, n=len(FAKE), at=FAKE_AT, retry=False)
    assert (out, code) == (b"", 255) and b"ctl's agent ended before it answered" in err


def test_an_agent_that_breaks_the_protocol_is_ended(relay: Relay) -> None:
    out, err, code = relay.request(fake("lie"), FAKE, n=len(FAKE), at=FAKE_AT, retry=False)
    assert code == 255 and out == b'{"ok": tr' and b"ended before it answered" in err  # never a JSON answer
    assert relay.agents() == []


def test_an_agent_that_sends_a_malformed_exit_status_is_ended(relay: Relay) -> None:
    out, err, code = relay.request(fake("minus"), FAKE, n=len(FAKE), at=FAKE_AT, retry=False, timeout=10)
    assert (out, code) == (b"", 255) and b"ended before it answered" in err
    assert relay.agents() == []


def test_a_stuck_request_given_up_ends_its_agent_and_the_relay_still_exits(relay: Relay) -> None:
    sid = relay.start(fake("hang"), FAKE, n=len(FAKE), at=FAKE_AT)
    wait_for("the request in its agent", lambda: [a["busy"] for a in relay.agents()] == [True], 30)
    relay.send(b"K", sid)  # ctl's deadline passed
    relay.wait(sid, lambda fs: any(k == b"X" for k, _ in fs), 10)  # its X still comes: the id is free again
    assert relay.agents() == []
    t0 = time.monotonic()
    assert relay.close() == 0
    assert time.monotonic() - t0 < 5


def test_busy_agents_are_capped_and_the_rest_run_as_execs(relay: Relay) -> None:
    sids = [relay.start(fake("slow"), FAKE, n=len(FAKE), at=FAKE_AT) for _ in range(6)]
    via = sorted(json.loads(relay.answer(s)[0])["via"] for s in sids)
    assert via == ["exec", "exec", "serve", "serve", "serve", "serve"]  # RESIDENT_PER_KEY = 4
    assert len(relay.agents()) == 4


def test_a_container_that_refuses_answers_as_pct_would(relay: Relay) -> None:
    """No staying agent can start (pct refuses: a stopped CT): the exec runs, and its refusal is the answer."""
    refuse = ["sh", "-c", "echo \"container '999' not running!\" >&2; exit 2", "pct",
              *real("hashes", "/", "/")]
    out, err, code = relay.request(refuse, agent_source(), n=len(agent_source()), at=4 + VERB_AT)
    assert (out, code) == (b"", 2) and b"container '999' not running!" in err
    assert relay.agents() == []


def test_a_large_input_runs_as_its_own_exec(relay: Relay) -> None:
    big = FAKE + b"x" * (9 << 20)  # past hostrelay.RESIDENT_MAX_INPUT
    assert json.loads(relay.request(fake(""), big, n=len(FAKE), at=FAKE_AT)[0])["via"] == "exec"
    assert json.loads(relay.request(fake(""), FAKE, n=len(FAKE), at=FAKE_AT)[0])["via"] == "serve"


def test_a_source_the_relay_keeps_need_not_travel_again(relay: Relay) -> None:
    """A request may leave out the agent's source (n 0, its sha256) once the relay has it; one it lacks is
    answered U (and X), never run: ctl sends it again with the source."""
    src = agent_source()
    sha = hashlib.sha256(src).hexdigest()
    argv = real("hashes", "/", "/")
    sid = relay.start(argv, b"", n=0, sha=sha)
    fs = relay.wait(sid, lambda fs: any(k == b"X" for k, _ in fs))
    assert [k for k, _ in fs] == [b"U", b"X"] and relay.agents() == []
    whole = relay.request(argv, src, sha=sha)
    assert whole[2] == 0
    assert relay.request(argv, b"", n=0, sha=sha) == whole  # the same answer, 77 KB lighter
    big = FAKE + b"x" * (9 << 20)  # its exec fallback gets the kept source in front of its input too
    relay.request(fake(""), FAKE, n=len(FAKE), at=FAKE_AT, sha=hashlib.sha256(FAKE).hexdigest())
    out = relay.request(fake(""), big[len(FAKE):], n=0, at=FAKE_AT, sha=hashlib.sha256(FAKE).hexdigest())[0]
    assert json.loads(out)["via"] == "exec"
    assert sorted(a["requests"] for a in relay.agents()) == [1, 2]  # the real agent's 2; the fake's first


def test_a_large_input_starts_its_exec_before_it_has_all_arrived(relay: Relay) -> None:
    """Input past the staying agent's limit is never gathered whole in the relay: the exec starts as soon as the
    limit is passed and takes the rest as it comes (here the exec answers before the input has even ended)."""
    for n, extra in ((len(FAKE), 9 << 20), (1 << 40, 17 << 20)):  # a huge claimed source is no larger limit
        sid, relay.next = relay.next, relay.next + 1
        relay.send(b"A", sid, json.dumps({"argv": fake(""), "at": FAKE_AT, "n": n, "retry": True}).encode())
        relay.send(b"I", sid, FAKE + b"x" * extra)  # no C
        assert json.loads(relay.answer(sid, timeout=15)[0])["via"] == "exec"
        relay.send(b"C", sid)
    assert relay.close() == 0


def _agent_stdin_full(relay: Relay, marker: bytes) -> bool:
    """A process under the relay whose command line holds `marker` has a pipe for stdin that holds all it can: the
    relay's write into it is blocked (the pipe's fill read through /proc, FIONREAD, never its bytes)."""
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or marker not in (d / "cmdline").read_bytes():
                continue
            pid = int(d.name)
            while pid > 1 and pid != relay.p.pid:
                pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(") ", 1)[1].split()[1])
            if pid != relay.p.pid:
                continue
            fd = os.open(d / "fd" / "0", os.O_RDONLY | os.O_NONBLOCK)
        except (OSError, ValueError, IndexError):
            continue
        try:
            held = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
            return bool(held >= fcntl.fcntl(fd, 1032))  # F_GETPIPE_SZ
        except OSError:
            return False
        finally:
            os.close(fd)
    return False


def test_an_agent_that_never_reads_is_given_up_at_k(relay: Relay) -> None:
    """A staying agent that does not take its source (pct hangs) or its request (a frozen container) holds the
    relay's writes: a K still ends it at once, its X comes, and the relay exits at the end of its input."""
    big = FAKE + b"#" * (1 << 20)  # more than a pipe holds
    hung = ["sh", "-c", "exec sleep 3600", *fake("")[3:]]
    deaf = fake("deaf")
    for argv, src, data, marker in ((hung, big, b"", b"sleep\x003600\x00"), (deaf, FAKE, b"y" * (1 << 20), b"deaf")):
        sid = relay.start(argv, src + data, n=len(src), at=FAKE_AT, retry=False)
        wait_for("the relay blocked on the agent's full stdin", lambda m=marker: _agent_stdin_full(relay, m), 30)  # type: ignore[misc]
        relay.send(b"K", sid)
        relay.wait(sid, lambda fs: any(k == b"X" for k, _ in fs), 5)
    t0 = time.monotonic()
    assert relay.close() == 0
    assert time.monotonic() - t0 < 5


def _in_process(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[tuple[bytes, int, bool]]]:
    """hostrelay imported here, its frames recorded with whether their stream id was still known as they went."""
    from controller import farside

    hr = farside.load("relay")

    sent: list[tuple[bytes, int, bool]] = []

    def emit(kind: bytes, sid: int, data: bytes = b"") -> None:
        with hr._children_lock:
            sent.append((kind, sid, sid in hr._children))

    monkeypatch.setattr(hr, "_emit", emit)
    return hr, sent


def test_an_exec_that_cannot_start_forgets_its_id_before_its_x(monkeypatch: pytest.MonkeyPatch) -> None:
    hr, sent = _in_process(monkeypatch)
    req = hr.AgentRequest(4001, {"argv": ["/nonexistent/ctl-pct", "x", "y"], "at": 2, "n": 1})
    req.send(b"s")
    req.close_stdin()
    req.join()
    assert [k for k, _, _ in sent] == [b"E", b"X"]
    assert sent[-1] == (b"X", 4001, False), sent  # ctl may reuse the id the moment it reads that X
    assert 4001 not in hr._children


def test_a_k_that_meets_the_request_as_its_exec_takes_over_reaches_the_exec(monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay's reader may have looked the id up just before the request handed it to its exec: the K it
    then delivers to the request still reaches the exec."""
    hr, _sent = _in_process(monkeypatch)
    req = hr.AgentRequest(4002, {"argv": [sys.executable, "-c", "import time; time.sleep(60)"], "at": 1, "n": 0})
    req.close_stdin()
    req.join()  # the exec runs, under the same id
    child = hr._children[4002]
    try:
        assert isinstance(child, hr.Child) and not child.abandoned
        req.abandon()  # the K, delivered to what the reader had looked up
        assert child.abandoned
    finally:
        child.proc.kill()
        child.join()
    assert 4002 not in hr._children


def test_staying_agents_leave_the_relay_descriptors_for_its_execs() -> None:
    """Each staying agent holds three of the relay's descriptors for as long as it stays: past a share of the
    relay's limit, a container's requests run as execs, never failing for want of a descriptor."""
    relay = Relay(nofile=64)
    try:
        answers = [relay.request(fake(f"ct{i}"), FAKE, n=len(FAKE), at=FAKE_AT) for i in range(24)]
        assert [code for _out, _err, code in answers] == [0] * 24, [err for _out, err, _code in answers]
        via = [json.loads(out)["via"] for out, _err, _code in answers]
        assert via[:4] == ["serve"] * 4 and via[-4:] == ["exec"] * 4, via
        assert relay.close() == 0
    finally:
        if relay.p.poll() is None:
            relay.p.kill()
            relay.p.wait()


def test_a_verb_that_fails_leaves_no_descriptor_behind_in_a_staying_agent(relay: Relay, tmp_path: Path) -> None:
    """An exec's leaked descriptor ends with it; a staying agent's would pile up request after request. A store
    whose "deploys" is not a directory makes storelist and apply fail after they opened "objects"."""
    store = tmp_path / "store"
    (store / "objects").mkdir(parents=True)
    (store / "deploys").write_text("not a directory")
    src = agent_source()
    requests = [real("storelist", json.dumps({"root": "/", "store": str(store)})),
                real("apply", "/", str(store), "d1")]
    relay.request(requests[0], src)  # the staying agent starts
    (pid,) = [a["pid"] for a in relay.agents()]
    before = len(os.listdir(f"/proc/{pid}/fd"))
    for _ in range(3):
        for argv in requests:
            assert relay.request(argv, src)[2] != 0
    assert [a["pid"] for a in relay.agents()] == [pid]
    assert len(os.listdir(f"/proc/{pid}/fd")) == before


def _tasks(pid: int) -> set[str]:
    """The process's threads, by id (a thread started later has an id never seen before)."""
    return set(os.listdir(f"/proc/{pid}/task"))


def test_the_threads_that_answer_are_kept_and_a_hung_request_holds_back_no_other(relay: Relay, tmp_path: Path) -> None:
    """A thread per request cost the relay's reading loop its start each time: threads that answered wait for the
    next requests instead, and one stuck in a request never makes another wait."""
    hung = relay.start(fake("hang"), FAKE, n=len(FAKE), at=FAKE_AT)
    wait_for("the hung request in its agent", lambda: [a["busy"] for a in relay.agents()] == [True], 30)
    gate = tmp_path / "gate"
    gate.mkdir()
    burst = [relay.start(fake(f"gate:{gate} #{i}"), FAKE, n=len(FAKE), at=FAKE_AT) for i in range(4)]  # 4 CTs
    # side by side, past the hung one: all 4 are in their agents at once (each waits there for the gate)
    wait_for("4 requests in their agents at once", lambda: len(list(gate.iterdir())) == 4, 60)
    (gate / "go").touch()
    assert {json.loads(relay.answer(s)[0])["via"] for s in burst} == {"serve"}
    time.sleep(0.2)  # a worker sends its X, then counts itself idle: let the last ones get there
    kept = _tasks(relay.p.pid)
    for f in gate.iterdir():  # the gate closed again; the same 4 agents take the next 4 requests
        f.unlink()
    again = [relay.start(fake(f"gate:{gate} #{i}"), FAKE, n=len(FAKE), at=FAKE_AT) for i in range(4)]
    wait_for("the 4 requests in their agents", lambda: len(list(gate.iterdir())) == 4, 60)
    assert _tasks(relay.p.pid) == kept  # by the threads that answered before: none started
    (gate / "go").touch()
    assert {json.loads(relay.answer(s)[0])["via"] for s in again} == {"serve"}
    relay.send(b"K", hung)
    relay.wait(hung, lambda fs: any(k == b"X" for k, _ in fs), 10)
    assert relay.close() == 0


# Requests that leave out a source the relay keeps, to a staying agent that is idle, are written and answered by
# the relay's reading loop itself (hostrelay._Loop), not by a worker thread. Each failure mode again, there.


def _kept(relay: Relay, mode: str) -> tuple[list[str], str]:
    """A staying fake agent for `mode`, started by a request that carries its source (a worker answers that one);
    the argv and sha256 of the requests that then leave the source out."""
    sha = hashlib.sha256(FAKE).hexdigest()
    argv = fake(mode)
    out, _err, code = relay.request(argv, FAKE, n=len(FAKE), at=FAKE_AT, sha=sha)
    assert code == 0 and json.loads(out)["via"] == "serve", out
    return argv, sha


def test_requests_to_idle_staying_agents_are_answered_without_a_thread(relay: Relay, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    kept = [_kept(relay, f"later-gate:{gate} {i}") for i in range(4)]  # 4 containers; one worker answered them
    threads = _tasks(relay.p.pid)
    sids = [relay.start(argv, b"", n=0, at=FAKE_AT, sha=sha) for argv, sha in kept]
    # side by side: all 4 are in their agents at once (as workers, 3 more threads would run now)
    wait_for("4 requests in their agents at once", lambda: len(list(gate.iterdir())) == 4, 60)
    assert _tasks(relay.p.pid) == threads
    (gate / "go").touch()
    assert [json.loads(relay.answer(s)[0])["via"] for s in sids] == ["serve"] * 4
    assert relay.close() == 0


def test_an_agent_that_ends_in_the_loop_is_replaced_for_a_read_and_reported_for_a_write(relay: Relay) -> None:
    argv, sha = _kept(relay, "later-die")
    (first,) = [a["pid"] for a in relay.agents()]
    out, _err, code = relay.request(argv, b"", n=0, at=FAKE_AT, sha=sha, retry=True)
    doc = json.loads(out)
    assert code == 0 and doc["via"] == "serve" and doc["pid"] != first  # a new staying agent answered it
    out, err, code = relay.request(argv, b"", n=0, at=FAKE_AT, sha=sha, retry=False)
    assert (out, code) == (b"", 255) and b"ctl's agent ended before it answered" in err


def test_an_agent_that_breaks_the_protocol_in_the_loop_is_ended(relay: Relay) -> None:
    argv, sha = _kept(relay, "later-lie")
    out, err, code = relay.request(argv, b"", n=0, at=FAKE_AT, sha=sha, retry=False)
    assert (out, code) == (b'{"ok": tr', 255) and b"ended before it answered" in err
    argv, sha = _kept(relay, "later-minus")
    out, err, code = relay.request(argv, b"", n=0, at=FAKE_AT, sha=sha, retry=False)
    assert (out, code) == (b"", 255) and b"ended before it answered" in err
    assert relay.agents() == []


def test_a_k_ends_an_agent_stuck_in_the_loop_and_the_relay_still_exits(relay: Relay) -> None:
    argv, sha = _kept(relay, "later-hang")
    sid = relay.start(argv, b"", n=0, at=FAKE_AT, sha=sha)
    time.sleep(0.5)
    assert [a["busy"] for a in relay.agents()] == [True]
    relay.send(b"K", sid)
    fs = relay.wait(sid, lambda fs: any(k == b"X" for k, _ in fs), 10)
    assert fs[-1] == (b"X", b"255")
    assert relay.agents() == []
    t0 = time.monotonic()
    assert relay.close() == 0
    assert time.monotonic() - t0 < 5


def test_an_answer_the_loop_reads_when_the_input_ends_still_comes(relay: Relay) -> None:
    argv, sha = _kept(relay, "later-slow")
    sid = relay.start(argv, b"", n=0, at=FAKE_AT, sha=sha)
    time.sleep(0.3)
    assert relay.p.stdin is not None
    relay.p.stdin.close()  # ctl is done (or its connection dropped) while the agent answers
    out, _err, code = relay.answer(sid, timeout=10)
    assert code == 0 and json.loads(out)["via"] == "serve"
    assert relay.p.wait(10) == 0


def test_a_large_answer_and_a_request_its_agent_s_pipe_cannot_hold(relay: Relay) -> None:
    argv, sha = _kept(relay, "later-big")
    out, _err, code = relay.request(argv, b"", n=0, at=FAKE_AT, sha=sha)
    assert code == 0 and out.startswith(b"x" * 300000) and json.loads(out[300000:])["via"] == "serve"
    argv, sha = _kept(relay, "small-pipe")
    out, _err, code = relay.request(argv, b"y" * 20000, n=0, at=FAKE_AT, sha=sha)  # more than its pipe holds
    doc = json.loads(out)
    assert (code, doc["via"], doc["pipe"]) == (0, "serve", 4096) and doc["got"] > 20000


def test_what_the_loop_emits_for_one_poll_goes_out_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames the reading loop emits while it handles one poll's events are held and written together (one SSH
    packet for several answers); another thread's frames are written as they come."""
    from controller import farside

    hr = farside.load("relay")

    writes: list[bytes] = []

    class Out:
        def write(self, b: bytes) -> None:
            writes.append(bytes(b))

        def flush(self) -> None:
            pass

    monkeypatch.setattr(hr.sys, "stdout", type("S", (), {"buffer": Out()})())
    me = threading.get_ident()
    hr._held[me] = []
    hr._emit(b"O", 7, b"seven")
    hr._emit(b"X", 7, b"0")
    other = threading.Thread(target=hr._emit, args=(b"X", 8, b"1"))
    other.start()
    other.join()
    assert writes == [HEADER.pack(b"X", 8, 1) + b"1"]  # a worker's frame: at once
    hr._Loop.release()
    assert writes[1:] == [HEADER.pack(b"O", 7, 5) + b"seven" + HEADER.pack(b"X", 7, 1) + b"0"]
    assert me not in hr._held
    hr._emit(b"X", 9, b"2")  # no longer held
    assert len(writes) == 3
