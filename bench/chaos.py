"""Faults on purpose: a soak that breaks containers, hosts, sessions and the supervisor, and counts what survived.

    python bench/chaos.py [--minutes 30] [--seed S] [--interval 2] [--restarts 8] [--rate 6]

On the local Proxmox test host (tests/pvehost, root only): CT 200, 201 (pve1) and CT 300, 301 (pve2) each run
tests/fakepayload/ckpt_trainer.py (real checkpoints, manifest written last, a copy of its log beside it); one
`ctl supervise --restart on-failure:N --notify cmd:...` under test and a second with `--standby`. Faults come
from a schedule seeded by --seed (printed: the same seed draws the same faults at the same times; which run
each hits also depends on what is busy then), several at once; every
few seconds and at the end the invariants are checked (Soak.check) and each violation recorded with the seed
and the time. The figure: per fault type injected / detected / recovered, median and worst seconds to detect
and to recover; violations (goal 0).

Built fault types (FAULTS): kill9, nodekill (kill -9 of one node of the job), oom (exit 1 with the cuda-oom text),
stall (SIGSTOP), ctstop (container stopped, started again), freeze (a node's sshd tree SIGSTOPped), sshd (a node's
sshd restarted), session (the persistent session process killed -9), supkill (the supervisor killed -9: the standby
takes over), reglock (the registry held by another writer for 10 s), opstop (an operator's `ctl stop`: never
relaunched), diskfull (a size-limited tmpfs mounted over the run's checkpoint directory, in the container's mount
namespace only, with a copy of what it held and room for half a checkpoint: the next checkpoint's write fails
halfway).
CT 200 and CT 300 are the two nodes of job `pair` (both in the host's network namespace, as
tests/integration/test_multinode_pve.py has them): a run fault that picks the job hits one node of it (a node
killed, stalled, its disk filled...) and the supervisor must end and relaunch the job whole.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.pvehost import PveHost, find_free_port, missing_prerequisites  # noqa: E402

CTS = {"ct200": 200, "ct201": 201, "ct300": 300, "ct301": 301}
JOB, JOB_NODES = "pair", ("ct200", "ct300")
JOB_ADDRESS = {"ct200": "127.0.0.12", "ct300": "127.0.0.13"}
NODE_OF = {"ct200": "pve1", "ct201": "pve1", "ct300": "pve2", "ct301": "pve2"}
RUN_FAULTS = ("kill9", "nodekill", "oom", "stall", "ctstop", "opstop", "diskfull")  # on one container's run
FAULTS = (*RUN_FAULTS, "freeze", "sshd", "session", "supkill", "reglock")
CKPT_BYTES = 131072
AGENT_ARGV = b"\0-I\0-S\0-c\0"  # how ctl starts its agents and relays: python3 -I -S -c BOOT N [VERB ...]
START = f"""#!/usr/bin/env bash
exec python3 {{{{ payload["ckpt_trainer.py"] }}}} --interval 0.5 --ckpt-every 8 --ckpt-bytes {CKPT_BYTES}
"""
SINK = """import fcntl, json, sys
doc = json.loads(sys.stdin.read())
with open(sys.argv[1], "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.write(json.dumps(doc) + "\\n")
"""


@dataclass
class Fault:
    kind: str
    target: str  # CT, node or "supervisor"/"registry"
    t0: float
    run: str | None = None  # CT/NAME the fault hit
    t_end: float | None = None  # when the fault was lifted (freeze, ctstop, reglock)
    detected: float | None = None
    recovered: float | None = None
    note: str = ""


@dataclass
class Soak:
    host: PveHost
    work: Path
    seed: int
    interval: float = 2.0
    restarts: int = 8
    stall_after: float = 12.0
    tag: str = "chaos"
    freeze_s: tuple[float, float] = (20.0, 120.0)
    job: bool = True  # CT 200 and CT 300 as the two nodes of job `pair` (in the host's network namespace)
    rdzv_port: int = 29400
    faults: list[Fault] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    t_start: float = field(default_factory=time.time)
    stopped_by_operator: set[int] = field(default_factory=set)
    frozen: dict[str, tuple[float, float | None]] = field(default_factory=dict)  # node -> (from, to)
    freeze_windows: list[tuple[str, float, float]] = field(default_factory=list)
    busy: set[str] = field(default_factory=set)
    # sup pid -> (t, rss, descriptors but the registry's, the registry's)
    samples: dict[int, list[tuple[float, int, int, int]]] = field(default_factory=dict)
    fds: dict[int, tuple[dict[str, int], dict[str, int]]] = field(default_factory=dict)  # pid -> first, last kinds
    killed: set[int] = field(default_factory=set)  # supervisors the soak killed (supkill)
    exits: list[tuple[float, int, int]] = field(default_factory=list)  # (time, pid, code) of those that ended alone
    seen_ckpts: set[Path] = field(default_factory=set)
    seen_rows: tuple[set[int], set[int]] = field(default_factory=lambda: (set(), set()))
    lock: threading.Lock = field(default_factory=threading.Lock)

    # --- set-up ----------------------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, CTL_STATE_DIR=str(self.work / "state"), PYTHONPATH=str(REPO))

    def ctl(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "controller", "-i", str(self.work / "inventory.yaml"), *args],
                              capture_output=True, text=True, timeout=timeout, env=self.env, cwd=self.work)

    def set_up(self, units: list[str] | None = None) -> None:
        """The inventory, a deploy and a launch of each of `units` (default: every one)."""
        shutil.copy(REPO / "tests" / "fakepayload" / "ckpt_trainer.py", self.work / "ckpt_trainer.py")
        (self.work / "start.sh.j2").write_text(START)
        (self.work / "sink.py").write_text(SINK)
        timeouts = {"timeout": 3, "connect_timeout": 3}
        containers: dict[str, Any] = {ct: {"gpus": {}} for ct in CTS}
        jobs: dict[str, Any] = {}
        if self.job:
            for ct in JOB_NODES:
                self.host.set_host_network(CTS[ct], True)
                containers[ct].update(address=JOB_ADDRESS[ct], nccl={"socket_ifname": "lo"})
            jobs = {"jobs": {JOB: {"nodes": list(JOB_NODES), "rdzv_port": self.rdzv_port, "nproc_per_node": 1,
                                   "preflight_timeout": 3}}}
        self.host.write_inventory(
            self.work / "inventory.yaml", hosts={"pve1": timeouts, "pve2": timeouts},
            containers=containers, **jobs,
            payload=[{"src": "ckpt_trainer.py", "dest": f"/root/{self.tag}/ckpt_trainer.py"},
                     {"template": "start.sh.j2", "dest": f"/root/{self.tag}/start_training.sh", "mode": "0755"}],
            runs={"series": "c", "session": self.tag, "log": f"/workspace/{self.tag}/train_{{run}}.log",
                  "dir": f"/workspace/{self.tag}/runs/{{run}}"})
        units = self.units if units is None else units
        r = self.ctl("deploy", *(ct for u in units for ct in self.nodes_of(u)), "--allow-dirty")
        if r.returncode != 0:
            raise SystemExit(f"chaos: deploy failed:\n{r.stdout}{r.stderr}")
        for unit in units:
            self.launch(unit)

    @property
    def units(self) -> list[str]:
        """What runs: a container of its own, or the job across JOB_NODES."""
        return [ct for ct in CTS if ct not in JOB_NODES] + [JOB] if self.job else list(CTS)

    def nodes_of(self, unit: str) -> tuple[str, ...]:
        return JOB_NODES if unit == JOB else (unit,)

    def launch(self, ct: str) -> None:
        r = self.ctl("launch", ct)
        if r.returncode != 0:
            self.note(f"launch {ct} failed: {(r.stderr or r.stdout).strip()[-300:]}")

    def supervise_argv(self, standby: bool) -> list[str]:
        return [sys.executable, "-m", "controller", "-i", str(self.work / "inventory.yaml"), "supervise",
                "--interval", f"{self.interval:g}s", "--restart", f"on-failure:{self.restarts}", "--backoff", "1s",
                "--stall-after", f"{self.stall_after:g}s",
                "--notify", f"cmd:{sys.executable} {self.work / 'sink.py'} {self.work / 'sink.jsonl'}",
                *(["--standby"] if standby else [])]

    def start_supervisor(self, standby: bool) -> subprocess.Popen[bytes]:
        log = open(self.work / "supervise.log", "ab")  # noqa: SIM115 (the child holds it)
        p = subprocess.Popen(self.supervise_argv(standby), env=self.env, cwd=self.work, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return p

    # --- reading the registry (read-only, as another process would) ------------------------------

    def db(self) -> sqlite3.Connection:
        c = sqlite3.connect(f"file:{self.work / 'state' / 'registry.sqlite3'}?mode=ro", uri=True, timeout=30)
        c.row_factory = sqlite3.Row
        return c

    def rows(self, sql: str, *args: Any) -> list[sqlite3.Row]:
        c = self.db()
        try:
            return list(c.execute(sql, args))
        finally:
            c.close()

    def live_run(self, ct: str) -> dict[str, Any] | None:
        rows = self.rows("SELECT * FROM runs WHERE ct=? AND state IN ('starting','running') ORDER BY id DESC", ct)
        return dict(rows[0]) if rows else None

    def lease(self) -> dict[str, Any] | None:
        rows = self.rows("SELECT * FROM leases WHERE name='supervise'")
        return dict(rows[0]) if rows else None

    def note(self, text: str) -> None:
        print(f"chaos [{time.time() - self.t_start:7.1f}s] {text}", flush=True)

    def violation(self, text: str) -> None:
        line = f"seed {self.seed} t+{time.time() - self.t_start:.1f}s: {text}"
        with self.lock:
            if not any(v.split(": ", 1)[1] == text for v in self.violations):
                self.violations.append(line)
                print(f"chaos VIOLATION {line}", flush=True)

    # --- the container side ----------------------------------------------------------------------

    def attach(self, ct: str, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        vmid = CTS[ct]
        node = NODE_OF[ct]
        return subprocess.run(["lxc-attach", "-P", str(self.host.lxcpath(node)), "-n", str(vmid), "--", *argv],
                              capture_output=True, text=True, timeout=timeout)

    def in_ct(self, ct: str, path: str) -> Path:
        return self.host.rootfs(CTS[ct]) / path.lstrip("/")

    def trainer_pid(self, run: dict[str, Any]) -> int | None:
        try:
            return int(self.in_ct(run["ct"], run["log_path"] + ".pid").read_text().strip())
        except (OSError, ValueError, TypeError):
            return None

    def pid_spaces(self) -> dict[str, str]:
        """The pid namespace of each running CT of this soak's host -> the CT (what tells its processes from those
        of another test host's CT of the same VMID on this machine)."""
        spaces: dict[str, str] = {}
        for ct in CTS:
            with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):  # a stopped CT holds none
                spaces[os.readlink(f"/proc/{self.init_pid(ct)}/ns/pid")] = ct
        return spaces

    def trainers(self) -> dict[str, set[str]]:
        """CT -> the CTL_RUN of every ckpt_trainer process in it (seen from the host's /proc)."""
        out: dict[str, set[str]] = {ct: set() for ct in CTS}
        spaces = self.pid_spaces()
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if f"/root/{self.tag}/ckpt_trainer.py".encode() not in (d / "cmdline").read_bytes():
                    continue
                env = dict(x.split(b"=", 1) for x in (d / "environ").read_bytes().split(b"\0") if b"=" in x)
                ct = spaces.get(os.readlink(d / "ns" / "pid"))
            except OSError:
                continue
            if ct is not None:
                out[ct].add(env.get(b"CTL_RUN", b"?").decode())
        return out

    # --- faults ----------------------------------------------------------------------------------

    def inject(self, kind: str, rng: random.Random) -> Fault | None:
        now = time.time()
        if kind in RUN_FAULTS:
            free = [u for u in self.units if not any(c in self.busy or NODE_OF[c] in self.frozen
                                                     for c in self.nodes_of(u)) and self.live_run(u) is not None]
            if not free:
                return None
            if kind == "nodekill":  # kill -9 of one node of the job
                free = [u for u in free if u == JOB]
            if not free:
                return None
            unit = rng.choice(free)
            run = self.live_run(unit)
            assert run is not None
            ct = rng.choice(self.nodes_of(unit))  # of a job: one node of it (a node killed, stalled, ...)
            node_run = run
            if unit == JOB:
                rows = self.rows("SELECT * FROM runs WHERE member_of=? AND ct=?", run["id"], ct)
                if not rows:
                    return None
                node_run = dict(rows[0])
            f = Fault(kind, ct, now, run=f"{unit}/{run['name']}")
            self.busy.update(self.nodes_of(unit))
            self.spawn(f, self._run_fault, f, unit, run, node_run, rng.uniform(5, 15))
            return f
        if kind in ("freeze", "sshd"):
            nodes = [n for n in ("pve1", "pve2") if n not in self.frozen and not self.near(n) & self.busy]
            if not nodes:
                return None
            node = rng.choice(nodes)
            f = Fault(kind, node, now)
            secs = rng.uniform(*self.freeze_s) if kind == "freeze" else 0.0
            if kind == "freeze":
                self.frozen[node] = (now, None)
            self.busy.update(self.near(node))
            self.spawn(f, self._node_fault, f, secs)
            return f
        f = Fault(kind, kind, now)
        self.spawn(f, self._global_fault, f)
        return f

    def near(self, node: str) -> set[str]:
        """The CTs a fault of `node` reaches: its own, and every node of a unit that has one there (the job spans
        both hosts: a second node fault while the first holds it would be judged against a run already
        UNREACHABLE)."""
        return {c for u in self.units if any(NODE_OF[x] == node for x in self.nodes_of(u)) for c in self.nodes_of(u)}

    def spawn(self, f: Fault, fn: Any, *args: Any) -> None:
        """The fault in a thread of its own; a failure of the harness itself is said, never swallowed."""
        def body() -> None:
            try:
                fn(*args)
            except Exception as e:  # reported in the figure and the output
                f.note = f"harness error: {type(e).__name__}: {e}"
                self.note(f"{f.kind} on {f.target}: {f.note}")

        threading.Thread(target=body, daemon=True).start()

    def _run_fault(self, f: Fault, unit: str, run: dict[str, Any], node_run: dict[str, Any], away: float) -> None:
        """`run`: the run the supervisor judges (of a job: the job's); `node_run`: the fault's container's part."""
        ct = f.target
        try:
            pid = self.trainer_pid(node_run)
            if f.kind in ("kill9", "nodekill") and pid:
                self.attach(ct, "kill", "-9", str(pid))
            elif f.kind == "oom":
                d = self.in_ct(ct, node_run["run_dir"])
                d.mkdir(parents=True, exist_ok=True)  # a run that has not written its first checkpoint yet
                (d / "crash-now").touch()
            elif f.kind == "stall" and pid:
                self.attach(ct, "kill", "-STOP", str(pid))
            elif f.kind == "ctstop":
                self.host.stop(CTS[ct])
                time.sleep(away)
                self.host.start(CTS[ct])
                f.t_end = time.time()
            elif f.kind == "diskfull":
                mounted = self.fill(ct, node_run)
                try:
                    self.wait_recovered(f, run, deadline=time.time() + 240)
                finally:
                    self.unfill(ct, mounted)
                return
            elif f.kind == "opstop":
                self.stopped_by_operator.add(int(run["id"]))
                r = self.ctl("stop", f"{unit}/{run['name']}", "--grace", "2")
                f.detected = f.recovered = time.time()
                f.note = r.stdout.strip()[-200:]
                self.launch(unit)  # a new lineage in its place
                return
            self.wait_recovered(f, run, deadline=time.time() + 240)
        finally:
            self.busy.difference_update(self.nodes_of(unit))

    def init_pid(self, ct: str) -> int:
        r = subprocess.run(["lxc-info", "-P", str(self.host.lxcpath(NODE_OF[ct])), "-n", str(CTS[ct]), "-p", "-H"],
                           capture_output=True, text=True, timeout=30, check=True)
        return int(r.stdout.strip())

    def fill(self, ct: str, run: dict[str, Any]) -> str:
        """A tmpfs of its own at the run's checkpoint directory, in the container's mount namespace only, holding
        a copy of what is there and room for half a checkpoint more: the next checkpoint's write fails (ENOSPC)
        halfway. The checkpoints underneath stay as they were (the soak checks them by the host's path)."""
        ckdir = f"{run['run_dir']}/checkpoints"
        under = self.in_ct(ct, ckdir)
        under.mkdir(parents=True, exist_ok=True)
        used = sum(-(-p.stat().st_size // 4096) * 4096 for p in under.rglob("*") if p.is_file())
        pid = self.init_pid(ct)
        size_k = (used + 3 * CKPT_BYTES // 2) // 1024
        subprocess.run(["nsenter", "-t", str(pid), "-m", "--", "mount", "-t", "tmpfs", "-o", f"size={size_k}k",
                        "chaos-full", ckdir], check=True, timeout=30, capture_output=True)
        try:  # what the trainer renames or replaces meanwhile (a checkpoint being written) is skipped, not fatal
            shutil.copytree(under, f"/proc/{pid}/root{ckdir}", symlinks=True, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns(".step_*", "*.tmp-*"))
        except (OSError, shutil.Error):
            self.unfill(ct, ckdir)
            raise
        return ckdir

    def unfill(self, ct: str, ckdir: str) -> None:
        subprocess.run(["nsenter", "-t", str(self.init_pid(ct)), "-m", "--", "umount", "-l", ckdir], timeout=30,
                       capture_output=True)

    def wait_recovered(self, f: Fault, run: dict[str, Any], deadline: float) -> None:
        """Detected: the run's first verdict change to a failure; recovered: its relaunch (or GAVE_UP)."""
        rid = int(run["id"])
        while time.time() < deadline:
            for e in self.rows("SELECT * FROM events WHERE run_id=? AND time>=? ORDER BY id", rid, f.t0 - 1):
                if f.detected is None and e["kind"] == "verdict" and e["to_verdict"] in ("crashed", "stalled",
                                                                                          "stopped"):
                    f.detected = float(e["time"])
                if e["kind"] in ("restart", "gave_up", "refused"):
                    f.detected = f.detected or float(e["time"])
                    f.recovered = float(e["time"])
                    f.note = e["kind"]
                    if e["kind"] in ("gave_up", "refused"):
                        # a new lineage, so the soak goes on
                        self.launch(JOB if f.target in JOB_NODES and self.job else f.target)
                    return
            time.sleep(0.5)
        f.note = "not recovered within 240 s"

    def _node_fault(self, f: Fault, secs: float) -> None:
        node = f.target
        try:
            listener = int((self.host.base / node / "sshd.pid").read_text())
            tree = descendants(listener)
            if f.kind == "freeze":
                for pid in [listener, *tree]:
                    with_signal(pid, signal.SIGSTOP)
                time.sleep(secs)
                for pid in [listener, *tree]:
                    with_signal(pid, signal.SIGCONT)
                f.t_end = time.time()
                self.frozen[node] = (f.t0, f.t_end)
                self.freeze_windows.append((node, f.t0, f.t_end))
                self._wait_back(f, node)
            else:
                for pid in [listener, *tree]:
                    with_signal(pid, signal.SIGKILL)
                spec = next(n for n in self.host.nodes if n.name == node)
                self.host._start_sshd(spec)
                f.t_end = time.time()
                f.detected = f.t_end
                self._wait_polled(f)
        finally:
            self.frozen.pop(node, None)
            self.busy.difference_update(self.near(node))

    def _wait_back(self, f: Fault, node: str) -> None:
        """Detected: an UNREACHABLE verdict of a run on the node; recovered: a verdict out of it after the thaw."""
        assert f.t_end is not None
        deadline = f.t_end + 120
        cts = [ct for ct in CTS if NODE_OF[ct] == node and self.host.node_of(CTS[ct]).name == node
               and ct != "ct301"]  # CT 301 is reached through its own sshd, not its node's
        if self.job:
            cts.append(JOB)  # a node on every host
        while time.time() < deadline:
            evs = self.rows("SELECT * FROM events WHERE kind='verdict' AND time>=? ORDER BY id", f.t0 - 1)
            evs = [e for e in evs if json.loads(e["doc"]).get("ct") in cts]
            downs = [e for e in evs if e["to_verdict"] == "unreachable"]
            if downs:
                f.detected = float(downs[0]["time"])
                ups = [e for e in evs if e["from_verdict"] == "unreachable" and e["time"] >= f.t_end]
                if ups:
                    f.recovered = float(ups[-1]["time"])
                    return
            elif time.time() > f.t_end + 3 * self.interval + 5:
                f.note = "no UNREACHABLE seen"
                return
            time.sleep(0.5)

    def _wait_polled(self, f: Fault, deadline_s: float = 60) -> None:
        """Recovered: the supervisor holding the lease renewed it after the fault was lifted."""
        assert f.t_end is not None
        ttl = max(3 * self.interval, 10.0)
        while time.time() < f.t_end + deadline_s:
            row = self.lease()
            if row and float(row["expires"]) - ttl > f.t_end:
                f.recovered = float(row["expires"]) - ttl
                return
            time.sleep(0.2)
        f.note = "the supervisor did not poll again"

    def _global_fault(self, f: Fault) -> None:
        if f.kind == "session":
            killed = 0
            for info in (self.work / "state" / "mux").glob("*.json"):
                try:
                    pid = int(json.loads(info.read_text())["pid"])
                    if b"controller.transport.mux" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        os.kill(pid, signal.SIGKILL)
                        killed += 1
                except (OSError, ValueError, KeyError):
                    continue
            f.note = f"{killed} session(s)"
            f.t_end = f.detected = time.time()
            self._wait_polled(f)
        elif f.kind == "reglock":
            c = sqlite3.connect(self.work / "state" / "registry.sqlite3", timeout=30)
            c.execute("BEGIN EXCLUSIVE")
            time.sleep(10)
            c.rollback()
            c.close()
            f.t_end = f.detected = time.time()
            self._wait_polled(f)
        elif f.kind == "supkill":
            self.supkill(f)

    sups: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def holder_pid(self) -> int | None:
        row = self.lease()
        try:
            return int(row["holder"].split(":")[1]) if row else None
        except (IndexError, ValueError):
            return None

    def supkill(self, f: Fault) -> None:
        pid = self.holder_pid()
        before = self.lease()
        if pid is None or before is None:
            f.note = "no lease holder"
            return
        with self.lock:
            self.killed.add(pid)
        with_signal(pid, signal.SIGKILL)
        f.t_end = time.time()
        for p in self.sups:
            if p.pid == pid:
                p.wait()
        with self.lock:
            self.sups = [p for p in self.sups if p.poll() is None]
            self.sups.append(self.start_supervisor(standby=True))  # the killed one comes back as the standby
        while time.time() < f.t0 + 120:
            row = self.lease()
            if row and row["holder"] != before["holder"]:
                f.detected = f.recovered = float(row["since"])
                return
            time.sleep(0.3)
        f.note = "nobody took the lease over"

    def restart_exited(self) -> None:
        """A supervisor that ended on its own (it lost its lease, or failed) is started again as a standby, as
        the systemd unit's Restart=on-failure does; each such end is said and counted."""
        with self.lock:
            for p in [p for p in self.sups if p.poll() is not None and p.pid not in self.killed]:
                self.exits.append((time.time(), p.pid, int(p.returncode)))
                self.note(f"supervisor {p.pid} exited {p.returncode} on its own (supervise.log says why); "
                          "started again as a standby")
                self.sups.remove(p)
                self.sups.append(self.start_supervisor(standby=True))

    # --- invariants ------------------------------------------------------------------------------

    def check(self, final: bool = False) -> None:
        runs = [dict(r) for r in self.rows("SELECT * FROM runs")]
        events = [dict(e) for e in self.rows("SELECT * FROM events ORDER BY id")]
        restarts = [dict(r) for r in self.rows("SELECT * FROM restarts")]
        by_id = {r["id"]: r for r in runs}
        # nothing deleted: every run and event row seen before is still there
        ids, evids = {r["id"] for r in runs}, {e["id"] for e in events}
        for gone in self.seen_rows[0] - ids:
            self.violation(f"registry run row {gone} deleted")
        for gone in self.seen_rows[1] - evids:
            self.violation(f"registry event row {gone} deleted")
        self.seen_rows[0].update(r["id"] for r in runs if r["state"] != "starting")  # a claim may be released
        self.seen_rows[1].update(evids)
        # one crash, one relaunch; never a relaunch of an operator-stopped run
        children: dict[int, list[int]] = {}
        for r in runs:
            if r["parent_id"] is not None and r["member_of"] is None:  # a job's nodes share its parent
                children.setdefault(r["parent_id"], []).append(r["id"])
        for parent, kids in children.items():
            if len(kids) > 1:
                self.violation(f"run {parent} relaunched {len(kids)} times for one failure: runs {kids}")
            if parent in self.stopped_by_operator:
                self.violation(f"run {parent} was stopped by the operator and relaunched as {kids}")
        # the budget: at most `restarts` relaunches per lineage, then GAVE_UP notified once
        for r in runs:
            depth, x = 0, r
            while x["parent_id"] is not None and x["parent_id"] in by_id:
                depth, x = depth + 1, by_id[x["parent_id"]]
            if depth > self.restarts:
                self.violation(f"run {r['id']} is restart {depth} of its lineage, past the budget {self.restarts}")
        gave = [e for e in events if e["kind"] == "gave_up"]
        for rid in {e["run_id"] for e in gave}:
            if sum(e["run_id"] == rid for e in gave) > 1:
                self.violation(f"GAVE_UP recorded more than once for run {rid}")
        # an unreachable host: never CRASHED, nothing relaunched for it
        for node, t0, t1 in self.freeze_windows:
            cts = {ct for ct in CTS if NODE_OF[ct] == node and ct != "ct301"} | ({JOB} if self.job else set())
            for e in events:
                doc = json.loads(e["doc"])
                if doc.get("ct") in cts and t0 + 1 <= e["time"] <= t1 and (
                        e["to_verdict"] == "crashed" or e["kind"] == "restart"):
                    self.violation(f"{doc.get('run')}: {e['kind']} {e['to_verdict']} while {node} was frozen "
                                   f"({e['summary'][:120]})")
        # resume from the newest complete checkpoint
        for r in runs:
            if not r["resumed_from"]:
                continue
            ct = r["ct"]
            ck = self.in_ct(ct, r["resumed_from"]) if ct in CTS else None
            if ck is not None and complete(ck) is None:
                self.violation(f"{ct}/{r['name']} resumed from {r['resumed_from']}, not a complete checkpoint")
            if ct not in CTS:
                continue
            # a node of a job resumes from the newest step that every node of it held complete (one node's disk
            # may be too full to take a copy of a newer one)
            held = [self.complete_steps(c, r, by_id) for c in (JOB_NODES if r["member_of"] is not None else (ct,))]
            newest = max(set.intersection(*held), default=0)
            if newest > int(r["resumed_step"] or 0):
                self.violation(f"{ct}/{r['name']} resumed from step {r['resumed_step']} but step {newest} was "
                               f"complete" + (" on every node" if len(held) > 1 else ""))
        # nothing lost: checkpoints seen stay; every log keeps the bytes its copy has
        for ct in CTS:
            base = self.in_ct(ct, f"/workspace/{self.tag}/runs")
            for d in base.glob("*/checkpoints/step_*") if base.is_dir() else []:
                if complete(d) is not None:
                    self.seen_ckpts.add(d)
        for d in self.seen_ckpts:
            if complete(d) is None:
                self.violation(f"checkpoint {d} deleted or changed")
        for r in runs:
            if r["ct"] in CTS and r["log_path"]:
                log, copy = self.in_ct(r["ct"], r["log_path"]), self.in_ct(r["ct"], r["log_path"] + ".copy")
                if copy.exists() and log.exists() and not subsequence(copy.read_bytes(), log.read_bytes()):
                    self.violation(f"{r['ct']}/{r['name']}: its log lost lines its copy has")
        # every event delivered at most once per sink, and every notified one delivered
        sink = self.work / "sink.jsonl"
        got: dict[str, int] = {}
        for line in sink.read_text().splitlines() if sink.exists() else []:
            i = json.loads(line).get("event_id")
            got[i] = got.get(i, 0) + 1
        for i, n in got.items():
            if n > 1:
                self.violation(f"event {i} delivered {n} times to the cmd sink")
        if final:
            for e in events:
                doc = json.loads(e["doc"])
                wanted = e["kind"] in ("restart", "gave_up") or e["to_verdict"] in ("crashed", "stalled")
                if wanted and doc.get("event_id") not in got and e["time"] < time.time() - 10:
                    self.violation(f"event {e['id']} ({e['summary'][:80]}) never reached the cmd sink")
            self.final_checks(runs)
        # the supervisor's RSS and descriptors
        pid = self.holder_pid()
        if pid:
            try:
                rss = next(int(x.split()[1]) for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                           if x.startswith("VmRSS:"))
                kinds = fd_kinds(pid, self.work / "state" / "registry.sqlite3")
                self.samples.setdefault(pid, []).append((time.time(), rss, sum(kinds.values()) - kinds["registry"],
                                                         kinds["registry"]))
                self.fds[pid] = (self.fds.get(pid, (kinds, kinds))[0], kinds)
            except (OSError, StopIteration):
                pass
        for rec in restarts:
            if rec["state"] == "done" and rec["new_run_id"] not in by_id:
                self.violation(f"restart of run {rec['failed_run_id']} names a run that is not there")

    def complete_steps(self, ct: str, r: dict[str, Any], by_id: dict[int, dict[str, Any]]) -> set[int]:
        """The steps complete in `ct` before run `r` was created, in the checkpoint directories of its lineage."""
        steps: set[int] = set()
        x = by_id.get(r["parent_id"])
        while x is not None:
            for d in self.in_ct(ct, f"{x['run_dir']}/checkpoints").glob("step_*"):
                s = complete(d)
                if s is not None and d.stat().st_mtime < r["created"]:
                    steps.add(s)
            x = by_id.get(x["parent_id"])
        return steps

    def leftovers(self) -> list[tuple[int, str]]:
        """ctl's agents in this soak's containers (matched by the container's pid namespace) and its relays on the
        test host's nodes (matched by the SSH connection their sshd gave them): (pid, where and what)."""
        spaces = self.pid_spaces()
        ends = {f" {n.address} {self.host.port}" for n in self.host.nodes}
        out = []
        for d in Path("/proc").iterdir():
            try:
                if not d.name.isdigit() or AGENT_ARGV not in (cmd := (d / "cmdline").read_bytes()):
                    continue
                where = spaces.get(os.readlink(d / "ns" / "pid"))
                if where is None:
                    env = (d / "environ").read_bytes().split(b"\0")
                    conn = next((x[15:].decode() for x in env if x.startswith(b"SSH_CONNECTION=")), "")
                    if not any(conn.endswith(e) for e in ends):
                        continue
                    where = f"the relay of {conn.split()[2]}"
                argv = cmd.rstrip(b"\0").split(b"\0")
                out.append((int(d.name), f"{where}: {' '.join(a.decode(errors='replace') for a in argv[5:7])}"))
            except OSError:
                continue
        return out

    def check_leftovers(self, settle_s: float = 60) -> None:
        """With every supervisor stopped and the soak's sessions ended, no agent or relay of ctl may be left: they
        end when their stdin does. Each one still there after `settle_s` (a hang detector) is a violation."""
        from controller.transport import mux

        with contextlib.suppress(Exception):  # what is left is what counts, whatever stop said
            mux.stop(timeout=10, grace=0, state=self.work / "state")
        deadline = time.time() + settle_s
        while (left := self.leftovers()) and time.time() < deadline:
            time.sleep(0.5)
        for pid, what in left:
            self.violation(f"pid {pid}, {what}, is left with no run and no session to own it")

    def final_checks(self, runs: list[dict[str, Any]]) -> None:
        r = self.ctl("--json", "runs")
        live = {(ct, x["name"]) for x in json.loads(r.stdout or "[]") if x["state"] in ("running", "starting")
                for ct in self.nodes_of(x["ct"])}
        held = {(ct, n) for ct, names in self.trainers().items() for n in names}
        for ct, name in sorted(live - held):
            self.violation(f"`ctl runs` says {ct}/{name} runs, but no trainer of it is in {ct}")
        for ct, name in sorted(held - live):
            self.violation(f"a trainer of {ct}/{name} is left that no live run owns")
        for pid, s in self.samples.items():
            if len(s) < 8:
                continue
            # Growth that goes on, not warm-up: a leak shows as the last quarter above the most the first half
            # ever held (a session reconnecting after a fault holds its socket again, so the first half's most).
            q = len(s) // 4
            first, last = s[:len(s) // 2], s[-q:]
            for i, what in ((1, "RSS"), (2, "open descriptors (the registry's aside)")):
                a, b = max(x[i] for x in first), statistics.mean(x[i] for x in last)
                if b > a * 1.10 + (2 if i == 2 else 0):
                    self.violation(f"supervisor {pid}: {what} grew {a:.0f} (the first half's most) -> {b:.0f} "
                                   "(the last quarter's mean; > 10 %)")
            # The registry keeps one SQLite connection (the database and its WAL: 2 descriptors; the shared-memory
            # file once a process) for each thread that ever used it at once, kept for the next thread: as many as
            # the most threads of one poll (one per container, the main one, the notifier), never more.
            most = 2 * (len(CTS) + 2) + 1
            if max(x[3] for x in s) > most:
                self.violation(f"supervisor {pid}: {max(x[3] for x in s)} registry descriptors, more than the "
                               f"{most} of one SQLite connection for each thread that can use it at once")

    # --- the figure ------------------------------------------------------------------------------

    def figure(self) -> str:
        lines = [f"{'fault':9} {'injected':>8} {'detected':>8} {'recovered':>9} {'detect med/p90/max s':>21} "
                 f"{'recover med/p90/max s':>22}"]
        for kind in FAULTS:
            fs = [f for f in self.faults if f.kind == kind]
            if not fs:
                continue
            det = [f.detected - f.t0 for f in fs if f.detected is not None]
            rec = [f.recovered - f.t0 for f in fs if f.recovered is not None]

            def mm(xs: list[float]) -> str:
                return f"{statistics.median(xs):.1f} / {p90(xs):.1f} / {max(xs):.1f}" if xs else "-"

            lines.append(f"{kind:9} {len(fs):8} {len(det):8} {len(rec):9} {mm(det):>21} {mm(rec):>22}")
        for f in self.faults:
            if f.recovered is None or f.note.startswith("harness"):
                lines.append(f"  not recovered: {f.kind} on {f.target} at t+{f.t0 - self.t_start:.0f}s: {f.note}")
        for pid, s in self.samples.items():
            first, last = self.fds[pid]
            lines.append(f"supervisor {pid}: {len(s)} samples over {s[-1][0] - s[0][0]:.0f} s; RSS {s[0][1]} -> "
                         f"{s[-1][1]} kB (most {max(x[1] for x in s)}); descriptors {first} -> {last}")
        lines.append(f"supervisors that ended on their own (started again as standbys): {len(self.exits)}"
                     + "".join(f"; pid {pid} exit {code} at t+{t - self.t_start:.0f}s" for t, pid, code in self.exits))
        lines.append(f"invariant violations: {len(self.violations)}")
        lines.extend(f"  {v}" for v in self.violations)
        return "\n".join(lines)

    def tear_down(self) -> None:
        for p in self.sups:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self.sups:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def p90(xs: list[float]) -> float:
    """The 90th percentile, nearest rank (of a handful of faults: the worst but one or two)."""
    return sorted(xs)[max(0, -(-9 * len(xs) // 10) - 1)]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fd_kinds(pid: int, registry: Path) -> dict[str, int]:
    """A process's open descriptors by kind: the registry's SQLite files, sockets, pipes, other files."""
    out = {"registry": 0, "socket": 0, "pipe": 0, "other": 0}
    for n in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{n}")
            kind = ("registry" if target.startswith(str(registry)) else "socket" if target.startswith("socket:")
                    else "pipe" if target.startswith("pipe:") else "other")
            out[kind] += 1
    return out


def with_signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def descendants(root: int) -> list[int]:
    table: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                table[int(d.name)] = int((d / "stat").read_text().rsplit(") ", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in table.items() if pp == p]
        out.extend(kids)
        todo.extend(kids)
    return out


_VERIFIED: dict[Path, tuple[tuple[tuple[str, int, int], ...], int]] = {}


def complete(d: Path) -> int | None:
    """The step of a checkpoint directory whose manifest is there and whose files match it, else None (hashed
    again only when a file's size or mtime changed: the soak looks at every checkpoint every few seconds)."""
    sys.path.insert(0, str(REPO / "tests" / "fakepayload"))
    from ckpt_trainer import verify

    try:
        key = tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in sorted(d.iterdir()))
        hit = _VERIFIED.get(d)
        if hit is not None and hit[0] == key:
            return hit[1]
        step = verify(d)
        _VERIFIED[d] = (key, step)
        return step
    except (ValueError, OSError, KeyError):
        return None


def subsequence(copy: bytes, log: bytes) -> bool:
    """Every line of the copy is in the log, in order (the log also has the start script's and ctl's lines)."""
    it = iter(log.splitlines())
    return all(any(line == x for x in it) for line in copy.splitlines())


def soak(host: PveHost, work: Path, seed: int, minutes: float, *, interval: float = 2.0, restarts: int = 8,
         rate: float = 6.0, kinds: tuple[str, ...] = FAULTS, each_once: bool = False, tag: str = "chaos",
         freeze_s: tuple[float, float] = (20.0, 120.0), job: bool = True, rdzv_port: int = 29400) -> Soak:
    """Run the soak: faults at about `rate` a minute (each_once: every kind of `kinds` once, in seeded order,
    then wait for them to settle); returns the Soak with its faults and violations."""
    s = Soak(host, work, seed, interval=interval, restarts=restarts, tag=tag, freeze_s=freeze_s, job=job,
             rdzv_port=rdzv_port)
    rng = random.Random(seed)
    s.set_up()
    s.sups = [s.start_supervisor(standby=False)]
    while s.lease() is None:
        time.sleep(0.2)
    s.sups.append(s.start_supervisor(standby=True))
    end = time.time() + minutes * 60
    order = list(kinds)
    rng.shuffle(order)
    # The invariants are checked every 5 s in a thread of their own: a check grows with the soak's history (every
    # checkpoint and log of every run), and must not slow the faults down as it does
    done = threading.Event()

    def checker() -> None:
        while not done.wait(5):
            try:
                s.restart_exited()
                s.check()
            except Exception as e:  # a check that cannot run checks nothing: said, and counted
                s.violation(f"the invariant check failed: {type(e).__name__}: {e}")

    checking = threading.Thread(target=checker, name="check", daemon=True)
    checking.start()
    try:
        while time.time() < end if not each_once else order:
            kind = order.pop() if each_once else rng.choice(kinds)
            f = s.inject(kind, rng)
            if f is None:
                if each_once:
                    order.insert(0, kind)
            else:
                s.faults.append(f)
                s.note(f"inject {f.kind} on {f.target}" + (f" ({f.run})" if f.run else ""))
            wait = rng.expovariate(rate / 60) if not each_once else rng.uniform(1, 4)
            time.sleep(min(wait, 30))
        settle = time.time() + 300
        while time.time() < settle and (s.busy or s.frozen or any(f.recovered is None and not f.note
                                                                 for f in s.faults)):
            time.sleep(1)
        done.set()
        checking.join()
        time.sleep(2 * interval + 2)
        s.check(final=True)
        s.tear_down()
        s.check_leftovers()
    finally:
        done.set()
        checking.join(timeout=120)
        s.tear_down()
        if job:  # the containers back in their own network namespaces, as the test host has them
            for ct in JOB_NODES:
                host.set_host_network(CTS[ct], False)
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--restarts", type=int, default=8)
    ap.add_argument("--rate", type=float, default=6.0, help="faults a minute (mean)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"chaos: seed {seed} (replay with --seed {seed})", flush=True)
    why = missing_prerequisites()
    if why:
        print(f"chaos: needs the local Proxmox host: {why}", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="ctl-bench-chaos-"))
    host = PveHost(base=base / "pve", port=find_free_port(["127.0.0.2", "127.0.0.3"])).up()
    try:
        (base / "work").mkdir()
        s = soak(host, base / "work", seed, args.minutes, interval=args.interval, restarts=args.restarts,
                 rate=args.rate, rdzv_port=free_port())
    finally:
        host.down()
    print(f"chaos: seed {seed}, {args.minutes:g} min, {len(s.faults)} faults, interval {args.interval:g}s, "
          f"restart on-failure:{args.restarts}")
    print(s.figure())
    faults = [{**vars(f), "t0": f.t0 - s.t_start} for f in s.faults]  # each fault, to look into its worst cases
    (base / "faults.json").write_text(json.dumps({"t_start": s.t_start, "faults": faults}, indent=1) + "\n")
    print(f"chaos: each fault in {base / 'faults.json'}")
    return 1 if s.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
