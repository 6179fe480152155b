"""What runs over there, and the one client that speaks to it.

agent.py (in containers), hostrelay.py (on Proxmox hosts) and probe_env.py (in the training venv) are stdlib
Python sent over an exec's stdin; they ship inside the package and are read with importlib.resources, so an
installed ctl (a wheel, pipx, uv tool) carries them as a checkout does.
"""

from __future__ import annotations

from functools import cache


@cache
def source(name: str) -> bytes:
    """The bytes of one of the scripts that run remotely (agent.py, hostrelay.py, probe_env.py)."""
    from importlib.resources import files

    return files(__name__).joinpath(name).read_bytes()
