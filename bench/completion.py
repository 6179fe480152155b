"""Shell completion's answer time, side by side with a bare interpreter start in the same run.

    python3 bench/completion.py [--repeat 30] [--runs 500]

Each case is one process, as a shell's TAB starts one (the console script's entry point, `ctl` as
`python -c 'from controller.launch.main import main; main()'`):
- `python -c pass`: the floor every Python command pays;
- ctl's answer (launch/complete.py) for `ctl show <TAB>` (run names from a registry of --runs runs) and
  `ctl deploy <TAB>` (containers and groups from this checkout's inventory.yaml);
- typer's own answer to the same request (what `ctl` did before: the whole command tree, typer, pydantic).
Target: ctl's answer under 100 ms above the bare interpreter. The cases are interleaved, so machine load
hits them alike; medians of wall and CPU time (user + system, which load stretches far less) are printed, with
what each costs over `python -c pass`.
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
ENTRY = "import sys; from controller.launch.main import main; sys.exit(main())"
TYPER = "import sys; from controller.launch.main import _main; sys.exit(_main())"  # typer's completion path


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the process, its stdout). CPU time (user + system, from wait4) is what the
    answer costs; wall time also holds waiting for a core, which a loaded machine stretches."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    out, err = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
    _pid, status, usage = os.wait4(proc.pid, 0)
    took = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{argv} failed ({proc.returncode}): {err.decode()}")
    return took, usage.ru_utime + usage.ru_stime, out.decode()


def pythonpath() -> str:
    """This checkout first (its `controller` wins over an installed one), then what the caller had."""
    return os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


def registry(state: Path, n: int) -> None:
    """A registry of n runs over 8 containers (ctl's own Registry, in a state dir of this run)."""
    env = dict(os.environ, CTL_STATE_DIR=str(state), PYTHONPATH=pythonpath())
    code = ("from controller.registry import Registry\n"
            "r = Registry()\n"
            f"for i in range({n}):\n"
            "    r.claim_run(f'fresh{i}', f'ct{200 + i % 8}')\n")
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--runs", type=int, default=500, help="runs in the registry completed from")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        registry(state, args.runs)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("CTL_", "_CTL_", "COMP_"))}
        base.update(CTL_STATE_DIR=str(state), CTL_CONFIG=str(Path(tmp) / "no-config.yaml"), PYTHONPATH=pythonpath())
        show = dict(base, _CTL_COMPLETE="complete_bash", COMP_WORDS="ctl show fresh4", COMP_CWORD="2")
        deploy = dict(base, _CTL_COMPLETE="complete_bash", COMP_WORDS="ctl deploy ", COMP_CWORD="2")
        cases = {
            "python -c pass": ([sys.executable, "-c", "pass"], base),
            "ctl show fresh4<TAB> (ctl's answer)": ([sys.executable, "-c", ENTRY], show),
            "ctl deploy <TAB> (ctl's answer)": ([sys.executable, "-c", ENTRY], deploy),
            "ctl show fresh4<TAB> (typer's answer)": ([sys.executable, "-c", TYPER], show),
        }
        answers = {name: timed(argv, env)[2] for name, (argv, env) in cases.items()}  # warm the caches, check
        assert answers["ctl show fresh4<TAB> (ctl's answer)"].split() == \
            answers["ctl show fresh4<TAB> (typer's answer)"].split(), answers
        walls: dict[str, list[float]] = {k: [] for k in cases}
        cpus: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.repeat):
            for name, (argv, env) in cases.items():
                w, c, _out = timed(argv, env)
                walls[name].append(w)
                cpus[name].append(c)
    shown = {name: len(out.split()) for name, out in answers.items() if "ctl's answer" in name}
    print(f"python {sys.version.split()[0]}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; "
          f"{args.repeat} rounds; {args.runs} runs in the registry; names answered: {shown}")
    floor_w, floor_c = statistics.median(walls["python -c pass"]), statistics.median(cpus["python -c pass"])
    for name in cases:
        w, c = statistics.median(walls[name]), statistics.median(cpus[name])
        print(f"{name:<40} wall {w * 1000:6.1f} ms (+{(w - floor_w) * 1000:6.1f})   "
              f"cpu {c * 1000:6.1f} ms (+{(c - floor_c) * 1000:6.1f})   medians; (+) over python -c pass")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
