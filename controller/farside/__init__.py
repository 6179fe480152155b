"""The programs ctl runs over there, written in parts, and the loader that joins each into the source that ships.

agent (in containers), relay (on Proxmox hosts), probe_env (in the training venv) and ctl doctor's two GPU
probes are stdlib Python sent over
an exec's stdin: each must travel as ONE source. They are written as several modules (agent/, relay/, and
common.py, which both include) and joined here, at ship time, in the order PROGRAMS declares. In the joined source
every part shares one namespace; the relative imports a part makes of earlier parts (`from .fs import _opendir`)
say where a name comes from for readers, ruff and mypy, and are left out of the join (tests/test_farside.py checks
that each names only earlier parts, and that the join is the same bytes in every process: its sha256 keys the
compiled code kept over there, see _BOOT).

This package sits at the bottom of ctl: it imports nothing of ctl. ctl reads the parts as files and imports none of
them but common.py (its _pid_alive, for the session client in transport/mux/); transport/ (the host relay) and
remote/ (the agent's client) take their sources and BOOT lines from here. The parts
ship inside the package and are read beside this file, or with importlib.resources when ctl runs from a zip.
"""

from __future__ import annotations

import os
import sys
from functools import cache
from types import ModuleType

#: Each program's parts, in the order they are joined: the first holds the program's docstring (the GPU probes':
#: their own part, after the procs.py they share), and a part may use only what the parts before it define at their
#: top level.
PROGRAMS: dict[str, tuple[str, ...]] = {
    "agent": ("agent/__init__.py", "common.py", "agent/base.py", "agent/fs.py", "agent/deploy.py", "agent/logs.py",
              "agent/runs.py", "agent/cache.py", "agent/checkpoints.py", "agent/serve.py"),
    "relay": ("relay/__init__.py", "common.py", "relay/base.py", "relay/mux.py", "relay/agents.py", "relay/main.py"),
    "probe_env": ("probe_env.py",),
    "probe_gpu": ("procs.py", "probe_gpu.py"),  # ctl doctor's, in containers (probe_env's source is put into it)
    "probe_host_gpu": ("procs.py", "probe_host_gpu.py"),  # ctl doctor's, on Proxmox hosts
}


def part(rel: str) -> bytes:
    """The bytes of one part, as it is written (rel: its path in this package)."""
    try:  # the package is a directory (a checkout, a wheel, pipx, uv tool): read it, as files() would
        with open(os.path.join(os.path.dirname(__file__), rel), "rb") as f:
            return f.read()
    except OSError:
        pass
    from importlib.resources import files  # (and zipfile): anything else, such as a zip on sys.path

    return files(__name__).joinpath(rel).read_bytes()


def _shipped(text: bytes) -> bytes:
    """A part without its relative imports (`from .x import a, b`, or over several lines in parentheses). They
    stand at the start of lines after the part's docstring; found with bytes.find (a loop over every line of the
    agent cost each process ~1 ms more, on the path of every command that speaks to an agent)."""
    pieces, pos = [], 0
    while (at := text.find(b"\nfrom .", max(pos - 1, 0))) >= 0:
        pieces.append(text[pos:at + 1])
        end = text.find(b"\n", at + 1)
        if text.find(b"(", at, end) >= 0 and text.find(b")", at, end) < 0:
            end = text.find(b"\n", text.find(b")", end))
        pos = end + 1
    pieces.append(text[pos:])
    return b"".join(pieces).strip(b"\n") + b"\n"


@cache
def source(name: str) -> bytes:
    """The one source of a program (`agent`, `relay`, `probe_env`) as it ships: its parts joined, once a process."""
    return b"\n\n".join(_shipped(part(rel)) for rel in PROGRAMS[name])


@cache
def load(name: str) -> ModuleType:
    """A program as a module of this process (the tests read and patch its functions): the joined source itself,
    run under a name that is not __main__, so that it defines everything and starts nothing."""
    import linecache

    filename = f"ctl-{name}"
    text = source(name)
    linecache.cache[filename] = (len(text), None, text.decode().splitlines(keepends=True), filename)
    module = ModuleType(f"ctl_{name}", None)
    module.__file__ = filename
    sys.modules[module.__name__] = module
    exec(compile(text, filename, "exec"), module.__dict__)  # noqa: S102 (our own source, as it ships)
    return module


# What `python3 -I -S -c BOOT N ...` runs: N bytes of a program's source from stdin, run as __main__. Its compiled
# code is kept on the far side (/run/ctl, root's own, gone at reboot; a `local` target's in its own root,
# CTL_AGENT_CODE_DIR, which BOOT takes out of the environment) under the source's sha256 and the python's version,
# by the program itself once it has said hello (common.py: keep_compiled), so the next start of the same program
# reads it instead of compiling it again (the agent's 90 KB: ~20 ms of CPU, once per container of a fan-out; the
# relay's: ~13 ms before every session's hello). Used only when the file is the running user's, not writable by
# others, not a symlink, and holds a code object; anything else compiles, as before. The key's sha256 is the
# interpreter's own (_sha256, _sha2 from 3.12): hashlib would load OpenSSL, ~9 ms of every start.
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
