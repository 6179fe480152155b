"""What one agent request costs ctl's host relay (controller/farside/relay/): its CPU, and its threads'
context switches, per request, with the real agent answering `hello` from staying agents, as on a host.

    python3 bench/relay_requests.py [--containers 20] [--rounds 300] [--repeat 3] [--against DIR]

The relay runs here under /usr/bin/python3 (a host's own python3) with no SSH in between: ctl's frames go to its
stdin, its answers come from its stdout. Each round asks every container once, all at once (a fan-out's shape);
the first round starts the staying agents with the source, the rest leave it out (the relay keeps it), as every
request of a warm session does. --against DIR runs the relay and agent of another checkout too (e.g. `git
worktree add DIR REV`), alternating with this one in the same run: compare the two through their ratio.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from controller.remote.client import VERB_AT, agent_argv  # noqa: E402
from controller.transport.relay import HEADER, frames  # noqa: E402


def _read(tree: Path, name: str) -> bytes:
    """The source `tree` ships of a program (`agent`, `relay`): as its far-side loader joins it, or the one file of
    a tree from before the far side was written in parts."""
    single = tree / "controller" / "remote" / {"agent": "agent.py", "relay": "hostrelay.py"}[name]
    if single.exists():
        return single.read_bytes()
    code = f"import sys;sys.path.insert(0, {str(tree)!r});from controller import farside;" \
           f"sys.stdout.buffer.write(farside.source({name!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout


class Relay:
    """One relay process of `tree`'s source, its answers collected per stream id."""

    def __init__(self, tree: Path, code_dir: str) -> None:
        self.src = _read(tree, "agent")
        self.sha = hashlib.sha256(self.src).hexdigest()
        python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
        self.p = subprocess.Popen([python, "-I", "-S", "-c", _read(tree, "relay").decode()],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                  env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CTL_AGENT_CODE_DIR": code_dir})
        self.cond = threading.Condition()
        self.done: dict[int, int] = {}
        self.next = 1
        threading.Thread(target=self._reader, daemon=True).start()

    def _reader(self) -> None:
        assert self.p.stdout is not None
        out = self.p.stdout
        for kind, sid, _data in frames(iter(lambda: os.read(out.fileno(), 1 << 16), b"")):
            if kind == b"X":
                with self.cond:
                    self.done[sid] = 1
                    self.cond.notify_all()

    def round(self, containers: int, first: bool) -> None:
        """Every container asked once, all at once; back once all answered."""
        assert self.p.stdin is not None
        argv = agent_argv("hello", json.dumps({"root": "/"}))
        argv[VERB_AT - 1] = str(len(self.src))
        sids, chunks = [], []
        for i in range(containers):
            sid, self.next = self.next, self.next + 1
            spec = {"argv": ["env", f"CT={i}", *argv], "at": 2 + VERB_AT, "n": len(self.src) if first else 0,
                    "retry": True, "sha": self.sha}
            body = self.src if first else b""
            for kind, data in ((b"A", json.dumps(spec).encode()), (b"I", body), (b"C", b"")):
                chunks.append(HEADER.pack(kind, sid, len(data)) + data)
            sids.append(sid)
        self.p.stdin.write(b"".join(chunks))
        with self.cond:
            if not self.cond.wait_for(lambda: all(s in self.done for s in sids), 60):
                raise SystemExit("bench: the relay did not answer in 60 s")
            for s in sids:
                del self.done[s]

    def cpu_and_switches(self) -> tuple[float, int]:
        st = Path(f"/proc/{self.p.pid}/stat").read_text().rsplit(") ", 1)[1].split()
        switches = 0
        for tid in os.listdir(f"/proc/{self.p.pid}/task"):
            for line in Path(f"/proc/{self.p.pid}/task/{tid}/status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    switches += int(line.split()[1])
        return (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK"), switches

    def close(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.close()
        self.p.wait(30)


def measure(tree: Path, containers: int, rounds: int) -> tuple[float, float, float]:
    """(relay CPU ms, context switches, wall ms) per request, over `rounds` warm rounds."""
    with tempfile.TemporaryDirectory() as code_dir:  # compiled code kept as in a host's /run/ctl
        return _measure(Relay(tree, code_dir), containers, rounds)


def _measure(r: Relay, containers: int, rounds: int) -> tuple[float, float, float]:
    try:
        r.round(containers, first=True)
        r.round(containers, first=False)
        c0, s0 = r.cpu_and_switches()
        t0 = time.perf_counter()
        for _ in range(rounds):
            r.round(containers, first=False)
        wall = time.perf_counter() - t0
        c1, s1 = r.cpu_and_switches()
    finally:
        r.close()
    n = containers * rounds
    return (c1 - c0) / n * 1e3, (s1 - s0) / n, wall / n * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--containers", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--against", default=None, help="another checkout of ctl, measured alternately with this one")
    args = ap.parse_args()
    if not shutil.which("env"):
        raise SystemExit("bench: needs env(1) on PATH")
    trees = {"this checkout": HERE, **({args.against: Path(args.against).resolve()} if args.against else {})}
    got: dict[str, list[tuple[float, float, float]]] = {k: [] for k in trees}
    for _ in range(args.repeat):
        for name, tree in trees.items():
            got[name].append(measure(tree, args.containers, args.rounds))
    print(f"{args.containers} containers x {args.rounds} rounds, medians of {args.repeat}:")
    print(f"{'relay':<28} {'CPU ms/request':>15} {'switches/request':>17} {'wall ms/request':>16}")
    med = {}
    for name, vals in got.items():
        med[name] = tuple(statistics.median(v[i] for v in vals) for i in range(3))
        cpu, sw, wall = med[name]
        print(f"{name:<28} {cpu:>15.3f} {sw:>17.2f} {wall:>16.3f}")
    if args.against:
        a, b = med["this checkout"], med[args.against]
        print(f"ratio (this / {args.against}): CPU {a[0] / b[0]:.2f}x, switches {a[1] / max(b[1], 1e-9):.2f}x, "
              f"wall {a[2] / b[2]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
