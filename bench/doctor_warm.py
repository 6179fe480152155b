"""`ctl doctor CT` on a warm session, side by side with `ctl ping CT` (the floor of any command that asks a
container), on the local Proxmox test host with a healthy GPU setup faked as tests/integration/test_doctor_pve.py
fakes it. Root, LXC and sshd, like the integration tests; prints medians and writes nothing. Run through pytest,
which brings the test host up:

    .venv/bin/python -m pytest -q -s -p no:cacheprovider -p tests.conftest -p tests.integration.conftest \
        bench/doctor_warm.py

Both commands run as `python -m controller` (never through the command server), after an untimed ping that
starts the host's persistent session: what is timed is the command, its round trips on a warm session, and
(for doctor) the host's `pct config`, nvidia-smi and the container's probe.
"""

from __future__ import annotations

import statistics
import time

from tests.conftest import install_torch
from tests.integration.conftest import PveEnv, container_venv
from tests.pvehost import gpu

VMID, CT, NODE = 201, "ct201", "pve1"
NODES = {"/dev/nvidia0": "ok", "/dev/nvidia1": "ok", "/dev/nvidiactl": "ok", "/dev/nvidia-uvm": "ok",
         "/dev/nvidia-uvm-tools": "ok"}
CONFIG = ["dev0: /dev/nvidia0", "dev1: /dev/nvidia1", "dev2: /dev/nvidiactl", "dev3: /dev/nvidia-uvm",
          "dev4: /dev/nvidia-uvm-tools"]


def _time(env: PveEnv, *args: str) -> float:
    t0 = time.perf_counter()
    r = env.ctl(*args)
    took = time.perf_counter() - t0
    assert r.returncode == 0, r.stdout + r.stderr  # a failing run is no figure
    return took


REPEAT = 9


def test_doctor_on_a_warm_session(pve_env: PveEnv) -> None:
    inside, venv = container_venv(pve_env, VMID)
    install_torch(venv, "2.9.0+cu124", "12.4")
    pve_env.write(containers={CT: {"gpus": {"target": [0, 1], "drafter": []}, "vars": {"venv": inside}}})
    gpu.set_host(pve_env.host, NODE, count=2)
    try:
        gpu.set_config(pve_env.host, VMID, CONFIG)
        gpu.place(pve_env.host, VMID, NODES)
        pve_env.ctl("ping", CT, check=True)  # the host's session up
        pings, doctors = [], []
        for _ in range(REPEAT):  # interleaved: the machine's phases fall on both alike
            pings.append(_time(pve_env, "ping", CT))
            doctors.append(_time(pve_env, "doctor", CT))
        p, d = statistics.median(pings), statistics.median(doctors)
        print(f"\nctl ping {CT}    median {p:.3f} s  (min {min(pings):.3f})"
              f"\nctl doctor {CT}  median {d:.3f} s  (min {min(doctors):.3f})  {d / p:.2f}x ping;"
              f" goal: under 2 s on a warm session")
    finally:
        gpu.clear_host(pve_env.host, NODE)
        gpu.reset_ct(pve_env.host, VMID)
