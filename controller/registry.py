"""The local registry: deploys, runs, metrics and environment fingerprints in one SQLite file.

Lives under the user's state directory (platformdirs; CTL_STATE_DIR overrides). WAL mode and a
busy timeout make two concurrent `ctl` commands safe; a run name is claimed with one INSERT under a
UNIQUE constraint, so of two concurrent launches of one name exactly one wins. Nothing is deleted.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.errors import BusyError, InputError, RegistryLocked
from controller.lifecycle import LIVE, Lifecycle
from controller.scope import Scope, name_of
from controller.settings import private_dir, private_file, registry_wait, state_dir

SCHEMA = [
    # version 1
    """
    CREATE TABLE deploys (
        id TEXT PRIMARY KEY,
        ct TEXT NOT NULL,
        kind TEXT NOT NULL,             -- deploy | rollback
        time REAL NOT NULL,
        commit_sha TEXT,
        dirty INTEGER NOT NULL,
        ok INTEGER NOT NULL,
        files TEXT NOT NULL,            -- JSON list of {dest, sha256, mode, previous, action}
        error TEXT
    );
    CREATE INDEX deploys_ct ON deploys(ct, time);
    CREATE TABLE runs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL,
        ct TEXT NOT NULL,
        host TEXT,
        created REAL NOT NULL,
        started REAL,
        ended REAL,
        state TEXT NOT NULL,            -- starting | running | finished | failed | stopped | lost | refused
        exit_status INTEGER,
        session TEXT,
        log_path TEXT,
        run_dir TEXT,
        command TEXT,
        commit_sha TEXT,
        dirty INTEGER,
        files TEXT,                     -- JSON {dest: sha256}
        vars TEXT,                      -- JSON template variables
        rendered TEXT,                  -- JSON {dest: text} of rendered templates
        env_fingerprint TEXT,
        env TEXT,                       -- JSON probe document
        good INTEGER NOT NULL DEFAULT 0,
        crash TEXT,
        note TEXT,
        UNIQUE (ct, name)
    );
    CREATE TABLE metrics (
        run_id INTEGER NOT NULL REFERENCES runs(id),
        seq INTEGER NOT NULL,
        step INTEGER,
        time REAL,
        elapsed_s REAL,
        loss REAL,
        tok_s REAL,
        data TEXT NOT NULL,             -- JSON of the parsed point
        PRIMARY KEY (run_id, seq)
    );
    CREATE TABLE log_cursor (
        run_id INTEGER PRIMARY KEY REFERENCES runs(id),
        offset INTEGER NOT NULL,
        ident TEXT,                     -- inode:ctime of the log, to notice rotation
        partial BLOB,
        updated REAL
    );
    """,
    # version 2: content hashes seen in a run's container by `ctl metrics pull`
    """
    CREATE TABLE run_files (
        run_id INTEGER NOT NULL REFERENCES runs(id),
        kind TEXT NOT NULL,             -- deployed | checkpoint
        path TEXT NOT NULL,             -- container path (deployed) or path under the run directory
        sha256 TEXT,                    -- NULL: missing when last looked
        size INTEGER,
        mtime_ns INTEGER,
        seen REAL NOT NULL,
        PRIMARY KEY (run_id, kind, path)
    );
    """,
    # version 3: runs of runbooks (`ctl runbook run`, listed by `ctl runbook history`)
    """
    CREATE TABLE runbook_runs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL,             -- the runbook's `name:`
        path TEXT NOT NULL,             -- the file, absolute
        sha256 TEXT NOT NULL,           -- of the file's bytes
        started REAL NOT NULL,
        ended REAL,
        outcome TEXT NOT NULL,          -- running | ok | failed | interrupted
        exit_code INTEGER,
        message TEXT,                   -- why it failed (the failing step's error or `fail:` message)
        vars TEXT NOT NULL,             -- JSON {name: value} after --var
        steps TEXT NOT NULL             -- JSON list of {path, kind, label, outcome, exit_code, seconds, detail}
    );
    CREATE INDEX runbook_runs_started ON runbook_runs(started);
    """,
    # version 4: what `ctl supervise` saw and did; lineages of restarted runs; one supervisor at a time
    """
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id INTEGER REFERENCES runs(id),
        time REAL NOT NULL,
        kind TEXT NOT NULL,             -- verdict | restart | gave_up | refused | notify_failed | supervisor
        from_verdict TEXT,
        to_verdict TEXT,
        summary TEXT NOT NULL,          -- one line a person reads first
        doc TEXT NOT NULL               -- JSON: the whole event, as the sinks got it
    );
    CREATE INDEX events_run ON events(run_id, id);
    ALTER TABLE runs ADD COLUMN parent_id INTEGER REFERENCES runs(id);
    ALTER TABLE runs ADD COLUMN resumed_from TEXT;
    ALTER TABLE runs ADD COLUMN resumed_step INTEGER;
    CREATE TABLE restarts (
        failed_run_id INTEGER PRIMARY KEY REFERENCES runs(id),  -- at most one relaunch per failure
        state TEXT NOT NULL,            -- planned | launching | done | refused | gave_up
        new_name TEXT,
        new_run_id INTEGER REFERENCES runs(id),
        time REAL NOT NULL,
        doc TEXT NOT NULL
    );
    CREATE TABLE leases (
        name TEXT PRIMARY KEY,
        holder TEXT NOT NULL,           -- host:pid:random of the process that holds it
        since REAL NOT NULL,
        expires REAL NOT NULL
    );
    """,
    # version 5: runs across several containers (a job): one row for the run, whose `ct` is the job's name and
    # `nodes` its node count, and one row per node (its container's log, state, metrics) pointing at it
    """
    ALTER TABLE runs ADD COLUMN nodes INTEGER;
    ALTER TABLE runs ADD COLUMN member_of INTEGER REFERENCES runs(id);
    ALTER TABLE runs ADD COLUMN node_rank INTEGER;
    CREATE INDEX runs_member_of ON runs(member_of);
    """,
    # version 6: a run's points in step order, covering tok/s: judging a long run reads a window of them
    """
    CREATE INDEX metrics_step ON metrics(run_id, step, seq, tok_s);
    """,
    # version 7: a container's runs newest first (`ctl status` reads its newest rows, not its whole history)
    """
    CREATE INDEX runs_ct_created ON runs(ct, created);
    """,
    # version 8: drafters exported from a run's checkpoints (`ctl export`, listed by `ctl show`)
    """
    CREATE TABLE exports (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id INTEGER NOT NULL REFERENCES runs(id),
        time REAL NOT NULL,
        step INTEGER NOT NULL,
        dtype TEXT NOT NULL,
        node TEXT NOT NULL,             -- the container the exporter ran in (a job's: the one holding the step)
        checkpoint TEXT NOT NULL,       -- its path there
        path TEXT NOT NULL,             -- the local directory written
        files TEXT NOT NULL,            -- JSON {name: {sha256, bytes}}
        provenance TEXT NOT NULL        -- JSON: the directory's provenance.json
    );
    CREATE INDEX exports_run ON exports(run_id, id);
    """,
    # version 9: when an operator asked a run to stop, recorded before the first signal: a supervisor poll that
    # sees the training end under that signal calls it stopped, never a crash to relaunch
    """
    ALTER TABLE runs ADD COLUMN stop_asked REAL;
    """,
]


class NoSuchRun(InputError):
    """A run reference naming no run (not several, not another checkout's): a verb may say what else it could be."""


@dataclass(frozen=True)
class RunRecord:
    """One run as the registry keeps it: where and what it ran (files, vars, environment), and how it went."""

    id: int
    name: str
    ct: str
    host: str | None
    created: float
    started: float | None
    ended: float | None
    state: Lifecycle
    exit_status: int | None
    session: str | None
    log_path: str | None
    run_dir: str | None
    command: str | None
    commit_sha: str | None
    dirty: bool
    files: dict[str, str] = field(default_factory=dict)
    vars: dict[str, Any] = field(default_factory=dict)
    rendered: dict[str, str] = field(default_factory=dict)
    env_fingerprint: str | None = None
    env: dict[str, Any] | None = None
    good: bool = False
    crash: str | None = None
    note: str | None = None
    parent_id: int | None = None  # the run this one was restarted from (ctl supervise)
    resumed_from: str | None = None  # the checkpoint it resumed from
    resumed_step: int | None = None
    nodes: int | None = None  # a run across several containers: how many (its `ct` is the job's name)
    member_of: int | None = None  # one node's part of such a run: the run's id
    node_rank: int | None = None  # that node's index in the job (0 hosts the rendezvous)
    # The container's identity in the registry (`ct` is its name): the name, or NAME@ROOT for a `local` target
    key: str = ""
    stop_asked: float | None = None  # when `ctl stop` (or a runbook's stop) asked it to end, before any signal

    @property
    def multi(self) -> bool:
        """A run across several containers (its nodes are `Registry.members`)."""
        return self.nodes is not None

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class DeployRecord:
    """One deploy (or rollback) to one container: the commit, the files and their hashes, and whether it held."""

    id: str
    ct: str
    kind: str
    time: float
    commit_sha: str | None
    dirty: bool
    ok: bool
    files: list[dict[str, Any]]
    error: str | None


class _Lease:
    """A thread's use of one of the registry's connections; when the thread ends, its thread-local (and so this)
    goes, and the connection returns to the registry's free list."""

    def __init__(self, reg: Registry, db: sqlite3.Connection) -> None:
        self.reg, self.db = reg, db

    def __del__(self) -> None:
        self.reg._give_back(self.db)


class Registry:
    def __init__(self, path: Path | None = None, *, here: Mapping[str, str] | None = None) -> None:
        self.path = path or state_dir() / "registry.sqlite3"
        # With an inventory's keys (`here`), another checkout's rows are neither listed nor found (scope.py)
        self.scope = Scope(dict(here) if here is not None else None)
        # Private: run records hold commands, variables and rendered scripts (SQLite gives -wal/-shm the db's mode).
        private_dir(self.path.parent)
        for suffix in ("", "-wal", "-shm"):
            p = self.path.with_name(self.path.name + suffix)
            if not suffix or p.exists():
                private_file(p)
        # One connection per thread (fan-out commands record from worker threads): SQLite's own locking then
        # orders them exactly as it orders two ctl processes, and no transaction is ever nested in another.
        # A thread that ends hands its connection back for the next thread to take: a long-lived process
        # (supervise, dashboard) starts threads per poll and per request, and closing their connections would
        # not free their file descriptors while another connection of the process is open (SQLite keeps them
        # until the file's last POSIX lock goes), so it would run out of them within hours.
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._free: list[sqlite3.Connection] = []
        self._conns_lock = threading.RLock()
        self._writer = threading.Lock()  # one write transaction of this process at a time (tx)
        self._migrate()

    @property
    def _db(self) -> sqlite3.Connection:
        lease: _Lease | None = getattr(self._local, "lease", None)
        if lease is None:
            with self._conns_lock:
                db = self._free.pop() if self._free else None
            if db is None:
                wait = registry_wait()
                db = sqlite3.connect(self.path, timeout=wait, isolation_level=None, check_same_thread=False)
                db.row_factory = sqlite3.Row
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(f"PRAGMA busy_timeout={int(wait * 1000)}")
                db.execute("PRAGMA foreign_keys=ON")
                with self._conns_lock:
                    self._conns.append(db)
            lease = self._local.lease = _Lease(self, db)
        return lease.db

    def _give_back(self, db: sqlite3.Connection) -> None:
        with self._conns_lock:
            if any(c is db for c in self._conns) and not db.in_transaction:
                self._free.append(db)

    def close(self) -> None:
        with self._conns_lock:
            for db in self._conns:
                db.close()
            self._conns.clear()
            self._free.clear()
        self._local = threading.local()

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """An IMMEDIATE transaction: writers queue up instead of failing half-way. The threads of one process
        queue on a lock of ours first: SQLite's busy handler has a writer that finds the database locked sleep
        (1, 2, 5, 10 ms and on), which a fan-out's threads, each storing its container's pull, met in turn; the
        lock hands over as soon as the transaction ends. Other processes still wait on SQLite's."""
        db = self._db
        with self._writer:
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as e:
                if "locked" not in str(e):
                    raise
                raise RegistryLocked(f"{self.path}: held by another writer past SQLite's wait ({e}); "
                                     "nothing written") from None
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            else:
                db.execute("COMMIT")

    def _migrate(self) -> None:
        with self.tx() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            for i, script in enumerate(SCHEMA[version:], start=version + 1):
                for stmt in script.split(";"):
                    if stmt.strip():
                        db.execute(stmt)
                db.execute(f"PRAGMA user_version={i}")

    # --- deploys ---------------------------------------------------------------------------------

    def add_deploy(self, rec: DeployRecord) -> None:
        with self.tx() as db:
            db.execute(
                "INSERT INTO deploys VALUES (?,?,?,?,?,?,?,?,?)",
                (rec.id, rec.ct, rec.kind, rec.time, rec.commit_sha, int(rec.dirty), int(rec.ok),
                 json.dumps(rec.files), rec.error),
            )

    def deploys(self, ct: str, *, ok_only: bool = True, limit: int = 20) -> list[DeployRecord]:
        where, args = self.scope.of(ct)
        q = f"SELECT * FROM deploys WHERE {where} AND ok>=? ORDER BY time DESC LIMIT ?"  # noqa: S608
        return [
            DeployRecord(r["id"], r["ct"], r["kind"], r["time"], r["commit_sha"], bool(r["dirty"]), bool(r["ok"]),
                         json.loads(r["files"]), r["error"])
            for r in self._db.execute(q, (*args, int(ok_only), limit))
        ]

    # --- runs ------------------------------------------------------------------------------------

    def claim_run(self, name: str, ct: str, **fields: Any) -> RunRecord:
        """Insert the run in state 'starting' (`ct`: the container's key); a second claim of (ct, name) raises
        BusyError, as does a name that a row of the container recorded under its bare name holds."""
        cols = {"name": name, "ct": ct, "created": time.time(), "state": Lifecycle.STARTING, **_encode(fields)}
        try:
            with self.tx() as db:
                where, args = self.scope.of(ct)
                if db.execute(f"SELECT 1 FROM runs WHERE {where} AND name=?", (*args, name)).fetchone():  # noqa: S608
                    raise sqlite3.IntegrityError
                cur = db.execute(
                    f"INSERT INTO runs ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})",  # noqa: S608
                    tuple(cols.values()),
                )
                run_id = cur.lastrowid
        except sqlite3.IntegrityError:
            raise BusyError(f"run {name!r} on {ct} already exists in the registry; pick another name") from None
        assert run_id is not None
        return self.run_by_id(run_id)

    def claim_job_run(self, name: str, job: str, nodes: list[tuple[str, str | None]], **fields: Any
                      ) -> tuple[RunRecord, list[RunRecord]]:
        """Claim `name` for a run of `job` on every node at once, or on none: one transaction inserts the run's row
        (ct = the job) and one row per node (ct, host), all 'starting'. A node where the name is taken (a run of
        its own, or a node of another run) raises BusyError naming it, and nothing is claimed anywhere."""
        now = time.time()
        enc = _encode(fields)
        try:
            with self.tx() as db:
                for ct, _host in [(job, None), *nodes]:
                    where, args = self.scope.of(ct)
                    row = db.execute(f"SELECT member_of FROM runs WHERE {where} AND name=?",  # noqa: S608
                                     (*args, name)).fetchone()
                    if row is not None:
                        what = "a node of another run" if row[0] is not None else "a run"
                        raise BusyError(f"run name {name!r} is taken on {ct} ({what} of that name is in the "
                                        f"registry); nothing claimed on any node of {job}: pick another name")
                cols = {"name": name, "ct": job, "created": now, "state": Lifecycle.STARTING, "nodes": len(nodes),
                        **enc}
                cur = db.execute(f"INSERT INTO runs ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})",  # noqa: S608
                                 tuple(cols.values()))
                run_id = cur.lastrowid
                for rank, (ct, host) in enumerate(nodes):
                    mcols = {**cols, "ct": ct, "host": host, "nodes": None, "member_of": run_id, "node_rank": rank}
                    db.execute(f"INSERT INTO runs ({','.join(mcols)}) VALUES ({','.join('?' * len(mcols))})",  # noqa: S608
                               tuple(mcols.values()))
        except sqlite3.IntegrityError:  # a concurrent claim won between our SELECT and INSERT
            raise BusyError(f"run name {name!r} was just claimed on a node of {job}; nothing claimed: pick another "
                            "name") from None
        assert run_id is not None
        return self.run_by_id(run_id), self.members(run_id)

    def members(self, run_id: int) -> list[RunRecord]:
        """The nodes of a run across several containers, by node rank (empty for a run of one container)."""
        rows = self._db.execute("SELECT * FROM runs WHERE member_of=? ORDER BY node_rank", (run_id,))
        return [_run(r) for r in rows]

    def update_run(self, run_id: int, **fields: Any) -> RunRecord:
        enc = _encode(fields)
        with self.tx() as db:
            db.execute(
                f"UPDATE runs SET {', '.join(f'{k}=?' for k in enc)} WHERE id=?",  # noqa: S608
                (*enc.values(), run_id),
            )
        return self.run_by_id(run_id)

    def ask_stop(self, run_id: int) -> None:
        """Record that an operator asked the run (and, for a run across several containers, each of its nodes)
        to stop, before any signal is sent: whatever ends the training after this is the operator's doing."""
        with self.tx() as db:
            db.execute("UPDATE runs SET stop_asked=? WHERE (id=? OR member_of=?) AND stop_asked IS NULL",
                       (time.time(), run_id, run_id))

    def release_run(self, run_id: int) -> None:
        """Forget a claim whose launch never reached the container (refused by preflight); a run across several
        containers is released with its nodes' rows, in one transaction."""
        with self.tx() as db:
            db.execute("DELETE FROM runs WHERE member_of=? AND state='starting'", (run_id,))
            db.execute("DELETE FROM runs WHERE id=? AND state='starting' AND NOT EXISTS "
                       "(SELECT 1 FROM runs AS m WHERE m.member_of=runs.id)", (run_id,))

    def forget_job_claim(self, run_id: int) -> None:
        """Forget a run across several containers that no node started (each answered that it started nothing):
        its nodes' rows and its own, in one transaction."""
        with self.tx() as db:
            db.execute("DELETE FROM runs WHERE member_of=?", (run_id,))
            db.execute("DELETE FROM runs WHERE id=? AND nodes IS NOT NULL", (run_id,))

    def run_by_id(self, run_id: int) -> RunRecord:
        row = self._db.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
        return _run(row)

    def has_run(self, run_id: int) -> bool:
        return self._db.execute("SELECT 1 FROM runs WHERE id=?", (run_id,)).fetchone() is not None

    def runs(self, ct: str | None = None, *, limit: int = 100, members: bool | None = None) -> list[RunRecord]:
        """Newest first. Of one container (its nodes' rows of runs across several containers included: what ran
        there), or of everything (one row per run: nodes' rows left out). `members` overrides either default."""
        if members is None:
            members = ct is not None
        only = "" if members else " AND member_of IS NULL"
        where, args = self.scope.of(ct) if ct else self.scope.mine()
        rows = self._db.execute(f"SELECT * FROM runs WHERE {where}{only} ORDER BY created DESC LIMIT ?",  # noqa: S608
                                (*args, limit))
        return [_run(r) for r in rows]

    def live_runs(self, ct: str | None = None) -> list[RunRecord]:
        """Runs in a live state (starting, running), newest first: of one container (its nodes' rows of runs
        across several containers included), or of everything (one row per run). Only those rows are read: a
        registry's history costs nothing here."""
        if ct:
            where, args = self.scope.of(ct)
            rows = self._db.execute(f"SELECT * FROM runs WHERE state IN ({_LIVE_MARKS}) AND {where} "  # noqa: S608
                                    "ORDER BY created DESC", (*_LIVE, *args))
        else:
            where, args = self.scope.mine()
            rows = self._db.execute(f"SELECT * FROM runs WHERE {where} AND {_LIVE_WHOLE}", (*args, *_LIVE))  # noqa: S608
        return [_run(r) for r in rows]

    def live_ids(self) -> list[tuple[int, str]]:
        """(id, container or job name) of the live runs, one row per run, newest first: live_runs without decoding
        a record (a supervisor asks at each poll which runs to watch)."""
        where, args = self.scope.mine()
        rows = self._db.execute(f"SELECT id, ct FROM runs WHERE {where} AND {_LIVE_WHOLE}", (*args, *_LIVE))  # noqa: S608
        return [(rid, name_of(ct)) for rid, ct in rows]

    def latest_whole(self, ct: str, limit: int) -> list[tuple[int, Lifecycle]]:
        """(id, state) of the runs the container's newest `limit` rows belong to (a node's row: its run across
        several containers), newest first, each once; read without decoding a record."""
        where, args = self.scope.of(ct)
        rows = self._db.execute(
            f"SELECT w.id, w.state, w.created FROM (SELECT COALESCE(member_of, id) AS whole FROM runs WHERE {where} "  # noqa: S608
            "ORDER BY created DESC LIMIT ?) r JOIN runs w ON w.id = r.whole", (*args, limit)).fetchall()
        seen: dict[int, tuple[float, Lifecycle]] = {}
        for rid, state, created in rows:
            seen.setdefault(rid, (created, Lifecycle(state)))
        return [(rid, st) for rid, (_c, st) in sorted(seen.items(), key=lambda kv: kv[1][0], reverse=True)]

    def unsettled_runs(self, terminal: frozenset[str]) -> list[tuple[int, str]]:
        """(id, container or job) of the runs that are not live and whose last verdict is set and not in
        `terminal` (one row per run): a supervisor saw them go and has not yet seen them end."""
        last = "SELECT to_verdict FROM events e WHERE e.run_id=runs.id AND e.kind='verdict' ORDER BY e.id DESC LIMIT 1"
        where, args = self.scope.mine()
        query = (f"SELECT id, ct, ({last}) AS v FROM runs WHERE {where} AND member_of IS NULL "  # noqa: S608
                 f"AND state NOT IN ({_LIVE_MARKS})")
        rows = self._db.execute(query + " AND v IS NOT NULL AND v != ''", (*args, *_LIVE)).fetchall()
        return [(rid, name_of(ct)) for rid, ct, v in rows if v not in terminal]

    def whole(self, rec: RunRecord) -> RunRecord:
        """The run a record is part of: a node's row gives its run across several containers, any other itself."""
        return self.run_by_id(rec.member_of) if rec.member_of is not None else rec

    def find_run(self, ref: str) -> RunRecord:
        """A run by `NAME`, `CT/NAME` or `#ID`; ambiguous names must be qualified. A node of a run across several
        containers (`ct300/fresh7`, or its #ID) stands for that whole run: every verb acts on all its nodes.
        Another checkout's run (its `local` at another root) is refused, saying so."""
        if ref.startswith("#") and ref[1:].isdigit():
            row = self._db.execute("SELECT * FROM runs WHERE id=?", (int(ref[1:]),)).fetchone()
            if row is None:
                raise NoSuchRun(f"no run {ref} in the registry ({self.path})")
            if self.scope.elsewhere(row["ct"]):
                raise self.scope.refusal(ref, row["ct"])
            return self.whole(_run(row))
        ct, _, name = ref.rpartition("/")
        if ct:
            where, args = self.scope.of(ct)
            rows = list(self._db.execute(f"SELECT * FROM runs WHERE {where} AND name=?", (*args, name)))  # noqa: S608
        else:
            rows = list(self._db.execute("SELECT * FROM runs WHERE name=? AND member_of IS NULL", (ref,)))
        rows = [r for r in rows if not self.scope.elsewhere(r["ct"])]
        if not rows:
            for (key,) in self._db.execute("SELECT ct FROM runs WHERE name=?", (name,)):
                if self.scope.elsewhere(key) and (not ct or name_of(key) == ct):
                    raise self.scope.refusal(ref, key)
            raise NoSuchRun(f"no run {ref!r} in the registry ({self.path}); `ctl runs` lists them")
        if len(rows) > 1:
            cts = ", ".join(f"{r['ct']}/{r['name']}" for r in rows)
            raise InputError(f"run name {ref!r} is ambiguous: {cts}")
        return self.whole(_run(rows[0]))

    def names(self, ct: str) -> list[str]:
        where, args = self.scope.of(ct)
        return [r[0] for r in self._db.execute(f"SELECT name FROM runs WHERE {where}", args)]  # noqa: S608

    def mark_good(self, run_id: int, good: bool = True) -> None:
        with self.tx() as db:
            db.execute("UPDATE runs SET good=? WHERE id=?", (int(good), run_id))

    def baseline(self, ct: str | None, *, other_than: int | None = None) -> RunRecord | None:
        """The most recent run marked good (on this CT if any, else anywhere), never a node's row of a run across
        several containers, nor the run `other_than`. Chosen by SQLite (at most two rows decoded): `ctl status` asks
        it for every run it shows, and decoding every run of the registry for each was a third of its time."""
        skip = -1 if other_than is None else other_than
        where = "good=1 AND member_of IS NULL AND id!=?"
        if ct is not None:
            of, args = self.scope.of(ct)
            row = self._db.execute(f"SELECT * FROM runs WHERE {where} AND {of} ORDER BY created DESC LIMIT 1",  # noqa: S608
                                   (skip, *args)).fetchone()
            if row is not None:
                return _run(row)
        mine, args = self.scope.mine()
        row = self._db.execute(f"SELECT * FROM runs WHERE {where} AND {mine} ORDER BY created DESC LIMIT 1",  # noqa: S608
                               (skip, *args)).fetchone()
        return _run(row) if row is not None else None

    # --- metrics ---------------------------------------------------------------------------------

    @staticmethod
    def _insert_points(db: sqlite3.Connection, run_id: int, points: list[dict[str, Any]]) -> None:
        """Append points after the run's last one (inside the caller's transaction)."""
        seq = db.execute("SELECT COALESCE(MAX(seq), -1) FROM metrics WHERE run_id=?", (run_id,)).fetchone()[0]
        db.executemany(
            "INSERT INTO metrics VALUES (?,?,?,?,?,?,?,?)",
            [
                (run_id, seq + 1 + i, p.get("step"), p.get("time"), p.get("elapsed_s"), p.get("loss"),
                 p.get("tok_s"), json.dumps(p))
                for i, p in enumerate(points)
            ],
        )

    def points(self, run_id: int) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT data FROM metrics WHERE run_id=? ORDER BY seq", (run_id,))
        return [json.loads(r[0]) for r in rows]

    # A long run holds tens of thousands of points; judging it reads a few of them (monitor.point_window), through
    # the index metrics_step. "Steady" points: in step order (ties in log order), past the first `skip`, with a
    # finite positive tok/s (at most the largest double: SQLite keeps infinities, and NaN as NULL).
    def point_count(self, run_id: int) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM metrics WHERE run_id=?", (run_id,)).fetchone()[0])

    def last_point_time(self, run_id: int) -> float | None:
        """The newest `time` among the run's points (reads every point: only when nothing else tells it)."""
        row = self._db.execute("SELECT MAX(time) FROM metrics WHERE run_id=?", (run_id,)).fetchone()
        return row[0] if row is not None else None

    def _after(self, run_id: int, skip: int) -> tuple[Any, Any] | None:
        """(step, seq) of the first point past the first `skip` in step order (an index-only walk)."""
        row = self._db.execute("SELECT step, seq FROM metrics WHERE run_id=? ORDER BY step, seq LIMIT 1 OFFSET ?",
                               (run_id, skip)).fetchone()
        return (row[0], row[1]) if row is not None else None

    def steady_rates(self, run_id: int, *, skip: int, last: int | None = None) -> list[float]:
        """tok/s of every steady point (of the last `last`), in step order, from the index alone."""
        first = self._after(run_id, skip)
        if first is None:
            return []
        rows = self._db.execute("SELECT tok_s FROM metrics WHERE run_id=? AND (step, seq) >= (?, ?) AND tok_s > 0 "
                                "AND tok_s <= 1.7976931348623157e308 ORDER BY step DESC, seq DESC LIMIT ?",
                                (run_id, *first, -1 if last is None else last))
        return [r[0] for r in rows][::-1]

    def top_point(self, run_id: int) -> dict[str, Any] | None:
        """The point of the highest step (the first logged of equals)."""
        row = self._db.execute("SELECT data FROM metrics WHERE run_id=? ORDER BY step DESC, seq LIMIT 1",
                               (run_id,)).fetchone()
        return json.loads(row[0]) if row is not None else None

    def step_from_top(self, run_id: int, n: int) -> int | None:
        """The step of the `n`th point counting down from the highest step (the lowest step when it has fewer)."""
        row = self._db.execute("SELECT step FROM metrics WHERE run_id=? ORDER BY step DESC, seq DESC LIMIT 1 "
                               "OFFSET ?", (run_id, n - 1)).fetchone()
        if row is None:
            row = self._db.execute("SELECT MIN(step) FROM metrics WHERE run_id=?", (run_id,)).fetchone()
        return row[0] if row is not None else None

    def points_from_step(self, run_id: int, step: int) -> list[dict[str, Any]]:
        """The points at `step` and above, in log order."""
        rows = self._db.execute("SELECT data FROM metrics WHERE run_id=? AND step >= ? ORDER BY seq", (run_id, step))
        return [json.loads(r[0]) for r in rows]

    def recent_rates(self, run_id: int, n: int) -> list[float | None]:
        """tok/s of the last `n` points, in log order (None where a point has none, or NaN: SQLite keeps NULL)."""
        rows = self._db.execute("SELECT tok_s FROM metrics WHERE run_id=? ORDER BY seq DESC LIMIT ?", (run_id, n))
        return [r[0] for r in rows][::-1]

    def series(self, run_id: int) -> list[tuple[int | None, float | None, float | None]]:
        """(step, tok/s, loss) of every point, in order: what a chart needs, without decoding each point."""
        rows = self._db.execute("SELECT step, tok_s, loss FROM metrics WHERE run_id=? ORDER BY seq", (run_id,))
        return [(r[0], r[1], r[2]) for r in rows]

    def cursor(self, run_id: int) -> tuple[int, str | None, bytes]:
        row = self._db.execute("SELECT offset, ident, partial FROM log_cursor WHERE run_id=?", (run_id,)).fetchone()
        if row is None:
            return 0, None, b""
        return int(row[0]), row[1], bytes(row[2] or b"")

    def set_cursor(self, run_id: int, offset: int, ident: str | None, partial: bytes) -> None:
        with self.tx() as db:
            db.execute(
                "INSERT INTO log_cursor VALUES (?,?,?,?,?) ON CONFLICT(run_id) DO UPDATE SET "
                "offset=excluded.offset, ident=excluded.ident, partial=excluded.partial, updated=excluded.updated",
                (run_id, offset, ident, partial, time.time()),
            )

    def advance_cursor(
        self, run_id: int, expect: tuple[int, str | None], offset: int, ident: str | None, partial: bytes,
        points: list[dict[str, Any]],
    ) -> bool:
        """Store a pull's points and move the cursor in one transaction, only if the cursor is still at
        `expect` (offset, ident): of two concurrent pulls of one run, one stores, the other gets False."""
        with self.tx() as db:
            row = db.execute("SELECT offset, ident FROM log_cursor WHERE run_id=?", (run_id,)).fetchone()
            now = (int(row[0]), row[1]) if row is not None else (0, None)
            if now != expect:
                return False
            self._insert_points(db, run_id, points)
            db.execute(
                "INSERT INTO log_cursor VALUES (?,?,?,?,?) ON CONFLICT(run_id) DO UPDATE SET "
                "offset=excluded.offset, ident=excluded.ident, partial=excluded.partial, updated=excluded.updated",
                (run_id, offset, ident, partial, time.time()),
            )
        return True

    # --- file hashes seen in a run's container (schema version 2) ---------------------------------

    def set_run_files(self, run_id: int, kind: str, files: dict[str, dict[str, Any] | None]) -> None:
        """Replace what is known of one kind of file (deployed | checkpoint) of a run."""
        now = time.time()
        with self.tx() as db:
            db.execute("DELETE FROM run_files WHERE run_id=? AND kind=?", (run_id, kind))
            db.executemany(
                "INSERT INTO run_files VALUES (?,?,?,?,?,?,?)",
                [(run_id, kind, path, (h or {}).get("sha256"), (h or {}).get("size"), (h or {}).get("mtime_ns"), now)
                 for path, h in files.items()],
            )

    def run_files(self, run_id: int, kind: str) -> dict[str, dict[str, Any] | None]:
        rows = self._db.execute(
            "SELECT path, sha256, size, mtime_ns FROM run_files WHERE run_id=? AND kind=? ORDER BY path",
            (run_id, kind))
        return {r[0]: ({"sha256": r[1], "size": r[2], "mtime_ns": r[3]} if r[1] is not None else None)
                for r in rows}

    # --- supervisor: events, restarts, the lease (schema version 4) --------------------------------

    def add_event(self, run_id: int | None, kind: str, summary: str, doc: dict[str, Any], *,
                  from_verdict: str | None = None, to_verdict: str | None = None) -> int:
        with self.tx() as db:
            cur = db.execute(
                "INSERT INTO events (run_id, time, kind, from_verdict, to_verdict, summary, doc) "
                "VALUES (?,?,?,?,?,?,?)",
                (run_id, doc.get("time", time.time()), kind, from_verdict, to_verdict, summary,
                 json.dumps(doc, default=str)))
            event_id = cur.lastrowid
        assert event_id is not None
        return event_id

    def events(self, run_id: int | None = None, *, after: int = 0, limit: int = 200) -> list[dict[str, Any]]:
        """Events oldest first (after id `after`), of one run or all."""
        if run_id is None:
            rows = self._db.execute("SELECT * FROM events WHERE id>? ORDER BY id LIMIT ?", (after, limit))
        else:
            rows = self._db.execute("SELECT * FROM events WHERE id>? AND run_id=? ORDER BY id LIMIT ?",
                                    (after, run_id, limit))
        return [{**json.loads(r["doc"]), "id": r["id"], "kind": r["kind"], "summary": r["summary"]} for r in rows]

    def latest_events(self, limit: int, *, run_id: int | None = None) -> list[dict[str, Any]]:
        """The newest `limit` events (of one run or all), oldest first."""
        where, args = ("WHERE run_id=?", (run_id, limit)) if run_id is not None else ("", (limit,))
        rows = list(self._db.execute(f"SELECT * FROM events {where} ORDER BY id DESC LIMIT ?", args))  # noqa: S608
        return [{**json.loads(r["doc"]), "id": r["id"], "kind": r["kind"], "summary": r["summary"]}
                for r in reversed(rows)]

    def last_verdict(self, run_id: int) -> str | None:
        row = self._db.execute("SELECT to_verdict FROM events WHERE run_id=? AND kind='verdict' ORDER BY id DESC "
                               "LIMIT 1", (run_id,)).fetchone()
        return row[0] if row is not None else None

    def plan_restart(self, failed_run_id: int, doc: dict[str, Any]) -> dict[str, Any] | None:
        """Claim the one relaunch of a failure; None when it was planned before (by us or an earlier supervisor),
        else the new plan."""
        try:
            with self.tx() as db:
                db.execute("INSERT INTO restarts (failed_run_id, state, time, doc) VALUES (?, 'planned', ?, ?)",
                           (failed_run_id, time.time(), json.dumps(doc, default=str)))
        except sqlite3.IntegrityError:
            return None
        return self.restart(failed_run_id)

    def restart(self, failed_run_id: int) -> dict[str, Any] | None:
        row = self._db.execute("SELECT * FROM restarts WHERE failed_run_id=?", (failed_run_id,)).fetchone()
        return dict(row) if row is not None else None

    def unfinished_restarts(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._db.execute(
            "SELECT * FROM restarts WHERE state IN ('planned', 'launching') ORDER BY time")]

    def take_restart(self, failed_run_id: int) -> bool:
        """planned -> launching, for one caller only: False when another process took it first (two supervisors
        that both believe they hold the lease, one of them stalled past its expiry)."""
        with self.tx() as db:
            cur = db.execute("UPDATE restarts SET state='launching' WHERE failed_run_id=? AND state='planned'",
                             (failed_run_id,))
            return cur.rowcount == 1

    def set_restart(self, failed_run_id: int, **fields: Any) -> None:
        with self.tx() as db:
            db.execute(f"UPDATE restarts SET {', '.join(f'{k}=?' for k in fields)} WHERE failed_run_id=?",  # noqa: S608
                       (*fields.values(), failed_run_id))

    def lineage(self, run_id: int) -> list[RunRecord]:
        """The run and its ancestors, oldest first (parent_id links written by restarts)."""
        chain: list[RunRecord] = []
        seen: set[int] = set()
        rid: int | None = run_id
        while rid is not None and rid not in seen:
            seen.add(rid)
            rec = self.run_by_id(rid)
            chain.append(rec)
            rid = rec.parent_id
        return chain[::-1]

    def take_lease(self, name: str, holder: str, ttl: float, *, replacing: str | None = None
                   ) -> tuple[bool, dict[str, Any] | None]:
        """Hold lease `name` for ttl seconds (renewed by calling again): (held, the current holder's row).
        `replacing`: a holder known to be gone (its process no longer exists), whose lease is taken over before it
        expires; only that holder's, so two supervisors that both saw it die cannot both take it."""
        now = time.time()
        with self.tx() as db:
            row = db.execute("SELECT * FROM leases WHERE name=?", (name,)).fetchone()
            if row is not None and row["holder"] not in (holder, replacing) and row["expires"] > now:
                return False, dict(row)
            since = row["since"] if row is not None and row["holder"] == holder else now
            db.execute("INSERT INTO leases VALUES (?,?,?,?) ON CONFLICT(name) DO UPDATE SET holder=excluded.holder, "
                       "since=excluded.since, expires=excluded.expires", (name, holder, since, now + ttl))
        return True, {"name": name, "holder": holder, "since": since, "expires": now + ttl}

    def drop_lease(self, name: str, holder: str) -> None:
        with self.tx() as db:
            db.execute("DELETE FROM leases WHERE name=? AND holder=?", (name, holder))

    # --- exports (schema version 8) ------------------------------------------------------------------

    def add_export(self, run_id: int, *, step: int, dtype: str, node: str, checkpoint: str, path: str,
                   files: dict[str, Any], provenance: dict[str, Any], when: float | None = None) -> int:
        with self.tx() as db:
            cur = db.execute(
                "INSERT INTO exports (run_id, time, step, dtype, node, checkpoint, path, files, provenance) "
                "VALUES (?,?,?,?,?,?,?,?,?)",
                (run_id, time.time() if when is None else when, step, dtype, node, checkpoint, path,
                 json.dumps(files, sort_keys=True), json.dumps(provenance, sort_keys=True, default=str)))
            export_id = cur.lastrowid
        assert export_id is not None
        return export_id

    def exports(self, run_id: int) -> list[dict[str, Any]]:
        """A run's exports, oldest first."""
        rows = self._db.execute("SELECT * FROM exports WHERE run_id=? ORDER BY id", (run_id,))
        return [{**dict(r), "files": json.loads(r["files"]), "provenance": json.loads(r["provenance"])}
                for r in rows]

    # --- runbook runs (schema version 3) ----------------------------------------------------------

    def start_runbook(self, name: str, path: str, sha256: str, variables: dict[str, Any]) -> int:
        """Record a runbook run as 'running' before its first step, so an interrupted one still shows up."""
        with self.tx() as db:
            cur = db.execute(
                "INSERT INTO runbook_runs (name, path, sha256, started, outcome, vars, steps) "
                "VALUES (?,?,?,?,'running',?,'[]')",
                (name, path, sha256, time.time(), json.dumps(variables, sort_keys=True, default=str)))
            run_id = cur.lastrowid
        assert run_id is not None
        return run_id

    def finish_runbook(self, run_id: int, outcome: str, exit_code: int, message: str | None,
                       steps: list[dict[str, Any]]) -> None:
        with self.tx() as db:
            db.execute("UPDATE runbook_runs SET ended=?, outcome=?, exit_code=?, message=?, steps=? WHERE id=?",
                       (time.time(), outcome, exit_code, message, json.dumps(steps, default=str), run_id))

    def runbook_runs(self, *, name: str | None = None, limit: int = 30) -> list[RunbookRun]:
        if name:
            rows = self._db.execute("SELECT * FROM runbook_runs WHERE name=? ORDER BY id DESC LIMIT ?", (name, limit))
        else:
            rows = self._db.execute("SELECT * FROM runbook_runs ORDER BY id DESC LIMIT ?", (limit,))
        return [RunbookRun(r["id"], r["name"], r["path"], r["sha256"], r["started"], r["ended"], r["outcome"],
                           r["exit_code"], r["message"], json.loads(r["vars"]), json.loads(r["steps"]))
                for r in rows]


@dataclass(frozen=True)
class RunbookRun:
    """One run of a runbook: its file's hash, its vars, each step's outcome."""

    id: int
    name: str
    path: str
    sha256: str
    started: float
    ended: float | None
    outcome: str
    exit_code: int | None
    message: str | None
    vars: dict[str, Any]
    steps: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


_LIVE = tuple(sorted(s.value for s in LIVE))  # the live states, as SQL parameters
_LIVE_MARKS = ", ".join("?" * len(_LIVE))
_LIVE_WHOLE = f"state IN ({_LIVE_MARKS}) AND member_of IS NULL ORDER BY created DESC"  # live runs, one row per run

_JSON_FIELDS = {"files", "vars", "rendered", "env"}


def _encode(fields: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in fields.items():
        if k in _JSON_FIELDS and v is not None:
            out[k] = json.dumps(v, sort_keys=True, default=str)
        elif isinstance(v, bool):
            out[k] = int(v)
        else:
            out[k] = v
    return out


def _run(row: sqlite3.Row | None) -> RunRecord:
    if row is None:
        raise InputError("run not found in the registry")
    d = dict(row)
    for k in _JSON_FIELDS:
        d[k] = json.loads(d[k]) if d.get(k) else ({} if k != "env" else None)
    d["dirty"] = bool(d.get("dirty"))
    d["good"] = bool(d.get("good"))
    d["state"] = Lifecycle(d["state"])
    d["key"] = d["ct"]
    d["ct"] = name_of(d["ct"])
    # A later ctl's columns (its registry, read by this one after a downgrade) are left out, not a TypeError.
    return RunRecord(**{k: v for k, v in d.items() if k in RunRecord.__dataclass_fields__})
