"""The command right after a cold one, against the cold one and a warm one, side by side with another checkout.

    python bench/back_to_back.py [--against DIR] [--repeat 9] [--trace DIR]

`ctl deploy ct200` with nothing to change, on the local Proxmox test host, as users run it: the venv's
installed `ctl` with the default settings (CTL_PERSIST unset), so a cold command starts the host's session and,
as it exits, the command server (launch/server.py). Per round and tree: `ctl mux stop` and a pause, then
cold (nothing up), back-to-back (the same command the moment the cold one returned, while the command server it
started is still coming up) and, one second later, warm. With --against, the two trees' rounds alternate on
the same host in the same minutes; each tree has its own sessions and servers (XDG_RUNTIME_DIR) and registry
(CTL_STATE_DIR), and runs its own code (PYTHONPATH: the key of its command server is its own files).

--trace DIR: per run, `strace -f -tt` of the back-to-back command into DIR (how its time went; untimed rounds).

Needs root, LXC and sshd (like the integration tests). Prints one markdown table: per case and tree, the median
and minimum wall time, and the back-to-back and warm medians as multiples of the cold one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.deploy import FILES, TEMPLATE  # noqa: E402
from bench.speed import CTL, checkout, say  # noqa: E402
from controller.launch import served  # noqa: E402
from tests.pvehost import PveHost, find_free_port, missing_prerequisites  # noqa: E402

SETTLE_S = 1.0  # after `mux stop`: the ended session's and server's exits are not the cold run's CPU
WARM_AFTER_S = 1.0  # the "one second later"
CASES = ("cold", "back-to-back", "warm")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="another checkout (e.g. `git worktree add DIR main`)")
    ap.add_argument("--repeat", type=int, default=9, help="rounds per tree (default 9)")
    ap.add_argument("--trace", help="strace the back-to-back command of each round into this directory")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat {args.repeat}: give at least 1")
    trees = {"this": REPO, **({"against": checkout(ap, args.against)} if args.against else {})}
    why = missing_prerequisites()
    if why:
        say(f"needs the local Proxmox host: {why}")
        return 2
    base = Path(tempfile.mkdtemp(prefix="ctl-bench-b2b-"))
    host = PveHost(base=base, port=find_free_port(["127.0.0.2", "127.0.0.3"]), ct_ssh_vmid=None, small_tmpfs={},
                   extra_cts=0)
    say(f"bringing up the test host at {base} ...")
    host.up()
    envs: dict[str, dict[str, str]] = {}
    try:
        work = base / "work"
        (work / "templates").mkdir(parents=True)
        (work / "remote_payload").mkdir()
        for src in (*FILES, TEMPLATE):
            (work / src).write_bytes((REPO / src).read_bytes())
        inv = host.write_inventory(work / "deploy.yaml", payload=[
            *({"src": f, "dest": f"/root/dep/{Path(f).name}"} for f in FILES),
            {"template": TEMPLATE, "dest": "/root/dep/start_training.sh", "mode": "0755"}])
        argv = [str(CTL), "-i", str(inv), "deploy", "ct200", "--allow-dirty"]
        for name, tree in trees.items():
            run_dir = base / f"xdg-{name}"
            run_dir.mkdir(mode=0o700)
            env = dict(os.environ, PYTHONPATH=str(tree), CTL_STATE_DIR=str(base / f"state-{name}"),
                       XDG_RUNTIME_DIR=str(run_dir))
            for k in ("CTL_PERSIST", "PYTHONDONTWRITEBYTECODE"):  # the default settings; bytecode as installed
                env.pop(k, None)
            envs[name] = env
            _ok(argv, env)  # the files land once, untimed: every timed run changes nothing
        got: dict[str, dict[str, list[float]]] = {n: {c: [] for c in CASES} for n in trees}
        for i in range(args.repeat):
            for name, env in envs.items():
                _settle(env)
                _ok([str(CTL), "-i", str(inv), "mux", "stop"], env)
                time.sleep(SETTLE_S)
                got[name]["cold"].append(_timed(argv, env))
                if args.trace:
                    out = Path(args.trace) / f"{name}-{i}.strace"
                    out.parent.mkdir(parents=True, exist_ok=True)
                    got[name]["back-to-back"].append(_timed(["strace", "-f", "-tt", "-o", str(out), *argv], env))
                else:
                    got[name]["back-to-back"].append(_timed(argv, env))
                time.sleep(WARM_AFTER_S)
                got[name]["warm"].append(_timed(argv, env))
            say(f"round {i + 1}/{args.repeat}")
        print("| case | tree | wall s (median) | wall s (min) | median / cold |\n|---|---|---:|---:|---:|")
        for case in CASES:
            for name, tree in trees.items():
                runs = got[name][case]
                cold = statistics.median(got[name]["cold"])
                print(f"| {case} | {name if name == 'this' else tree} | {statistics.median(runs):.3f} | "
                      f"{min(runs):.3f} | {statistics.median(runs) / cold:.2f}x |")
                say(f"{case} {name}: {' '.join(f'{x:.3f}' for x in sorted(runs))}")
    finally:
        for env in envs.values():
            subprocess.run([str(CTL), "mux", "stop"], capture_output=True, env=env)
        host.down()
    return 0


def _settle(env: dict[str, str]) -> None:
    """Wait (untimed) for the command server the last round started: `mux stop` stops only a server that listens,
    and one still loading would come up during the next cold run and serve its back-to-back command."""
    deadline = time.time() + 30
    while time.time() < deadline and not served.servers(env):
        time.sleep(0.02)


def _ok(argv: list[str], env: dict[str, str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"bench: {' '.join(argv[2:])[:200]} exited {r.returncode}: {r.stderr[-800:]}")


def _timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    _ok(argv, env)
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
