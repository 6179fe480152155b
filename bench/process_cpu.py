"""Where a command's CPU goes, process by process: ctl, its host sessions, sshd, the host relays, the staying
agents, tmux and the rest, read from /proc around each run of the command against the local Proxmox test host.

    python bench/process_cpu.py [--repeat 20] [--against DIR] [--case ping40 ...] [--out FILE]

Brings up the test host as bench/speed.py does (40 containers on two nodes, 20 of them with a live run), then
runs each case `--repeat` times inside one Python (what the command server's fork runs, without the fork),
after two untimed runs of the same command (its sessions and staying agents are up: speed.py's "hot"). Around
each run it reads every process's CPU (/proc/PID/stat: its own and that of the children it reaped, so a `tmux`
or `lxc-attach` that an agent or relay started and waited for counts as theirs) and thread switches
(/proc/PID/task/*/status). Processes that start and end inside one run without being reaped by a process that
outlives it are not seen.

--against DIR runs another checkout's ctl (e.g. `git worktree add DIR REV`) in turn with this one, with its own
sessions (its own XDG_RUNTIME_DIR) and a copy of the registry: compare the two trees through each other, in the
same run, on the same host.

Needs root, LXC and sshd (like the integration tests). Prints a markdown table per case and tree: the median
wall time, the mean CPU of each kind of process and the mean thread switches per run; writes every sample as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]

CASES = {
    "ping1": ["ping", "ct200"],
    "ping40": ["ping"],
    "status1": ["status", "ct200"],
    "status20": ["status", "live20"],
    "supervise20": ["supervise", "--once", "live20"],
    "deploy1": ["deploy", "ct200", "--allow-dirty"],  # unchanged: the plan and its answer (the deploy inventory)
}
KINDS = ("ctl", "session", "sshd", "relay", "agent", "tmux", "other")
ROUNDS = 4  # each tree's runs of a case come in this many turns, the trees alternating


def _kind(cmd: bytes) -> str:
    program = cmd.split(b" ", 1)[0].rsplit(b"/", 1)[-1]
    if b"controller.transport.mux.daemon" in cmd:
        return "session"
    if program in (b"sshd", b"sshd:"):
        return "sshd"
    if b"/relay-%s" in cmd:  # ctl's BOOT of the relay (controller/farside/__init__.py)
        return "relay"
    if b"/agent-%s" in cmd:
        return "agent"
    if program in (b"tmux", b"tmux:"):
        return "tmux"
    return "other"


def _snapshot(me: int, tick: int) -> dict[int, tuple[str, float, int]]:
    """{pid: (kind, CPU seconds with reaped children, thread switches)} of every process but this one."""
    out: dict[int, tuple[str, float, int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
            switches = 0
            for tid in os.listdir(f"/proc/{name}/task"):
                with open(f"/proc/{name}/task/{tid}/status") as f:
                    switches += sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line)
        except (OSError, IndexError, ValueError):
            continue  # ended while read
        cpu = sum(int(x) for x in fields[11:15]) / tick  # utime, stime, cutime, cstime
        out[int(name)] = (_kind(cmd), cpu, switches)
    return out


def driver(tree: str, n: int, argv: list[str]) -> None:
    """Inside the tree's Python: the command `n` times, each bracketed by /proc snapshots; JSON on stdout."""
    import contextlib
    import io

    sys.path.insert(0, tree)
    from controller.launch import main as m

    m.build_all()

    def once() -> None:
        sys.argv = ["ctl", *argv]
        code: object = 0
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                m.run_here()
            except SystemExit as e:
                code = e.code
        if code not in (None, 0, 21, 22):  # a verdict (slow, stalled) is not this benchmark's business; a failure is
            raise SystemExit(f"ctl {' '.join(argv)} exited {code}: {err.getvalue()[-800:]}")

    once()
    once()
    me, tick = os.getpid(), os.sysconf("SC_CLK_TCK")
    samples: list[dict[str, Any]] = []
    for _ in range(n):
        a = _snapshot(me, tick)
        c0, w0 = time.process_time(), time.perf_counter()
        once()
        wall, own = time.perf_counter() - w0, time.process_time() - c0
        b = _snapshot(me, tick)
        cpu = dict.fromkeys(KINDS, 0.0)
        sw = dict.fromkeys(KINDS, 0)
        cpu["ctl"] = own
        for pid, (kind, t, x) in b.items():
            if pid in a:  # a process started during the run is seen from its start: count it whole
                t, x = t - a[pid][1], x - a[pid][2]
            cpu[kind] += t
            sw[kind] += x
        samples.append({"wall": wall, "cpu": cpu, "switches": sw})
    json.dump(samples, sys.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20, help=f"runs of each case per tree, a multiple of {ROUNDS} "
                    "(default 20)")
    ap.add_argument("--against", default=None, help="another checkout to measure in turn with this one")
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="only these cases (repeatable)")
    ap.add_argument("--out", default=str(HERE / "bench" / "results" / "process_cpu.json"))
    args = ap.parse_args()
    if args.repeat < ROUNDS or args.repeat % ROUNDS:
        ap.error(f"--repeat {args.repeat}: give a multiple of {ROUNDS} (each tree's runs come in {ROUNDS} turns)")
    sys.path.insert(0, str(HERE))
    from bench import speed

    trees = {"this": HERE}
    if args.against:
        trees["against"] = speed.checkout(ap, args.against)
    b = speed.set_up("cpu")
    envs: dict[str, dict[str, str]] = {}
    try:
        envs["this"] = dict(b.env_warm)
        if "against" in trees:  # its own sessions, and a registry of its own with the same runs
            envs["against"] = speed.tree_env(b, "against", trees["against"])
        cases = args.case or list(CASES)
        per_round = args.repeat // ROUNDS
        got: dict[str, dict[str, list[Any]]] = {}
        for case in cases:
            speed.say(f"{case}: ctl {' '.join(CASES[case])}")
            for _ in range(ROUNDS):
                for name, tree in trees.items():
                    r = subprocess.run([sys.executable, __file__, "--driver", str(tree), str(per_round), "--",
                                        "-i", str(b.inv_deploy if CASES[case][0] == "deploy" else b.inv_runs),
                                        *CASES[case]],
                                       env=envs[name], capture_output=True, text=True)
                    if r.returncode != 0:
                        raise SystemExit(f"bench: {name}: {case}: {r.stderr[-800:]}")
                    got.setdefault(case, {}).setdefault(name, []).extend(json.loads(r.stdout))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"repeat": args.repeat, "trees": {k: str(v) for k, v in trees.items()},
                                              "samples": got}, indent=1))
        _report(got, list(trees))
        print(f"\nsamples: {args.out}")
    finally:
        for env in envs.values():
            subprocess.run([sys.executable, "-m", "controller", "mux", "stop"], capture_output=True, env=env)
        b.host.down()
    return 0


def _report(got: dict[str, dict[str, list[Any]]], trees: list[str]) -> None:
    """Wall: the median. CPU and switches: means, since /proc counts CPU in clock ticks (10 ms at the usual 100
    Hz), far coarser than one run of most processes here: summed over many runs, the ticks add up right. "other"
    (this machine's own daemons, the fake trainers) is left out of the sum."""
    print("| case | tree | wall ms (median) | " + " | ".join(f"{k} ms" for k in KINDS)
          + " | all but other ms | switches |")
    print("|---|---|" + "---:|" * (len(KINDS) + 3))
    for case, by_tree in got.items():
        for name in trees:
            rows = by_tree[name]
            cpu = [statistics.fmean(r["cpu"][k] for r in rows) * 1000 for k in KINDS]
            switches = statistics.fmean(sum(r["switches"].values()) for r in rows)
            print(f"| {case} | {name} | {statistics.median(r['wall'] for r in rows) * 1000:.1f} | "
                  + " | ".join(f"{c:.1f}" for c in cpu) + f" | {sum(cpu[:-1]):.1f} | {switches:.0f} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--driver":
        driver(sys.argv[2], int(sys.argv[3]), sys.argv[5:])
    else:
        raise SystemExit(main())
