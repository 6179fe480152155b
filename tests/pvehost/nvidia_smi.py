#!/usr/bin/python3
"""An `nvidia-smi` stand-in for the test containers (installed as the container's /sbin/nvidia-smi).

State comes from /etc/ctl-fake-gpu.json, written from the host by `PveHost.set_gpus`:
  {"gpus": [{"index", "uuid", "name", "memory_total", "memory_used", "utilization", "bus_id", "persistence"}],
   "processes": [{"gpu": index, "pid", "name", "used_memory"}], "driver_version", "cuda_version",
   "error": {"text", "rc"} (NVML's failure, printed instead of any answer)}
No state file = no driver: the real tool's message and exit status 9. The Proxmox host's copy (tests/pvehost/host.py)
reads its state from the node's hostroot/ instead.
"""

from __future__ import annotations

import json
import sys

STATE = "/etc/ctl-fake-gpu.json"
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.\n")

# field -> (header, unit or None, getter)
GPU_FIELDS = {
    "index": ("index", None, lambda g, s: g["index"]),
    "uuid": ("uuid", None, lambda g, s: g["uuid"]),
    "gpu_uuid": ("uuid", None, lambda g, s: g["uuid"]),
    "name": ("name", None, lambda g, s: g["name"]),
    "gpu_name": ("name", None, lambda g, s: g["name"]),
    "pci.bus_id": ("pci.bus_id", None, lambda g, s: g["bus_id"]),
    "gpu_bus_id": ("pci.bus_id", None, lambda g, s: g["bus_id"]),
    "driver_version": ("driver_version", None, lambda g, s: s["driver_version"]),
    "count": ("count", None, lambda g, s: len(s["gpus"])),
    "memory.total": ("memory.total", "MiB", lambda g, s: g["memory_total"]),
    "memory.used": ("memory.used", "MiB", lambda g, s: g["memory_used"]),
    "memory.free": ("memory.free", "MiB", lambda g, s: g["memory_total"] - g["memory_used"]),
    "utilization.gpu": ("utilization.gpu", "%", lambda g, s: g["utilization"]),
    "utilization.memory": ("utilization.memory", "%",
                           lambda g, s: g["memory_used"] * 100 // max(g["memory_total"], 1)),
    "temperature.gpu": ("temperature.gpu", None, lambda g, s: 35 + g["utilization"] // 3),
    "persistence_mode": ("persistence_mode", None,
                         lambda g, s: "Enabled" if g.get("persistence", True) else "Disabled"),
}
APP_FIELDS = {
    "gpu_uuid": ("gpu_uuid", None, lambda p, g: g["uuid"]),
    "gpu_name": ("gpu_name", None, lambda p, g: g["name"]),
    "gpu_bus_id": ("gpu_bus_id", None, lambda p, g: g["bus_id"]),
    "pid": ("pid", None, lambda p, g: p["pid"]),
    "process_name": ("process_name", None, lambda p, g: p["name"]),
    "name": ("process_name", None, lambda p, g: p["name"]),
    "used_memory": ("used_gpu_memory", "MiB", lambda p, g: p["used_memory"]),
    "used_gpu_memory": ("used_gpu_memory", "MiB", lambda p, g: p["used_memory"]),
}


def load() -> dict | None:  # type: ignore[type-arg]
    try:
        with open(STATE, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None
    state.setdefault("driver_version", "550.54.15")
    state.setdefault("cuda_version", "12.4")
    state.setdefault("processes", [])
    return state


def parse(argv: list[str]) -> dict[str, str]:
    opts: dict[str, str] = {}
    it = iter(argv)
    for a in it:
        if a in ("-L", "--list-gpus"):
            opts["list"] = "1"
        elif a.startswith("--") and "=" in a:
            k, _, v = a[2:].partition("=")
            opts[k] = v
        elif a in ("-i", "--id", "--format", "--query-gpu", "--query-compute-apps"):
            opts[{"-i": "id"}.get(a, a.lstrip("-"))] = next(it, "")
        elif a.startswith("-i") and len(a) > 2:
            opts["id"] = a[2:]
        else:
            sys.stderr.write("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n")
            sys.exit(2)
    return opts


def csv(fields: list[str], table: dict, rows: list[tuple], fmt: set[str]) -> None:  # type: ignore[type-arg]
    units = "nounits" not in fmt
    for f in fields:
        if f not in table:
            sys.stderr.write(f'Field "{f}" is not a valid field to query.\n\n')
            sys.exit(2)
    if "noheader" not in fmt:
        heads = []
        for f in fields:
            head, unit, _ = table[f]
            heads.append(f"{head} [{unit}]" if unit else head)
        print(", ".join(heads))
    for a, b in rows:
        vals = []
        for f in fields:
            _, unit, get = table[f]
            v = str(get(a, b))
            vals.append(f"{v} {unit}" if unit and units else v)
        print(", ".join(vals))


def table(state: dict) -> None:  # type: ignore[type-arg]
    gpus = state["gpus"]
    print("+-----------------------------------------------------------------------------------------+")
    print(f"| NVIDIA-SMI {state['driver_version']:<21}Driver Version: {state['driver_version']:<14}"
          f"CUDA Version: {state['cuda_version']:<9}|")
    print("|-----------------------------------------+------------------------+----------------------+")
    print("| GPU  Name                               | Bus-Id          Disp.A | Memory-Usage  GPU-Util|")
    print("|=========================================+========================+======================|")
    for g in gpus:
        mem = f"{g['memory_used']}MiB / {g['memory_total']}MiB"
        print(f"| {g['index']:>3}  {g['name'][:34]:<34} | {g['bus_id'][-16:]:<16}   Off | {mem:<17}"
              f"{str(g['utilization']) + '%':>4} |")
    print("+-----------------------------------------+------------------------+----------------------+")
    print("| Processes:                                                                              |")
    print("|  GPU        PID   Process name                                              GPU Memory |")
    print("|=========================================================================================|")
    procs = state["processes"]
    if not procs:
        print("|  No running processes found                                                             |")
    for p in procs:
        print(f"|  {p['gpu']:>3}  {p['pid']:>9}   {p['name'][:55]:<55}  {str(p['used_memory']) + 'MiB':>10} |")
    print("+-----------------------------------------------------------------------------------------+")


def main(argv: list[str]) -> int:
    opts = parse(argv)
    state = load()
    if state is None:
        sys.stdout.write(NO_DRIVER)
        return 9
    if state.get("error"):  # NVML failed to initialise: its message, whatever was asked
        sys.stdout.write(state["error"]["text"].rstrip("\n") + "\n")
        return int(state["error"]["rc"])
    gpus = state["gpus"]
    if "id" in opts:
        wanted = {int(x) for x in opts["id"].split(",") if x.strip().isdigit()}
        gpus = [g for g in gpus if g["index"] in wanted]
    by_index = {g["index"]: g for g in state["gpus"]}
    fmt = set(opts.get("format", "").split(","))
    if "query-gpu" in opts or "query-compute-apps" in opts:
        if "csv" not in fmt:
            sys.stderr.write("'--format=' option is required when using '--query-*' switches.\n")
            return 2
        if "query-gpu" in opts:
            csv(opts["query-gpu"].split(","), GPU_FIELDS, [(g, state) for g in gpus], fmt)
        else:
            ids = {g["index"] for g in gpus}
            rows = [(p, by_index[p["gpu"]]) for p in state["processes"] if p["gpu"] in ids]
            csv(opts["query-compute-apps"].split(","), APP_FIELDS, rows, fmt)
        return 0
    if "list" in opts:
        for g in gpus:
            print(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})")
        return 0
    table(state)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
