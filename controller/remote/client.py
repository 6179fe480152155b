"""The one client of ctl's agent (controller/farside/agent/) and of the environment probe (probe_env.py).

`Agent.of(t)`, a container's one client for the whole command, speaks to the agent there over one exec per
verb: it builds the argv (the agent's source travels on stdin, so nothing is installed in the container), adds
the container's root (`/`, or the stand-in directory of a `local` target), parses every answer, and turns a
refusal into the CtlError subclass its code names, from one table (`ERRORS`). A reply that is not what the agent
writes (no JSON, missing keys, a short read) is one line naming the container, never a traceback.

The agent's wire format: `python3 -I -S -c BOOT N VERB ARGS...`; stdin is N bytes of agent source, then
the verb's input. Positional verbs (hashes, sync, apply) take ROOT first; the others take one JSON
argument that holds "root". Each answers one JSON document on stdout ({"ok": bool, "error": text,
"code": name, ...}), except logread and poll (a JSON header line, then raw bytes) and sync (a conversation:
one JSON line each way, then a tar; `Sync` holds it, and answers with frozen replies: SyncPlan, ApplyReply).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from controller.errors import (
    BusyError,
    ClobberError,
    ConnectionFailed,
    CtlError,
    DiskError,
    EnvMismatch,
    InputError,
    OutputTooLarge,
    RemoteCommandError,
    VerifyError,
)
from controller.farside import boot, source
from controller.transport.base import AgentStart, Duplex, Result, Submitted, Transport

BOOT = boot("agent")  # controller/farside/__init__.py says what it does
T = TypeVar("T")

#: The agent's refusal codes and what ctl raises for each: (exception, text put before the agent's message).
ERRORS: Mapping[str, tuple[type[CtlError], str]] = {
    "clobber": (ClobberError, ""),  # would overwrite a log, record, cache or file
    "busy": (BusyError, ""),  # a tmux session of that name exists
    "missing": (InputError, ""),  # no such log, cache, saved cache or tool
    "verify": (VerifyError, ""),  # a hash or read-back did not match
    "disk": (DiskError, "container disk full: "),  # ENOSPC / EDQUOT
    "torch": (EnvMismatch, ""),  # a cache of another torch build
    "symlink": (InputError, ""),  # a destination's path goes through a symlink the inventory does not allow
}

POSITIONAL = frozenset({"hashes", "sync", "apply"})

#: Verbs that only read: a staying agent that had ended before such a request may have it run again.
READ_ONLY = frozenset({"hello", "hashes", "probe", "runstate", "tailinfo", "logread", "poll", "storelist", "cachestat",
                       "envfacts", "ckptscan"})
#: Requests with more input than this (an apply's tar, a checkpoint) run as their own exec: a staying agent
#: takes its whole input before it starts (the relay's own is larger: farside/relay/agents.py RESIDENT_MAX_INPUT).
STAYING_MAX_INPUT = 1 << 20
VERB_AT = 6  # agent_argv(): python3 -I -S -c BOOT N VERB ...

#: The largest answer (stdout + stderr) ctl accepts from one agent verb; the raw log bytes of logread and poll
#: (at most the "max_bytes" asked for) come on top.
#: Every verb answers far less; more is a foreign python3 or a runaway, refused with one line.
MAX_REPLY = 16 << 20


class AgentReplyError(CtlError):
    """The agent answered something it never writes: a bug, a foreign python3, or a cut connection."""


def agent_source() -> bytes:
    return source("agent")


@functools.cache
def agent_sha() -> str:
    return hashlib.sha256(agent_source()).hexdigest()


def agent_argv(verb: str, *args: str) -> list[str]:
    # -I -S: the agent is stdlib only; ignore PYTHON* variables and site-packages of the container.
    return ["python3", "-I", "-S", "-c", BOOT, str(len(agent_source())), verb, *args]


_ONE_CLIENT = threading.Lock()


class Agent:
    """ctl's agent in one container, reached through transport `t`. Commands take the transport's one client,
    `Agent.of(t)`, rather than building another."""

    def __init__(self, t: Transport) -> None:
        self.t = t
        self.name = t.name
        self.root = t.path("/")
        # The last answer's time as its transport took it: from the request's start to its end being read. A
        # caller's own clock would also count, for requests answered together, the callbacks run before its own.
        self.seconds = 0.0

    @classmethod
    def of(cls, t: Transport) -> Agent:
        """The one client of t's agent, made at the first use and kept on t (the Pool hands a command the same
        transport for a container throughout, so the whole command speaks through one client)."""
        got = t.agent_client
        if isinstance(got, Agent):
            return got
        with _ONE_CLIENT:  # two threads of a fan-out that share a container make one client, not two
            if not isinstance(t.agent_client, Agent):
                t.agent_client = cls(t)
            made = t.agent_client
        assert isinstance(made, Agent)
        return made

    # --- building requests -------------------------------------------------------------------------

    def argv(self, verb: str, args: Mapping[str, Any] | Sequence[str] = ()) -> list[str]:
        if isinstance(args, Mapping):
            return agent_argv(verb, json.dumps({"root": self.root, **args}))
        assert verb in POSITIONAL, f"agent verb {verb} takes one JSON argument"
        return agent_argv(verb, self.root, *args)

    def shell_line(self, verb: str, *args: str) -> str:
        """The copy-pasteable line a user could run by hand (stdin: agent source + the verb's input)."""
        return self.t.script(self.argv(verb, args))

    # --- one request, one answer ---------------------------------------------------------------------

    def call(self, verb: str, args: Mapping[str, Any] | Sequence[str] = (), *, payload: bytes = b"",
             timeout: float | None = None, check: bool = True) -> dict[str, Any]:
        """Run one verb; its answer. With `check`, a refusal ({"ok": false}) raises what its code names."""
        return self.answer(verb, self.exec(verb, self.argv(verb, args), agent_source() + payload, timeout), check)

    def answer(self, verb: str, res: Result, check: bool = True) -> dict[str, Any]:
        """A verb's answer document; with `check`, its refusal raised."""
        self.seconds = res.seconds
        doc = self.parse(verb, res)
        if check and not doc.get("ok"):
            raise self.error(doc)
        return doc

    def submit(self, verb: str, args: Mapping[str, Any] | Sequence[str],
               on_done: Callable[[dict[str, Any] | CtlError], None]) -> Submitted | None:
        """call(verb, args) without waiting, where the transport's host session keeps a staying agent: on_done
        gets the answer, or the error call() would have raised, from the session's reader thread (so it must
        neither raise nor wait). None where the transport cannot: use call(). The deadline is the caller's to
        keep (the handle's expire())."""
        return self._submit(verb, self.argv(verb, args), MAX_REPLY, lambda res: self.answer(verb, res), on_done)

    def submit_read(self, verb: str, args: Mapping[str, Any],
                    on_done: Callable[[tuple[dict[str, Any], bytes, int, int] | CtlError], None]
                    ) -> Submitted | None:
        """read(verb, args) as submit() does call(): on_done gets read()'s tuple or the error it would have
        raised."""
        argv = self.argv(verb, args)
        return self._submit(verb, argv, self._read_limit(args),
                            lambda res: self.read_answer(verb, argv, res), on_done)

    def _submit(self, verb: str, argv: list[str], limit: int, parse: Callable[[Result], T],
                on_done: Callable[[T | CtlError], None]) -> Submitted | None:
        def done(got: Result | CtlError) -> None:
            if isinstance(got, OutputTooLarge):
                got = self.too_large(f"agent {verb}", limit)
            if isinstance(got, CtlError):
                return on_done(got)
            try:
                answer = parse(got)
            except CtlError as e:
                return on_done(e)
            return on_done(answer)

        return self.t.submit_agent(argv, self._start(verb), stdin=agent_source(), on_done=done, max_output=limit)

    @staticmethod
    def _start(verb: str, reads_only: bool | None = None) -> AgentStart:
        """Where a request's verb and the agent's source sit in its argv and stdin; `reads_only` (default: the verb
        is in READ_ONLY) lets the relay send it again to a new agent."""
        return AgentStart(VERB_AT, len(agent_source()), verb in READ_ONLY if reads_only is None else reads_only,
                          agent_sha())

    def exec(self, verb: str, argv: list[str], stdin: bytes, timeout: float | None, *,
             reads_only: bool | None = None, limit: int = MAX_REPLY) -> Result:
        """One request, answered by the container's staying agent when its transport keeps one (see
        controller/farside/relay/), else by an agent of its own exec: the same Result either way.
        `reads_only` (default: the verb is in READ_ONLY) lets the relay send it again to a new agent. A reply
        past `limit` bytes is stopped as it arrives and refused in one line: a container never makes ctl hold
        more than that."""
        n = len(agent_source())
        try:
            if len(stdin) - n > STAYING_MAX_INPUT:
                return self.t.run(argv, stdin=stdin, timeout=timeout, max_output=limit)
            assert argv[VERB_AT] == verb
            return self.t.run_agent(argv, self._start(verb, reads_only), stdin=stdin, timeout=timeout,
                                    max_output=limit)
        except OutputTooLarge:
            raise self.too_large(f"agent {verb}", limit) from None

    def sync(self, args: Sequence[str], header: bytes, tar: bytes | None = None, *, timeout: float | None = None
             ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Verb sync as ONE request instead of a conversation (for a staying agent): its header line, then, with
        `tar`, the "apply" line and that tar. (Its plan line {"have", "need"}, its final answer.) Without `tar` it
        changes nothing: the plan is all it gives."""
        payload = header if tar is None else header + b"apply\n" + tar
        res = self.exec("sync", self.argv("sync", args), agent_source() + payload, timeout,
                        reads_only=tar is None)
        lines = res.stdout.strip().splitlines()
        plan = self.json_line(lines[0]) if len(lines) > 1 else None
        final = self.json_line(lines[-1]) if len(lines) > 1 else None
        if plan is None or final is None:
            self.fail("sync", res)
        return plan, final

    def read(self, verb: str, args: Mapping[str, Any], *, timeout: float | None = None
             ) -> tuple[dict[str, Any], bytes, int, int]:
        """A verb that answers a JSON header line then raw bytes (logread): (header, bytes, wire out, wire in).
        The header's "length" must match what arrived: a short read is a dropped connection."""
        argv = self.argv(verb, args)
        return self.read_answer(verb, argv, self.exec(verb, argv, agent_source(), timeout,
                                                      limit=self._read_limit(args)))

    @staticmethod
    def _read_limit(args: Mapping[str, Any]) -> int:
        return MAX_REPLY + int(args.get("max_bytes", 8 << 20))

    def read_answer(self, verb: str, argv: list[str], res: Result) -> tuple[dict[str, Any], bytes, int, int]:
        """read()'s tuple out of the request's Result."""
        self.seconds = res.seconds
        head, sep, data = res.stdout.partition(b"\n")
        doc = self.json_line(head) if sep else None
        if doc is None:
            self.fail(verb, res)
        if doc.get("ok") and not isinstance(doc.get("length"), int):
            raise AgentReplyError(f"{self.name}: agent {verb}: reply header lacks a byte count")
        if doc.get("ok") and len(data) != doc.get("length"):
            raise ConnectionFailed(f"{self.name}: {verb} cut short: {len(data)} of {doc.get('length')} bytes "
                                   "arrived")
        return doc, data, len(agent_source()) + len(argv[-1]), len(res.stdout) + len(res.stderr)

    @staticmethod
    def poll_args(runs: Sequence[Mapping[str, Any]], max_bytes: int) -> dict[str, Any]:
        """Verb `poll`'s arguments: the state and the new log bytes of several runs of this container in one
        request (read() or a flow's Read; its answer through poll_answer). Each of `runs` is {"name", "log",
        "session", "state": bool, "record": bool, "read": logread's arguments or None}."""
        return {"runs": list(runs), "max_bytes": max_bytes}

    def poll_answer(self, runs: Sequence[Mapping[str, Any]], got: tuple[dict[str, Any], bytes, int, int]
                    ) -> tuple[list[tuple[dict[str, Any] | None, tuple[dict[str, Any], bytes] | None]], int, int]:
        """The answer to poll_args(runs, ...), out of read()'s tuple: [(state or None, (read header, its bytes)
        or None)] in the order of `runs`, and (wire out, wire in). Every entry's kind and every byte count is
        checked against what arrived."""
        doc, data, n_in, n_out = got
        if not doc.get("ok"):
            raise self.error(doc)
        entries = self.need(doc, "runs", list)
        if len(entries) != len(runs):
            raise AgentReplyError(f"{self.name}: agent poll: {len(entries)} answers for {len(runs)} runs")
        out: list[tuple[dict[str, Any] | None, tuple[dict[str, Any], bytes] | None]] = []
        pos = 0
        for want, entry in zip(runs, entries, strict=True):
            state: Any = entry.get("state") if isinstance(entry, dict) else "?"
            read: Any = entry.get("read") if isinstance(entry, dict) else "?"
            if (state is not None if not want.get("state") else not isinstance(state, dict)) or (
                    read is not None if want.get("read") is None else not isinstance(read, dict)):
                raise AgentReplyError(f"{self.name}: agent poll: malformed answer for run {want.get('name')!r}")
            chunk = None
            if isinstance(read, dict):
                n = read.get("length")
                if not isinstance(n, int) or isinstance(n, bool) or n < 0 or pos + n > len(data):
                    raise AgentReplyError(f"{self.name}: agent poll: run {want.get('name')!r} claims "
                                          f"{str(n)[:20]} log bytes; {len(data) - pos} are left in the reply")
                chunk = (read, data[pos:pos + n])
                pos += n
            out.append((state, chunk))
        if pos != len(data):
            raise AgentReplyError(f"{self.name}: agent poll: {len(data) - pos} log bytes belong to no run")
        return out, n_in, n_out

    def open(self, verb: str, *args: str) -> Duplex:
        """Start a conversation verb (sync); the caller sends `agent_source()` first."""
        return self.t.open(self.argv(verb, args))

    def copy_dir(self, path: str, to: Sequence[tuple[Agent, Sequence[str]]]) -> list[dict[str, Any]]:
        """Carry the directory `path` (a checkpoint) from this container to the same path in each of `to` (its
        agent, and the symlinks its container follows), through this machine: packdir's base64 lines here go on
        to every unpackdir there as a tar stream, unpacked beside its place and checked against its manifest
        before it is renamed there. Each destination's answer, in order (ok false: that one refused); packdir
        refusing raises."""
        import base64

        src = self.t.open(self.argv("packdir", {"dir": path}))
        src.send(agent_source())
        dests = []
        for agent, follow in to:
            d = agent.t.open(agent.argv("unpackdir", {"dir": path, "follow": list(follow)}))
            d.send(agent_source())
            dests.append((agent, d))
        head = self.json_line(src.readline(timeout=120))
        if head is None or not head.get("ok"):
            for _agent, d in dests:  # their input ends here, empty: each refuses it and ends, leaving nothing
                with contextlib.suppress(CtlError):
                    d.finish(timeout=60)
            if head is None:
                self.fail("packdir", src.finish(timeout=30))
            src.finish(timeout=30)
            raise self.error(head)  # a refusal is the first line, not what finish() still reads
        while True:
            line = src.readline(timeout=600)
            if not line:
                raise ConnectionFailed(f"{self.name}: the stream of {path} ended early")
            if line.startswith(b"{"):
                break
            chunk = base64.b64decode(line)
            for _agent, d in dests:
                d.send(chunk)
        src.finish(timeout=60)
        return [agent.parse("unpackdir", d.finish(timeout=600)) for agent, d in dests]

    def begin_sync(self, store: str, deploy_id: str) -> Sync:
        """Verb sync into `store` as deploy `deploy_id`: the way to the agent starts opening now, on a thread of
        its own (see Sync)."""
        return Sync(self, (store, deploy_id))

    def apply(self, store: str, deploy_id: str, bundle: bytes) -> ApplyReply:
        """Verb apply of a bundle (a tar of manifest.json and the bodies it sends): its answer, a refusal too."""
        return ApplyReply.of(self.call("apply", (store, deploy_id), payload=bundle, check=False))

    # --- answers -------------------------------------------------------------------------------------

    def parse(self, verb: str, res: Result) -> dict[str, Any]:
        """The JSON document on the last line of stdout, or a one-line error saying what came instead."""
        lines = res.stdout.strip().splitlines()
        doc = self.json_line(lines[-1]) if lines else None
        if doc is None:
            self.fail(verb, res)
        return doc

    def error(self, doc: Mapping[str, Any], *, suffix: str = "") -> CtlError:
        """The exception for a refusal: its class and prefix from ERRORS by code, the agent's text, a suffix."""
        cls, prefix = ERRORS.get(str(doc.get("code")), (CtlError, ""))
        return cls(f"{self.name}: {prefix}{doc.get('error') or 'failed (no reason given)'}{suffix}")

    def fail(self, verb: str, res: Result) -> NoReturn:
        """No JSON answer at all: python3 missing in the container, or the agent died; say which."""
        if res.returncode == 127 or "python3: not found" in res.err or "No such file" in res.err[:200]:
            raise CtlError(f"{self.name}: python3 is not available in the container (ctl's agent needs it)")
        if res.returncode == 0 or not res.err.strip():
            shown = res.out.strip()[:80]
            raise AgentReplyError(f"{self.name}: agent {verb}: unreadable reply (exit {res.returncode}"
                                  + (f", stdout starts {shown!r})" if shown else ", no output)"))
        raise RemoteCommandError(self.name, ["python3", "<agent>", verb], res.returncode, res.err,
                                 what=f"agent {verb}")

    def need(self, doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...] | None = None) -> Any:
        """doc[key], or one line naming the container and the key the agent's answer lacked; with `kind`,
        also one line when the value is not of that type (an int is not a bool here)."""
        try:
            value = doc[key]
        except (KeyError, TypeError):
            raise AgentReplyError(f"{self.name}: agent reply lacks {key!r}") from None
        if kind is not None and (not isinstance(value, kind) or (isinstance(value, bool) and kind is int)):
            raise AgentReplyError(f"{self.name}: agent reply's {key!r} is {type(value).__name__}, not "
                                  + (kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)))
        return value

    def too_large(self, what: str, limit: int) -> AgentReplyError:
        """A reply stopped as it passed `limit` (the transport's OutputTooLarge), in the container's words."""
        return AgentReplyError(f"{self.name}: {what}: reply over {limit:,} bytes refused (stopped there; the rest "
                               "was not read)")

    @staticmethod
    def json_line(line: bytes | str) -> dict[str, Any] | None:
        try:
            doc = json.loads(line)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    # --- the environment probe (probe_env.py, run by the training venv's python3) --------------------

    def env_probe_args(self, *, venv: str | None, cache_dir: str | None) -> list[str]:
        argv = []
        if venv:
            argv += ["--venv", self.t.path(venv)]
        if cache_dir:
            argv += ["--cache-dir", self.t.path(cache_dir)]
        return argv

    def probe_env(self, *, venv: str | None, cache_dir: str | None) -> dict[str, Any]:
        """One exec: `python3 - [--venv V] [--cache-dir C]` with the probe on stdin; its JSON document."""
        try:
            res = self.t.run(["python3", "-", *self.env_probe_args(venv=venv, cache_dir=cache_dir)],
                             stdin=source("probe_env"), timeout=120, max_output=MAX_REPLY)
        except OutputTooLarge:
            raise self.too_large("env probe", MAX_REPLY) from None
        return self.env_doc(res.stdout, res.returncode, res.err)

    def env_probe_request(self, *, venv: str | None, cache_dir: str | None) -> tuple[dict[str, Any], bytes]:
        """The `env_probe` argument and payload of the agent's `probe`: the environment probe rides in that round
        trip (the probe's source follows the agent's on stdin) instead of an exec of its own."""
        src = source("probe_env")
        return {"argv": self.env_probe_args(venv=venv, cache_dir=cache_dir), "n": len(src), "timeout": 110}, src

    def env_from_probe(self, reply: Any) -> dict[str, Any]:
        """The probe's JSON document from the agent `probe`'s "env_probe" part ({rc, stdout, stderr})."""
        if not (isinstance(reply, dict) and isinstance(reply.get("rc"), int) and isinstance(reply.get("stdout"), str)
                and isinstance(reply.get("stderr"), str)):
            raise AgentReplyError(f"{self.name}: agent probe: malformed 'env_probe' in its reply")
        return self.env_doc(reply["stdout"], reply["rc"], reply["stderr"])

    def env_doc(self, stdout: bytes | str, rc: int, err: str) -> dict[str, Any]:
        """The probe's JSON document from its output (run on its own, or inside the agent's `probe`)."""
        doc = self.json_line(stdout.strip())
        if doc is None:
            if rc == 127 or "python3: not found" in err:
                raise CtlError(f"{self.name}: python3 is not available in the container (the environment probe "
                               "needs it)")
            raise RemoteCommandError(self.name, ["python3", "<probe_env.py>"], rc, err, what="env probe")
        return doc


# --- the deploy's sync: a plan, then an apply or the end -----------------------------------------------


@dataclass(frozen=True)
class SyncPlan:
    """The agent's plan line: what it has of the pinned files, and which of them it needs."""

    have: Mapping[str, Any]  # dest -> {"sha256", "size", "mode"} (or {"error", "code"}), None when missing
    need: tuple[int, ...] | None  # the indices of the files it needs; None when the line held no list


@dataclass(frozen=True)
class ApplyReply:
    """The agent's answer to an apply (verb apply, or sync's once it was sent "apply" and the tar)."""

    ok: bool
    partial: bool  # it failed during the renames, and `replaced` stay replaced
    replaced: tuple[str, ...]
    previous_modes: Mapping[str, Any]  # dest -> its mode before (the files the answer lists)
    error: str | None
    code: str | None

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> ApplyReply:
        ok = bool(doc.get("ok"))
        error, code = doc.get("error"), doc.get("code")
        return cls(ok, not ok and bool(doc.get("partial")), tuple(doc.get("replaced") or ()),
                   {r["dest"]: r.get("previous_mode") for r in doc.get("files", [])},
                   None if error is None else str(error), None if code is None else str(code))

    def refusal(self, agent: Agent, suffix: str = "") -> CtlError:
        """The exception its code names (Agent.error)."""
        return agent.error({"code": self.code, "error": self.error}, suffix=suffix)


class Sync:
    """Verb sync with one container's agent: the deploy's plan, then its apply or its end. Over an exec of its own
    it is one conversation (the pinned files' header line out, the plan line back, then "apply" and the tar, or
    the end of stdin: nothing applied); with a staying agent (Transport.keeps_agents) it is requests (the plan:
    one that changes nothing; the apply: one with the header, "apply" and the tar, whose plan comes again), and a
    tar too large for a staying agent gets an exec of its own. The way there (a `hello` that starts the staying
    agent, or that exec) opens on a thread of its own from the start, so that the SSH handshake and the host's
    start of pct and the agent overlap what the caller does meanwhile (pinning)."""

    def __init__(self, agent: Agent, args: tuple[str, str]) -> None:
        self.agent, self.args = agent, args
        self._duplex: Duplex | None = None
        self._error: BaseException | None = None
        self._plan: Mapping[str, Any] | None = None
        self._thread = threading.Thread(target=self._open, name=f"open-{agent.name}", daemon=True)
        self._thread.start()

    def _open(self) -> None:
        try:
            if self.agent.t.keeps_agents():
                self.agent.call("hello", {})
            else:
                self._duplex = self.agent.t.open(self.agent.argv("sync", self.args))
        except BaseException as e:  # raised by plan()
            self._error = e

    def discard(self) -> None:
        """The caller gave up before its plan: end the exec if it opened (the agent reads no source and exits);
        never wait on a connection that is still being made (the pool closes it)."""
        if self._thread.is_alive() or self._duplex is None:
            return
        with contextlib.suppress(CtlError):
            self._duplex.finish(timeout=10)

    def plan(self, header: bytes) -> SyncPlan:
        """Send the header line ({"files", "dry_run", "follow"}); the agent's plan. Raises what opening raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        doc = self.agent.sync(self.args, header)[0] if self._duplex is None else self._converse(self._duplex, header)
        self._plan = doc
        return SyncPlan(self.agent.need(doc, "have"), _indices(doc))

    def _converse(self, duplex: Duplex, header: bytes) -> dict[str, Any]:
        duplex.send(agent_source() + header)
        first = Agent.json_line(duplex.readline(timeout=120))
        if first is None:
            self.agent.fail("sync", duplex.finish(timeout=30))
        return first

    def end(self) -> None:
        """Apply nothing: the exec's stdin closed (a staying agent was asked nothing that changes anything)."""
        if self._duplex is not None:
            self._duplex.finish(timeout=30)

    def apply(self, header: bytes, tar: bytes, progress: Callable[[int, int], None]) -> tuple[SyncPlan, ApplyReply]:
        """After plan(header): send "apply" and the tar (`progress(bytes sent, of)` as it goes). The plan the agent
        applied by (made again where plan and apply were two requests) and its answer."""
        data = b"apply\n" + tar
        again = self._plan
        if self._duplex is None and len(tar) > STAYING_MAX_INPUT:  # a large transfer: an exec of its own
            self._duplex = self.agent.open("sync", *self.args)
            again = self._converse(self._duplex, header)
        if self._duplex is None:
            again, doc = self.agent.sync(self.args, header, tar, timeout=600)
            progress(len(data), len(data))
        else:
            step = 1 << 20
            for pos in range(0, len(data), step):
                self._duplex.send(data[pos:pos + step])
                progress(min(pos + step, len(data)), len(data))
            doc = self.agent.parse("sync", self._duplex.finish(timeout=600))
        assert again is not None, "Sync.apply before its plan"
        have = again.get("have")
        return SyncPlan(have if isinstance(have, dict) else {}, _indices(again)), ApplyReply.of(doc)

    def by_hand(self, header: bytes, tar: bytes) -> tuple[str, bytes]:
        """The exec a user could run to apply it (--dry-run): its command line, and what its stdin must hold."""
        return self.agent.shell_line("sync", *self.args), agent_source() + header + b"apply\n" + tar


def _indices(doc: Mapping[str, Any]) -> tuple[int, ...] | None:
    need = doc.get("need")
    return tuple(i for i in need if isinstance(i, int)) if isinstance(need, list) else None
