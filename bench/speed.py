"""Every command against its floor, in one run on the local Proxmox host (issue 17's table).

    CTL_PERSIST=0 python bench/speed.py [--repeat 5] [--big-mb 20] [--log-mb 1024] [--out bench/results/speed.json]

Brings up the local Proxmox test host (tests/pvehost) with 20 containers on each of its two nodes (they run
`sleep`; 20 of them also a fake trainer), times each case `--repeat` times, every case interleaved with the
others, and prints a markdown table of medians as multiples of the floor, `ssh host pct exec CT true` (OpenSSH,
a fresh connection), and of the seeds' way (scp + pct push + md5sum of the deploy payload: bench/deploy.py's
code), each with its goal and whether it is met.

Settings. ctl is the venv's installed `ctl` script, as users run it. The rows "default settings" run ctl with the
environment this benchmark was given: whatever CTL_PERSIST says (unset: ctl's own default), with every
persistent session and the command server stopped (`ctl mux stop`) before each timed run, so they are cold.
The rows "warm" run with CTL_PERSIST as given when it is a number above 0, else 60, right after an untimed
command that starts the host's session (a ping of ct200 and ct300: the other containers' staying agents, if
the session has none yet, are started by the timed command) and the command server (launch/server.py). The rows
"hot" run right after the same command, untimed: the session and its staying agents are up, as when a user
runs `ctl status` again. The row "right after a cold one" runs with the default settings the moment an
untimed cold run of the same command returned: its host's session is up, the command server that run started as
it exited is still loading (bench/back_to_back.py times it against another tree). Each row is labelled with the
value it ran under. A command that starts a command server as it exits (every cold one) is followed by an
untimed wait for that server, so that its start-up is not the next case's. Client CPU counts the command's own
processes and, for a served command, what the server's fork of it spent (the server's `cpu_s`).

Needs root, LXC and sshd (like the integration tests). Writes the samples as JSON beside the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.deploy import FILES, TEMPLATE, seeds_way, timed  # noqa: E402
from controller.launch import served  # noqa: E402
from tests.pvehost import PveHost, find_free_port, missing_prerequisites  # noqa: E402

CTL = Path(sys.executable).with_name("ctl")  # the installed command, as users run it (and its command server)
PER_NODE = 20  # containers per node: 2 + 18 extra
LIVE = [f"ct{v}" for v in (*range(200, 210), *range(300, 310))]  # one live run each: 20 runs on 2 hosts
LAUNCH_CT, TAIL_CT, BIG_CT = "ct219", "ct218", "ct201"
YOUNG_CT, OLD_CT = "ct216", "ct217"  # a finished run of 3 points, and one of 30,000 (a 36-day run's history)
OLD_POINTS = 30_000
START = """#!/usr/bin/env bash
exec python3 {{ payload["emit_metrics.py"] }} --no-preamble --tok-s 12800 --steps {{ steps }} --interval {{ interval }}
"""
# Inside the container: how long the start script takes to print its first metric line (the trainer's own start).
TRAINER_START = """import subprocess, sys, time
t = time.monotonic()
p = subprocess.Popen(["bash", sys.argv[1]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
for line in p.stdout:
    if b"step=" in line:
        break
print(time.monotonic() - t)
p.kill()
p.wait()
"""


# On the host: CPU seconds (children's user + system) of one `pct exec` of `true`, of `cat` answering a line
# (what `ctl ping` runs), and of the agent's `poll` of one run (what `ctl status` runs per container), started by
# ctl's BOOT (its compiled code kept in the container) and, side by side, by a BOOT that compiles the source each
# time (ctl's before the code was kept). argv[1]: the vmid; stdin: the agent's source. What a container costs its
# host, whatever the client does.
HOST_CPU = """import json, resource, subprocess, sys, time
src = sys.stdin.buffer.read()
vmid = sys.argv[1]
poll = json.dumps({"root": "/", "max_bytes": 1 << 20, "runs": [{"name": "s1", "log": "/workspace/b/train_stdout_s1.log",
                   "session": "bench-s1", "state": True, "read": {"offset": 0, "max_bytes": 1}}]})
boot = BOOT  # ctl's, written in by Bench.host_cpu
compiling = "import sys;n=int(sys.argv[1]);exec(compile(sys.stdin.buffer.read(n),'ctl-agent','exec'))"
cases = {"pct_exec_true": (["true"], b""), "pct_exec_cat_ping": (["cat"], b"ctl ping 0\\n"),
         "pct_exec_agent_poll": (["python3", "-I", "-S", "-c", boot, str(len(src)), "poll", poll], src),
         "pct_exec_agent_poll_compiling": (["python3", "-I", "-S", "-c", compiling, str(len(src)), "poll", poll], src),
         "lxc_attach_agent_poll": (None, src)}
samples = {name: [] for name in cases}
for _ in range(15):  # interleaved: a few ms apart on a VM whose speed drifts
    for name, (argv, stdin) in cases.items():
        if argv is None:
            cmd = ["lxc-attach", "-P", sys.argv[2], "-n", vmid, "--", *cases["pct_exec_agent_poll"][0]]
        else:
            cmd = ["pct", "exec", vmid, "--", *argv]
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        p = subprocess.run(cmd, input=stdin, capture_output=True)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        assert p.returncode == 0, p.stderr
        samples[name].append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
print(json.dumps({name: sorted(s)[len(s) // 2] for name, s in samples.items()}))
"""


@dataclass
class Row:
    what: str
    settings: str
    seconds: float
    goal: str
    limit: float | None  # seconds the goal allows (None: a ratio row, see `ratio`)
    ratio: tuple[float, float] | None = None  # (measured ratio, allowed ratio) for "N vs 1" rows
    against: str = ""

    @property
    def met(self) -> bool:
        if self.ratio is not None:
            return self.ratio[0] <= self.ratio[1]
        assert self.limit is not None
        return self.seconds <= self.limit


def served_cpu(env: dict[str, str]) -> dict[int, float]:
    """{pid: CPU seconds} of the commands each of the user's command servers ran (and reaped) so far."""
    return {int(d["pid"]): float(d.get("cpu_s", 0.0)) for d in served.servers(env)}


class Bench:
    def __init__(self, host: PveHost, base: Path, args: argparse.Namespace) -> None:
        self.host, self.base, self.args = host, base, args
        self.work = base / "work"
        env = dict(os.environ, CTL_STATE_DIR=str(base / "state"), PYTHONPATH=str(REPO))
        # an installed ctl runs from bytecode: the untimed set-up writes ctl's __pycache__ once (bench/deploy.py)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        given = os.environ.get("CTL_PERSIST")
        self.env_default = env
        self.label_default = f"CTL_PERSIST={given}" if given is not None else "CTL_PERSIST unset"
        warm = given if given is not None and given.strip().isdigit() and int(given) > 0 else "60"
        self.env_warm = dict(env, CTL_PERSIST=warm)
        self.label_warm = f"CTL_PERSIST={warm}, warm"
        self.samples: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}  # client-side CPU seconds of each timed run
        self.case = ""
        self.counts: dict[str, dict[str, object]] = {}

    # --- helpers ---------------------------------------------------------------------------------

    def ctl(self, inv: Path, *args: str) -> list[str]:
        return [str(CTL), "-i", str(inv), *args]

    def run_ok(self, argv: list[str], env: dict[str, str], ok: tuple[int, ...] = (0,)) -> str:
        r = subprocess.run(argv, capture_output=True, text=True, env=env)
        if r.returncode not in ok:
            raise SystemExit(f"bench: {' '.join(argv[3:])[:200]} exited {r.returncode}: {r.stderr[-800:]}")
        return r.stdout

    def timed_ok(self, argv: list[str], env: dict[str, str], ok: tuple[int, ...] = (0,)) -> float:
        return self.cpu_of(lambda: self.run_ok(argv, env, ok))

    def cpu_of(self, fn: Callable[[], object]) -> float:
        """Wall seconds of fn; the CPU seconds of the processes it ran and waited for (the client side: ctl, or
        ssh/scp) go to this case's CPU samples."""
        s0 = served_cpu(self.env_warm)
        r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        fn()
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
        s1 = served_cpu(self.env_warm)  # a served command's CPU is spent in the command server's fork
        self.cpu.setdefault(self.case, []).append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime +
                                                  sum(s1.get(pid, 0.0) - s0.get(pid, 0.0) for pid in s1))
        return wall

    def cold(self) -> None:
        """No persistent session and no command server left: the next default-settings command starts from
        nothing."""
        self.run_ok(self.ctl(self.inv_runs, "mux", "stop"), self.env_warm)

    def warm(self, *cts: str) -> None:
        """The sessions of these containers' hosts are up (an untimed ping through them), and the command server."""
        self.run_ok(self.ctl(self.inv_runs, "ping", *cts), self.env_warm)
        self.settle()

    def settle(self) -> None:
        """Wait (untimed) for the command server a command started as it exited: its start-up (~0.5 s of CPU, after
        that command returned) is not the next case's."""
        deadline = time.time() + 15
        while time.time() < deadline and not served.servers(self.env_warm):
            time.sleep(0.02)

    def ssh(self, node: str, command: str) -> list[str]:
        return [*self.host.ssh_argv(node), "--", command]

    def scp(self, files: list[Path], node: str, dest: str) -> list[str]:
        addr, port, _ = self.host.hosts[node]
        return ["scp", "-q", "-F", "/dev/null", "-i", str(self.host.client_key), "-o", "IdentitiesOnly=yes",
                "-o", f"UserKnownHostsFile={self.host.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                "-o", "BatchMode=yes", "-P", str(port), *map(str, files), f"root@{addr}:{dest}"]

    # --- set-up ----------------------------------------------------------------------------------

    def setup(self) -> None:
        w = self.work
        (w / "templates").mkdir(parents=True)
        (w / "remote_payload").mkdir()
        for src in FILES:
            (w / src).write_bytes((REPO / src).read_bytes())
        (w / TEMPLATE).write_text((REPO / TEMPLATE).read_text())
        (w / "emit_metrics.py").write_bytes((REPO / "tests" / "fakepayload" / "emit_metrics.py").read_bytes())
        (w / "start.sh.j2").write_text(START)
        half = self.args.big_mb * (1 << 20) // 2
        self.big = [w / "big1.bin", w / "big2.bin"]
        for f in self.big:
            f.write_bytes(os.urandom(half))
        (w / "tiny.bin").write_bytes(b"x")
        for node in self.host.nodes:
            for vmid in node.vmids:
                self.host.set_gpus(vmid, count=8)
        h = self.host
        # the deploy payload of bench/deploy.py, for ctl and the seeds' way alike
        self.inv_deploy = h.write_inventory(w / "deploy.yaml", payload=[
            *({"src": f, "dest": f"/root/dep/{Path(f).name}"} for f in FILES),
            {"template": TEMPLATE, "dest": "/root/dep/start_training.sh", "mode": "0755"}])
        self.inv_big = h.write_inventory(w / "big.yaml", payload=[
            {"src": f.name, "dest": f"/root/big/{f.name}"} for f in self.big])
        runs = {"series": "s", "session": "bench", "log": "/workspace/b/train_stdout_{run}.log",
                "dir": "/workspace/b/runs/{run}"}
        self.inv_runs = h.write_inventory(w / "runs.yaml", runs=runs, groups={"live20": LIVE}, vars={
            "steps": 10_000_000, "interval": 1.0}, payload=[
            {"src": "emit_metrics.py", "dest": "/root/bench/emit_metrics.py"},
            {"template": "start.sh.j2", "dest": "/root/bench/start_training.sh", "mode": "0755"}])
        self.inv_launch = h.write_inventory(w / "launch.yaml", runs={**runs, "series": "l"}, vars={
            "steps": 3, "interval": 0.05}, payload=[
            {"src": "emit_metrics.py", "dest": "/root/blaunch/emit_metrics.py"},
            {"template": "start.sh.j2", "dest": "/root/blaunch/start_training.sh", "mode": "0755"}])
        e = self.env_warm
        say("set-up: deploying (deploy payload, big files, trainer) ...")
        self.run_ok(self.ctl(self.inv_deploy, "deploy", "ct200", "--allow-dirty"), e)
        self.run_ok(self.ctl(self.inv_big, "deploy", BIG_CT, "--allow-dirty"), e)
        self.run_ok(self.ctl(self.inv_runs, "deploy", "live20", "--allow-dirty"), e)
        self.run_ok(self.ctl(self.inv_launch, "deploy", LAUNCH_CT, TAIL_CT, YOUNG_CT, OLD_CT, "--allow-dirty"), e)
        rendered = w / "start_training.sh"  # the seeds push the rendered script too
        rendered.write_bytes((h.rootfs(200) / "root" / "dep" / "start_training.sh").read_bytes())
        self.seeds_files = [*(w / f for f in FILES), rendered]
        say("set-up: 20 live runs ...")
        for ct in LIVE:
            self.run_ok(self.ctl(self.inv_runs, "launch", ct, "--run", "s1"), e)
        say("set-up: the logs ctl tail reads ...")
        for run in ("small1", "big1"):
            self.run_ok(self.ctl(self.inv_launch, "launch", TAIL_CT, "--run", run, "-f"), e)
        log = h.rootfs(int(TAIL_CT[2:])) / "workspace" / "b" / "train_stdout_big1.log"
        lines = b"".join(b"[5m] step=%d loss=9.1 lr=3.0e-04 (12.8Ktok/s) q_hs=[0] | ETA=1.0d\n" % s
                         for s in range(4, 40_000))
        with log.open("r+b") as fh:  # sparse up to the last lines: made in no time, read only at its end
            fh.truncate(self.args.log_mb * (1 << 20) - len(lines))
            fh.seek(0, os.SEEK_END)
            fh.write(lines)
        self.log_size = log.stat().st_size
        say(f"set-up: a run with {OLD_POINTS:,} points ...")
        for ct, run in ((YOUNG_CT, "young1"), (OLD_CT, "old1")):
            self.run_ok(self.ctl(self.inv_launch, "launch", ct, "--run", run, "-f"), e)
        old = h.rootfs(int(OLD_CT[2:])) / "workspace" / "b" / "train_stdout_old1.log"
        with old.open("ab") as fh:  # what it logged over weeks, pulled once (untimed) below
            fh.write(b"".join(b"[%dm] step=%d loss=9.1 lr=3.0e-04 (12.8Ktok/s) q_hs=[0] | ETA=1.0d\n" % (s, s)
                              for s in range(4, OLD_POINTS + 1)))
        self.run_ok(self.ctl(self.inv_launch, "status", YOUNG_CT, OLD_CT), e)
        self.run_ok(self.ctl(self.inv_runs, "status", "live20"), e)  # first pulls of the live runs, untimed

    # --- cases -----------------------------------------------------------------------------------

    def cases(self) -> dict[str, Callable[[], float]]:
        d, w, e = self.env_default, self.env_warm, self.ctl

        def deploy_big() -> float:
            for f in self.big:  # two changed files each time, never seen by the container's store
                f.write_bytes(os.urandom(f.stat().st_size))
            self.warm(BIG_CT)
            return self.timed_ok(e(self.inv_big, "deploy", BIG_CT, "--allow-dirty"), w)

        def launch_first_line() -> float:
            self.warm(LAUNCH_CT)
            t0 = time.perf_counter()
            p = subprocess.Popen(e(self.inv_launch, "launch", LAUNCH_CT, "-f"), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=w)
            assert p.stdout is not None
            first = None
            for line in p.stdout:
                if first is None and "step=" in line:
                    first = time.perf_counter() - t0
            _, err = p.communicate()
            if p.returncode != 0 or first is None:
                raise SystemExit(f"bench: ctl launch -f exited {p.returncode} (first line {first}): {err[-500:]}")
            return first

        def trainer_start() -> float:
            r = subprocess.run(self.ssh("pve2" if LAUNCH_CT.startswith("ct3") else "pve1",
                                        f"pct exec {LAUNCH_CT[2:]} -- python3 -c '{TRAINER_START}' "
                                        "/root/blaunch/start_training.sh"), capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"bench: trainer start: {r.stderr[-500:]}")
            return float(r.stdout.strip())

        def cold(argv: list[str], ok: tuple[int, ...] = (0,)) -> Callable[[], float]:
            def run() -> float:
                self.cold()
                wall = self.timed_ok(argv, d, ok)
                self.settle()
                return wall
            return run

        def back_to_back(argv: list[str], ok: tuple[int, ...] = (0,)) -> Callable[[], float]:
            """The same command the moment a cold one returned (untimed): its session is up, the command server
            it started as it exited is still loading (issue 44: never more than the cold one)."""
            def run() -> float:
                self.cold()
                self.run_ok(argv, d, ok)
                wall = self.timed_ok(argv, d, ok)
                self.settle()
                return wall
            return run

        def warm(argv: list[str], cts: tuple[str, ...], ok: tuple[int, ...] = (0,)) -> Callable[[], float]:
            def run() -> float:
                self.warm(*cts)
                return self.timed_ok(argv, w, ok)
            return run

        def hot(argv: list[str], ok: tuple[int, ...] = (0,)) -> Callable[[], float]:
            def run() -> float:
                self.run_ok(argv, w, ok)
                self.settle()
                return self.timed_ok(argv, w, ok)
            return run

        both = ("ct200", "ct300")
        status_ok = (0, 21, 22)  # a verdict is not the benchmark's business; a failure is
        return {
            "floor": lambda: self.cpu_of(lambda: timed(self.ssh("pve1", "pct exec 200 true"))),
            "seeds": lambda: self.cpu_of(lambda: seeds_way(self.host, "pve1", 200, self.seeds_files, "dep")),
            "python_pass": lambda: self.cpu_of(lambda: timed([sys.executable, "-c", "pass"])),
            "help": lambda: self.cpu_of(lambda: timed([str(CTL), "--help"], d)),
            "deploy_cold": cold(e(self.inv_deploy, "deploy", "ct200", "--allow-dirty")),
            "deploy_b2b": back_to_back(e(self.inv_deploy, "deploy", "ct200", "--allow-dirty")),
            "deploy_warm": warm(e(self.inv_deploy, "deploy", "ct200", "--allow-dirty"), ("ct200",)),
            "scp_tiny": lambda: self.cpu_of(lambda: timed(self.scp([self.work / "tiny.bin"], "pve1", "/tmp/"))),
            "scp_big": lambda: self.cpu_of(lambda: timed(self.scp(self.big, "pve1", "/tmp/"))),
            "deploy_big_warm": deploy_big,
            "status1_cold": cold(e(self.inv_runs, "status", "ct200"), status_ok),
            "status20_cold": cold(e(self.inv_runs, "status", "live20"), status_ok),
            "status1_warm": warm(e(self.inv_runs, "status", "ct200"), both, status_ok),
            "status20_warm": warm(e(self.inv_runs, "status", "live20"), both, status_ok),
            "supervise20_warm": warm(e(self.inv_runs, "supervise", "--once", "live20"), both),
            "ping1_cold": cold(e(self.inv_runs, "ping", "ct200")),
            "ping40_cold": cold(e(self.inv_runs, "ping")),
            "ping1_warm": warm(e(self.inv_runs, "ping", "ct200"), both),
            "ping40_warm": warm(e(self.inv_runs, "ping"), both),
            "status1_hot": hot(e(self.inv_runs, "status", "ct200"), status_ok),
            "status20_hot": hot(e(self.inv_runs, "status", "live20"), status_ok),
            "supervise20_hot": hot(e(self.inv_runs, "supervise", "--once", "live20")),
            "ping1_hot": hot(e(self.inv_runs, "ping", "ct200")),
            "ping40_hot": hot(e(self.inv_runs, "ping")),
            "launch_first_line_warm": launch_first_line,
            "trainer_start": trainer_start,
            "status_young_warm": warm(e(self.inv_launch, "status", YOUNG_CT), (YOUNG_CT,)),
            "status_old_warm": warm(e(self.inv_launch, "status", OLD_CT), (OLD_CT,)),
            "tail_small_cold": cold(e(self.inv_launch, "tail", TAIL_CT, "--run", "small1")),
            "tail_big_cold": cold(e(self.inv_launch, "tail", TAIL_CT, "--run", "big1")),
            "tail_small_warm": warm(e(self.inv_launch, "tail", TAIL_CT, "--run", "small1"), (TAIL_CT,)),
            "tail_big_warm": warm(e(self.inv_launch, "tail", TAIL_CT, "--run", "big1"), (TAIL_CT,)),
        }

    def run(self) -> int:
        self.setup()
        cases = self.cases()
        if self.args.only:
            cases = {k: v for k, v in cases.items() if re.search(self.args.only, k) or k in ("floor", "seeds")}
        self.samples = {k: [] for k in cases}
        for i in range(self.args.repeat):
            t0 = time.monotonic()
            for name, fn in cases.items():  # every case once per round: load hits them alike
                self.case = name
                self.samples[name].append(fn())
            say(f"round {i + 1}/{self.args.repeat}: {time.monotonic() - t0:.0f}s")
        self.count_poll()
        self.registry_rate()
        self.host_cpu()
        return self.report()

    # --- counts (not timed): connections and execs of one status/supervise poll ------------------

    def count_poll(self) -> None:
        """SSH logins per host (sshd's log) and agent execs per container (the test host's pct journal) of one
        `ctl status` and one `ctl supervise --once` of the 20 live runs, with the default settings, cold."""
        h = self.host
        for what, argv in (("status", ["status", "live20"]), ("supervise", ["supervise", "--once", "live20"])):
            self.cold()
            logins = {n: (h.base / n / "sshd.log").read_text(errors="replace").count("Accepted publickey")
                      for n in ("pve1", "pve2")}
            calls = {n: len(h.pct_calls(n)) for n in ("pve1", "pve2")}
            self.run_ok(self.ctl(self.inv_runs, *argv), self.env_default, (0, 21, 22))
            time.sleep(0.5)  # sshd logs a login as it completes
            got_logins = {n: (h.base / n / "sshd.log").read_text(errors="replace").count("Accepted publickey")
                          - logins[n] for n in logins}
            verbs: dict[str, int] = {}
            per_ct: dict[str, int] = {}
            for n in ("pve1", "pve2"):
                for c in h.pct_calls(n)[calls[n]:]:
                    verb = c["argv"][6] if c["cmd"] in ("exec", "attach") and len(c["argv"]) > 6 else c["cmd"]
                    verbs[verb] = verbs.get(verb, 0) + 1
                    per_ct[c["args"][0]] = per_ct.get(c["args"][0], 0) + 1
            self.counts[what] = {"ssh_logins_per_host": got_logins, "pct_calls_by_verb": verbs,
                                 "containers": len(per_ct), "most_calls_in_one_container": max(per_ct.values())}

    def host_cpu(self) -> None:
        """What one container costs its host per ping and per status poll, in CPU seconds (medians of 15)."""
        from controller.remote.client import BOOT, agent_source

        script = self.base / "host_cpu.py"  # the test host is this machine: its python3 reads the file
        script.write_text(HOST_CPU.replace("boot = BOOT ", f"boot = {BOOT!r} ", 1))
        r = subprocess.run(self.ssh("pve1", f"python3 {script} 200 {self.host.lxcpath('pve1')}"), input=agent_source(),
                           capture_output=True)
        if r.returncode != 0:
            raise SystemExit(f"bench: host CPU probe failed: {r.stderr.decode(errors='replace')[-500:]}")
        self.counts["host_cpu_s_per_exec"] = json.loads(r.stdout)

    def registry_rate(self) -> None:
        """Write transactions per second of this machine's registry (the supervisor's cost per run and poll)."""
        from controller.registry import Registry

        with tempfile.TemporaryDirectory() as d:
            reg = Registry(Path(d) / "r.sqlite3")
            runs = [reg.claim_run(f"r{i}", "ct", log_path="/l") for i in range(50)]
            point = {"step": 1, "loss": 9.1, "tok_s": 12800.0}
            n, t0 = 0, time.perf_counter()
            at: dict[int, tuple[int, str | None]] = {r.id: (0, None) for r in runs}
            while time.perf_counter() - t0 < 2.0:
                for r in runs:
                    off, ident = at[r.id]
                    reg.advance_cursor(r.id, (off, ident), off + 80, "1:80:x", b"", [point])
                    at[r.id] = (off + 80, "1:80:x")
                    n += 1
            self.counts["registry_cursor_tx_per_s"] = {"rate": n / (time.perf_counter() - t0)}
            reg.close()

    # --- the table -------------------------------------------------------------------------------

    def report(self) -> int:
        med = {k: statistics.median(v) for k, v in self.samples.items()}
        F, S = med["floor"], med["seeds"]
        rows: list[Row] = []

        def have(*keys: str) -> bool:
            return all(k in med for k in keys)

        if have("deploy_cold"):
            rows.append(Row("deploy, nothing changed, cold", self.label_default, med["deploy_cold"],
                            "<= 1.2x the floor", 1.2 * F))
        if have("deploy_b2b", "deploy_cold"):
            r = med["deploy_b2b"] / med["deploy_cold"]
            rows.append(Row("deploy, nothing changed, right after a cold one", self.label_default, med["deploy_b2b"],
                            f"<= 1x the cold one ({med['deploy_cold']:.2f} s)", None, (r, 1.0)))
        if have("deploy_warm"):
            rows.append(Row("deploy, nothing changed, warm session", self.label_warm, med["deploy_warm"],
                            "<= 0.5x the floor", 0.5 * F))
        link = None
        if have("deploy_big_warm", "scp_big", "scp_tiny"):
            transfer = max(0.0, med["scp_big"] - med["scp_tiny"])
            link = self.args.big_mb * (1 << 20) / transfer / 1e6 if transfer else float("inf")
            rows.append(Row(f"deploy, 2 files changed ({self.args.big_mb} MiB)", self.label_warm,
                            med["deploy_big_warm"], f"<= 1.5x the floor + {transfer:.2f} s at link speed "
                            f"({link:.0f} MB/s by scp)", 1.5 * F + transfer))
        label_hot = self.label_warm.replace(", warm", ", hot (staying agents up)")
        for tag, label in (("cold", self.label_default), ("warm", self.label_warm), ("hot", label_hot)):
            if have(f"status20_{tag}", f"status1_{tag}"):
                r = med[f"status20_{tag}"] / med[f"status1_{tag}"]
                rows.append(Row("`ctl status`, 20 live runs (20 CTs, 2 hosts)", label, med[f"status20_{tag}"],
                                f"<= 2x `ctl status` of 1 run ({med[f'status1_{tag}']:.2f} s)", None, (r, 2.0)))
            if have(f"ping40_{tag}", f"ping1_{tag}"):
                r = med[f"ping40_{tag}"] / med[f"ping1_{tag}"]
                rows.append(Row("`ctl ping`, 40 CTs on 2 hosts", label, med[f"ping40_{tag}"],
                                f"<= 2x ping of 1 CT ({med[f'ping1_{tag}']:.2f} s)", None, (r, 2.0)))
        if have("supervise20_warm", "status1_warm"):
            r = med["supervise20_warm"] / med["status1_warm"]
            rows.append(Row("`ctl supervise --once`, 20 live runs (issue 15)", self.label_warm,
                            med["supervise20_warm"], f"<= 2x `ctl status` of 1 run ({med['status1_warm']:.2f} s)",
                            None, (r, 2.0)))
        if have("supervise20_hot", "status1_hot"):
            r = med["supervise20_hot"] / med["status1_hot"]
            rows.append(Row("`ctl supervise --once`, 20 live runs (issue 15)", label_hot,
                            med["supervise20_hot"], f"<= 2x `ctl status` of 1 run ({med['status1_hot']:.2f} s)",
                            None, (r, 2.0)))
        if have("status_old_warm", "status_young_warm"):
            r = med["status_old_warm"] / med["status_young_warm"]
            rows.append(Row(f"`ctl status` of a run of {OLD_POINTS:,} points (weeks of history)", self.label_warm,
                            med["status_old_warm"], f"<= 1.2x `ctl status` of a run of 3 points "
                            f"({med['status_young_warm']:.2f} s)", None, (r, 1.2)))
        if have("launch_first_line_warm", "trainer_start"):
            rows.append(Row("`ctl launch -f` to the first log line", self.label_warm, med["launch_first_line_warm"],
                            f"<= 2x the floor + the trainer's own start ({med['trainer_start']:.2f} s)",
                            2 * F + med["trainer_start"]))
        if have("help", "python_pass"):
            r = med["help"] / med["python_pass"]
            rows.append(Row("`ctl --help`", "-", med["help"], f"<= 3x `python -c pass` ({med['python_pass']:.3f} s)",
                            None, (r, 3.0)))
        for tag, label in (("cold", self.label_default), ("warm", self.label_warm)):
            if have(f"tail_big_{tag}", f"tail_small_{tag}"):
                r = med[f"tail_big_{tag}"] / med[f"tail_small_{tag}"]
                rows.append(Row(f"`ctl tail RUN` of a {self.log_size / 2**30:.2f} GiB log", label,
                                med[f"tail_big_{tag}"], f"<= 1.2x `ctl tail` of a 4 KB log: one round trip + the "
                                f"lines shown ({med[f'tail_small_{tag}']:.2f} s)", None, (r, 1.2)))
        lines = [f"Medians of {self.args.repeat}, every case interleaved. Floor `ssh host pct exec CT true`: "
                 f"**{F:.3f} s**; the seeds' way (scp + pct push + md5sum of 3 files): **{S:.3f} s**.", "",
                 "| operation | settings | median | x floor | x seeds' way | goal | met |",
                 "|---|---|---:|---:|---:|---|---|"]
        for row in rows:
            measured = f" ({row.ratio[0]:.2f}x)" if row.ratio else ""
            lines.append(f"| {row.what} | {row.settings} | {row.seconds:.3f} s{measured} | {row.seconds / F:.2f}x | "
                         f"{row.seconds / S:.2f}x | {row.goal} | {'met' if row.met else '**not met**'} |")
        lines += ["", "| case | median s | client CPU s | samples s |", "|---|---:|---:|---|"]
        lines += [f"| {k} | {med[k]:.3f} | {statistics.median(self.cpu[k]) if self.cpu.get(k) else float('nan'):.3f} | "
                  f"{' '.join(f'{x:.3f}' for x in v)} |" for k, v in self.samples.items()]
        for what, c in self.counts.items():
            lines.append(f"\n{what}: {json.dumps(c)}")
        print("\n".join(lines))
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"median_s": med, "samples": self.samples, "client_cpu_s": self.cpu,
                                   "counts": self.counts,
                                   "link_MBps": link, "repeat": self.args.repeat, "cpus": os.cpu_count(),
                                   "settings": {"default": self.label_default, "warm": self.label_warm},
                                   "rows": [{**row.__dict__, "met": row.met} for row in rows]}, indent=2))
        return 0


def say(text: str) -> None:
    print(f"bench: {text}", file=sys.stderr, flush=True)


def bring_up(name: str) -> tuple[PveHost, Path] | None:
    """The local Proxmox test host with PER_NODE containers on each of its two nodes, in a new directory; None
    (said why) when this machine cannot run it."""
    why = missing_prerequisites()
    if why:
        print(f"bench: needs the local Proxmox host: {why}", file=sys.stderr)
        return None
    base = Path(tempfile.mkdtemp(prefix=f"ctl-bench-{name}-"))
    port = find_free_port(["127.0.0.2", "127.0.0.3"])
    say(f"bringing up the test host at {base} ({2 * PER_NODE} containers) ...")
    return PveHost(base=base, port=port, ct_ssh_vmid=None, small_tmpfs={}, extra_cts=PER_NODE - 2).up(), base


def set_up(name: str) -> Bench:
    """bring_up() with this benchmark's set-up done (deployed payload, 20 live runs, the logs), for the
    benchmarks that compare trees on it (process_cpu.py, cold_against.py): its host is .host, its directory
    .base. Exits with status 2 (bring_up said why) where this machine cannot run the test host."""
    up = bring_up(name)
    if up is None:
        raise SystemExit(2)
    host, base = up
    try:
        b = Bench(host, base, argparse.Namespace(repeat=1, big_mb=2, log_mb=4, only=None, out=None))
        b.setup()
    except BaseException:
        host.down()
        raise
    return b


def checkout(ap: argparse.ArgumentParser, given: str) -> Path:
    """--against's directory, refused in one line (ap.error) unless it is a checkout of ctl."""
    tree = Path(given).resolve()
    if not (tree / "controller" / "launch" / "main.py").is_file():
        ap.error(f"--against {given}: not a checkout of ctl (no controller/launch/main.py)")
    return tree


def tree_env(b: Bench, name: str, tree: Path) -> dict[str, str]:
    """The environment that runs checkout `tree`'s ctl on b's host: its own sessions (XDG_RUNTIME_DIR) and its
    own copy of the registry, so two trees measured in turn share nothing but the host."""
    import shutil

    state, run_dir = b.base / f"state-{name}", b.base / f"xdg-{name}"
    shutil.copytree(b.base / "state", state, ignore=shutil.ignore_patterns("mux"))
    run_dir.mkdir(mode=0o700)
    return dict(b.env_warm, PYTHONPATH=str(tree), CTL_STATE_DIR=str(state), XDG_RUNTIME_DIR=str(run_dir))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--big-mb", type=int, default=20, help="MiB of the two changed files (default 20)")
    ap.add_argument("--log-mb", type=int, default=1024, help="size of the log `ctl tail` reads (default 1024)")
    ap.add_argument("--only", default=None, help="regex: time only the matching cases (and the floor, seeds)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "speed.json"))
    args = ap.parse_args()
    if args.repeat < 1 or args.big_mb < 2 or args.log_mb < 4:
        ap.error("--repeat >= 1, --big-mb >= 2 and --log-mb >= 4")
    if not CTL.exists():
        raise SystemExit(f"bench: no installed ctl at {CTL} (pip install -e . into this interpreter's venv)")
    up = bring_up("speed")
    if up is None:
        return 2
    host, base = up
    env = dict(os.environ, CTL_STATE_DIR=str(base / "state"), PYTHONPATH=str(REPO))
    try:
        return Bench(host, base, args).run()
    finally:
        subprocess.run([sys.executable, "-m", "controller", "mux", "stop"], capture_output=True, env=env)
        host.down()


if __name__ == "__main__":
    raise SystemExit(main())
