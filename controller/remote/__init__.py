"""What runs over there, and the one client that speaks to it.

agent.py (in containers), hostrelay.py (on Proxmox hosts) and probe_env.py (in the training venv) are stdlib
Python sent over an exec's stdin; they ship inside the package and are read with importlib.resources, so an
installed ctl (a wheel, pipx, uv tool) carries them as a checkout does.
"""

from __future__ import annotations

import os
from functools import cache


@cache
def source(name: str) -> bytes:
    """The bytes of one of the scripts that run remotely (agent.py, hostrelay.py, probe_env.py)."""
    try:  # the package is a directory (a checkout, a wheel, pipx, uv tool): read it, as files() would
        with open(os.path.join(os.path.dirname(__file__), name), "rb") as f:
            return f.read()
    except OSError:
        pass
    from importlib.resources import files  # (and zipfile): anything else, such as a zip on sys.path

    return files(__name__).joinpath(name).read_bytes()


# What `python3 -I -S -c BOOT N ...` runs: N bytes of a program's source from stdin, run as __main__. Its compiled
# code is kept on the far side (/run/ctl, root's own, gone at reboot; a `local` target's in its own root,
# CTL_AGENT_CODE_DIR, which BOOT takes out of the environment) under the source's sha256 and the python's version,
# by the program itself once it has said hello (agent.py and hostrelay.py: keep_compiled), so the next start of
# the same program reads it instead of compiling it again (the agent's 90 KB: ~20 ms of CPU, once per container of
# a fan-out; the relay's: ~13 ms before every session's hello). Used only when the file is the running user's, not
# writable by others, not a symlink, and holds a code object; anything else compiles, as before. The key's sha256
# is the interpreter's own (_sha256, _sha2 from 3.12): hashlib would load OpenSSL, ~9 ms of every start.
_BOOT = """import sys,os,marshal
try:from _sha256 import sha256
except ImportError:
 try:from _sha2 import sha256
 except ImportError:from hashlib import sha256
s=sys.stdin.buffer.read(int(sys.argv[1]));c=None
k=os.environ.pop('CTL_AGENT_CODE_DIR','/run/ctl')+'/NAME-%s-%x'%(sha256(s).hexdigest()[:32],sys.hexversion)
try:
 f=os.open(k,os.O_RDONLY|os.O_NOFOLLOW)
 try:
  t=os.fstat(f)
  if t.st_uid==os.geteuid() and not t.st_mode&18:c=marshal.loads(os.read(f,t.st_size))
 finally:os.close(f)
except Exception:c=None
if type(c) is not type(compile('','','exec')):c=compile(s,'ctl-NAME','exec');__ctl_compiled__=(k,c)
del s
exec(c)"""


def boot(name: str) -> str:
    """The one-line BOOT of a program (`agent`, `relay`): it is shown in --dry-run's commands."""
    return f"exec({_BOOT.replace('NAME', name)!r})"

