"""Benchmark: bytes on the wire for `ctl metrics pull` of a large log, first pull vs an unchanged second pull.

Generates a log of --size-mb MiB (the seeds' metric lines, one in --every lines, between NCCL INFO noise) in
CT 200 of the local Proxmox test host (tests/pvehost; --target pve, the default) or under a `local` target
directory (--target local), pulls it twice through the real transport and agent, counts every byte that crosses
the transport (stdin + argv out, stdout + stderr back), and deletes the log afterwards.

    python bench/metrics_pull.py [--target pve|local] [--size-mb 1024] [--results bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from controller.commands import monitor  # noqa: E402
from controller.registry import Registry  # noqa: E402
from controller.transport.counting import Counting  # noqa: E402

NOISE = "kpro6:1234:1301 [{r}] NCCL INFO Channel {c:02d}/0 : {r}[{r}] -> {n}[{n}] via P2P/CUMEM/read\n"
METRIC = ("[{m}m] step={s} loss=9.8123 lr=3.0e-04 tgt=0.33b/s dft=0.33b/s (12.8Ktok/s) q_hs=[0, 2, 1] "
          "| ETA=13.1d\n")




def write_log(path: Path, size: int, every: int) -> int:
    """Write about `size` bytes of log to path; returns the number of metric lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    step = line = 0
    written = 0
    with path.open("w") as f:
        while written < size:
            block = []
            for _ in range(10_000):
                line += 1
                if line % every == 0:
                    step += 1
                    block.append(METRIC.format(m=step // 60, s=step))
                else:
                    block.append(NOISE.format(r=line % 8, c=line % 32, n=(line + 1) % 8))
            text = "".join(block)
            f.write(text)
            written += len(text)
    return step


def b64_cost(chunk: int = 8 << 20) -> dict[str, float]:
    """What base64-in-JSON would cost per chunk compared with raw bytes after a header (measured here)."""
    data = os.urandom(chunk)
    t0 = time.perf_counter()
    doc = json.dumps({"ok": True, "data": base64.b64encode(data).decode()}).encode()
    base64.b64decode(json.loads(doc)["data"])
    t1 = time.perf_counter()
    raw = json.dumps({"ok": True, "length": len(data)}).encode() + b"\n" + data
    head, _, body = raw.partition(b"\n")
    json.loads(head)
    t2 = time.perf_counter()
    return {"b64_bytes_ratio": len(doc) / len(data), "b64_ms": (t1 - t0) * 1e3, "raw_ms": (t2 - t1) * 1e3,
            "raw_bytes_ratio": len(raw) / len(data), "body_ok": float(body == data)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["pve", "local"], default="pve")
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--every", type=int, default=50, help="one metric line in this many lines")
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--results", type=Path, default=None, help="write the Metrics section of this RESULTS.md")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ctl-bench-metrics-"))
    host = None
    log_name = f"/workspace/bench-{os.getpid()}/train_stdout_bench.log"
    try:
        if args.target == "pve":
            from controller.transport.pool import Pool
            from tests.pvehost import DEFAULT_NODES, PveHost, find_free_port

            port = find_free_port([n.address for n in DEFAULT_NODES] + ["127.0.0.4"])
            t_up = time.monotonic()
            host = PveHost(base=work / "pvehost", port=port).up(owner_pid=os.getpid())
            print(f"test host up in {time.monotonic() - t_up:.1f}s", flush=True)
            inv_path = host.write_inventory(work / "inventory.yaml")
            from controller.inventory import load

            inv = load(str(inv_path))
            pool = Pool(inv)
            t = Counting(pool.container(inv.container("ct200")))
            log_file = host.rootfs(200) / log_name.lstrip("/")
            where = "CT 200 of the local Proxmox test host (SSH + simulated `pct exec`)"
        else:
            from controller.transport.local import LocalContainer

            pool = None
            t = Counting(LocalContainer("local", work / "root"))
            log_file = work / "root" / log_name.lstrip("/")
            where = "the `local` target (subprocess)"

        t0 = time.monotonic()
        steps = write_log(log_file, args.size_mb << 20, args.every)
        size = log_file.stat().st_size
        print(f"generated {size:,} bytes ({steps:,} metric lines) in {time.monotonic() - t0:.1f}s", flush=True)

        reg = Registry(work / "registry.sqlite3")
        rec = reg.claim_run("bench", "ct200", log_path=log_name, run_dir=str(Path(log_name).parent / "run"))
        rec = reg.update_run(rec.id, state="running")
        rows = []
        for label in ("first pull", "second pull (unchanged)"):
            t.reset()
            t0 = time.monotonic()
            res = monitor.pull(t, reg, rec, chunk=args.chunk_mib << 20)
            dt = time.monotonic() - t0
            rows.append((label, res.fetched, t.sent, t.received, t.calls, res.new_points, dt))
            print(f"{label}: log bytes {res.fetched:,}; transport out {t.sent:,} B, back {t.received:,} B, "
                  f"{t.calls} call(s), {res.new_points:,} new points, {dt:.1f}s", flush=True)
        assert rows[0][1] == size and rows[0][5] == steps, "first pull must read the whole log"
        second_total = rows[1][2] + rows[1][3]
        print(f"second pull total on the wire: {second_total:,} B ({'<' if second_total < 1 << 20 else '>='} 1 MiB)")
        cost = b64_cost(args.chunk_mib << 20)
        print(f"base64-in-JSON per {args.chunk_mib} MiB chunk: {cost['b64_bytes_ratio']:.3f}x bytes, "
              f"{cost['b64_ms']:.0f} ms encode+decode; raw after a header: {cost['raw_bytes_ratio']:.6f}x, "
              f"{cost['raw_ms']:.1f} ms")
        if args.results:
            write_results(args.results, args, where, size, steps, rows, second_total, cost)
        reg.close()
        return 0 if second_total < 1 << 20 else 1
    finally:
        if host is not None:
            shutil.rmtree(host.rootfs(200) / Path(log_name).parent.relative_to("/"), ignore_errors=True)
            host.down()
        shutil.rmtree(work, ignore_errors=True)


def write_results(path: Path, args: argparse.Namespace, where: str, size: int, steps: int,
                  rows: list[tuple[str, int, int, int, int, int, float]], second_total: int,
                  cost: dict[str, float]) -> None:
    """Replace (or append) the "## Metrics" section; other sections are left as they are."""
    cmd = f"python bench/metrics_pull.py --target {args.target} --size-mb {args.size_mb} --results {path}"
    lines = [
        "## Metrics",
        "",
        f"`{cmd}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores). A {size / 2**20:,.0f} MiB log "
        f"({steps:,} metric lines, one in {args.every}, between NCCL INFO lines) in {where}; `ctl metrics pull` "
        f"logic (monitor.pull, agent verb `logread`, {args.chunk_mib} MiB per call), bytes counted at the "
        "container transport (stdin + argv out; stdout + stderr back).",
        "",
        "| pull | log bytes | transport out | transport back | calls | new points | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, fetched, sent, received, calls, points, dt in rows:
        lines.append(f"| {label} | {fetched:,} | {sent:,} | {received:,} | {calls} | {points:,} | {dt:.1f} |")
    lines += [
        "",
        f"Second pull of the unchanged log: {second_total:,} bytes on the wire in total (target: under 1 MB); "
        "what goes out is the agent's source over stdin (one `python3 -c BOOT` exec), what comes back is one "
        "JSON header line with no log bytes.",
        f"Framing: base64 in the JSON would carry {cost['b64_bytes_ratio']:.2f}x the bytes and cost "
        f"{cost['b64_ms']:.0f} ms of encode+decode per {args.chunk_mib} MiB chunk here; raw bytes after a "
        f"header line cost {cost['raw_bytes_ratio']:.6f}x and {cost['raw_ms']:.1f} ms, so `logread` sends raw.",
        "",
    ]
    text = path.read_text() if path.exists() else "# Benchmark results\n\n"
    start = text.find("## Metrics")
    if start >= 0:
        nxt = text.find("\n## ", start + 1)
        text = text[:start] + "\n".join(lines) + (text[nxt + 1:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines)
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
