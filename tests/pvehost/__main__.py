"""`python -m tests.pvehost up|down|status [--dir D] [--port P] [--extra-cts N] [--unprivileged VMIDS] [--ct202]`:
the test host by hand."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

from tests.pvehost.host import DEFAULT_DIR, DEFAULT_PORT, PveHost, PveHostError, down, leftover_processes, load


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.pvehost", description=__doc__)
    ap.add_argument("action", choices=["up", "down", "status"])
    ap.add_argument("--dir", default=os.environ.get("CTL_PVEHOST_DIR", DEFAULT_DIR),
                    help="base directory (default: $CTL_PVEHOST_DIR or %(default)s)")
    ap.add_argument("--port", type=int, default=int(os.environ.get("CTL_PVEHOST_PORT", DEFAULT_PORT)))
    ap.add_argument("--extra-cts", type=int, default=0, metavar="N",
                    help="N more containers on each node (numbered on from its last), e.g. 18 for 40 in all")
    ap.add_argument("--unprivileged", default="", metavar="VMIDS",
                    help="make these default containers unprivileged (comma-separated, e.g. 200,201)")
    ap.add_argument("--ct202", action="store_true",
                    help="add CT 202 on pve1: unprivileged, Debian 11 rootfs with python3 3.9 (built once per machine)")
    args = ap.parse_args(argv)
    base = Path(args.dir)
    try:
        if args.action == "up":
            t0 = time.monotonic()
            if args.extra_cts < 0:
                raise PveHostError(f"--extra-cts must be 0 or more, got {args.extra_cts}")
            try:
                unpriv = tuple(int(v) for v in args.unprivileged.replace(",", " ").split())
            except ValueError:
                raise PveHostError(f"--unprivileged takes vmids like 200,201, got {args.unprivileged!r}") from None
            host = PveHost(base=base, port=args.port, extra_cts=args.extra_cts, unprivileged=unpriv).up()
            if args.ct202:
                host.add_unprivileged(202, "pve1")
            print(f"up in {time.monotonic() - t0:.1f}s at {host.base}")
            _describe(host)
            inv = _write_inventory(host)
            print(f"  inventory: {inv}   try: ctl -i {inv} ping; ctl -i {inv} deploy ct200 --dry-run")
        elif args.action == "down":
            down(base)
            print(f"down: {base} removed")
        else:
            if not (base / "state.json").exists():
                print(f"no test host at {base}")
                return 1
            _describe(load(base))
    except PveHostError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _write_inventory(host: PveHost) -> Path:
    """An inventory for trying ctl by hand: this repository's payload and the test host's containers
    (8 idle stand-in GPUs each)."""
    repo = Path(__file__).resolve().parents[2]
    for node in host.nodes:
        for vmid in node.vmids:
            host.set_gpus(vmid, count=8)
    payload = [
        {"src": str(repo / "remote_payload" / "dflash_model.py"), "dest": "/root/dflash_model.py"},
        {"src": str(repo / "remote_payload" / "train_dflash_pipeline.py"),
         "dest": "/root/train_dflash_pipeline.py"},
        {"template": str(repo / "templates" / "start_training.sh.j2"), "dest": "/root/start_training.sh",
         "mode": "0755"},
    ]
    runs = {"series": "fresh", "session": "dflash", "log": "/workspace/train_stdout_{run}.log"}
    return host.write_inventory(host.base / "inventory.yaml", payload=payload, runs=runs)


def _describe(host: PveHost) -> None:
    for name, (addr, port, node) in host.hosts.items():
        cts = " ".join(f"{v}:{'running' if host.running(v) else 'stopped'}" for v in host.vmids[node])
        print(f"  {name}: {addr}:{port}  containers {cts}")
        print(f"    {' '.join(host.ssh_argv(name))} pct list")
    if host.ct_ssh_vmid:
        print(f"  ct{host.ct_ssh_vmid} sshd: {host.ct_ssh[0]}:{host.ct_ssh[1]}")
    print(f"  client key {host.client_key}, known_hosts {host.known_hosts}")
    with contextlib.suppress(PveHostError):
        print(f"  api: {host.api_url} (CA {host.api_ca}, token {host.api_token[0]}, secret in {host.base}/api/)")
    print(f"  processes: {len(leftover_processes(host.base))}")


if __name__ == "__main__":
    sys.exit(main())
