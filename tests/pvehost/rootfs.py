"""The rootfs of the test host's unprivileged container (CT 202): Debian bullseye, so python3 is 3.9, older than
this machine's, as an operator's long-lived container often is.

Built once per machine by debootstrap from the Debian mirror apt uses, packed as a plain template tarball (owners
as inside the container, like a Proxmox template from `pveam`) under /var/cache/ctl-tests (CTL_TEST_CACHE), and
built under a lock so that two sessions or workers starting at once build it once. Each test host unpacks it
shifted into the container's uid range the way Proxmox restores a template for an unprivileged container:
`lxc-usernsexec -m u:0:100000:65536 -m g:0:100000:65536 -- tar xpf ...`, so container root's files belong to host
uid 100000.

    python tests/pvehost/rootfs.py      # root's subuid/subgid range, then build (or find) the tarball and print its
                                        # path (scripts/test.sh runs it)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

SUITE = "bullseye"
MIRROR = "http://deb.debian.org/debian"
# What ctl needs in a container (docs/getting-started.md: python3, tmux) and the test host's own: procps for the
# tests' looks at processes, tini as init (reaps orphans, as init.lxc does for the other containers: this rootfs
# cannot run the host's init.lxc, which links the host's liblxc).
PACKAGES = ("python3", "tmux", "procps", "tini")
# Proxmox's default for an unprivileged container: container ids 0..65535 are host ids 100000..165535.
ID_BASE = 100000
ID_COUNT = 65536
# Bumped when the way the tarball is made changes, so that a cached one made the old way is not used.
FORMAT = 1


class RootfsError(RuntimeError):
    """The rootfs could not be built or unpacked; the message says which step and why."""


def cache_dir() -> Path:
    return Path(os.environ.get("CTL_TEST_CACHE") or "/var/cache/ctl-tests")


def tarball_name(suite: str = SUITE, packages: Iterable[str] = PACKAGES, arch: str | None = None) -> str:
    """The cached tarball's name: a change of suite, packages, architecture or FORMAT gives another name (the old
    one is left for `rm` by hand: nothing here deletes a cache it did not just write)."""
    arch = arch or _dpkg_arch()
    key = hashlib.sha256(f"{FORMAT} {suite} {arch} {' '.join(sorted(set(packages)))}".encode()).hexdigest()[:12]
    return f"ct-{suite}-{arch}-{key}.tar.gz"


def idmap_lines(base: int = ID_BASE, count: int = ID_COUNT) -> list[str]:
    """The LXC config lines pve-container writes for an unprivileged container without a custom idmap."""
    return [f"lxc.idmap = u 0 {base} {count}", f"lxc.idmap = g 0 {base} {count}"]


def subid_missing(text: str, user: str = "root", base: int = ID_BASE, count: int = ID_COUNT) -> bool:
    """Whether /etc/subuid (or subgid) text lacks a range of `user` covering base..base+count-1, which newuidmap
    (lxc-usernsexec, and LXC where shadow's uidmap is installed) requires of root too."""
    for line in text.splitlines():
        parts = line.strip().split(":")
        if len(parts) != 3 or parts[0] != user or not (parts[1].isdigit() and parts[2].isdigit()):
            continue
        start, n = int(parts[1]), int(parts[2])
        if start <= base and base + count <= start + n:
            return False
    return True


SUBID_FILES = ("/etc/subuid", "/etc/subgid")


def _read_or_empty(name: str) -> str:
    try:
        return Path(name).read_text()
    except FileNotFoundError:
        return ""


def add_subids(files: Sequence[str] = SUBID_FILES) -> list[str]:
    """Give root the range Proxmox gives it (root:100000:65536) in /etc/subuid and /etc/subgid where it lacks one;
    returns the files changed."""
    changed = []
    for name in files:
        text = _read_or_empty(name)
        if subid_missing(text):
            with open(name, "a") as f:
                f.write(("" if not text or text.endswith("\n") else "\n") + f"root:{ID_BASE}:{ID_COUNT}\n")
            changed.append(name)
    return changed


def missing_subids(files: Sequence[str] = SUBID_FILES) -> str | None:
    """Which file lacks root's range (None: both have it)."""
    for name in files:
        if subid_missing(_read_or_empty(name)):
            return (f"{name} gives root no range {ID_BASE}:{ID_COUNT} (`python tests/pvehost/rootfs.py` as root adds "
                    f"root:{ID_BASE}:{ID_COUNT})")
    return None


def _dpkg_arch() -> str:
    r = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True)
    return r.stdout.strip() or "amd64"


def _run(argv: Sequence[str], what: str, timeout: float = 1800) -> None:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        tail = (r.stderr.strip() or r.stdout.strip())[-1500:]
        raise RootfsError(f"{what} failed (exit {r.returncode}): {' '.join(argv)}\n{tail}")


def why_cannot_build() -> str | None:
    """Why this machine cannot build the tarball (None: it can)."""
    if os.geteuid() != 0:
        return "building the unprivileged container's rootfs needs root (debootstrap)"
    if shutil.which("debootstrap") is None and not os.access("/usr/sbin/debootstrap", os.X_OK):
        return "debootstrap is missing (apt install debootstrap)"
    return None


def ensure(directory: Path | None = None) -> Path:
    """The cached tarball, built first if there is none. Several processes may call this at once: one builds,
    the others wait on the lock and then find it."""
    d = directory or cache_dir()
    path = d / tarball_name()
    if path.is_file():
        return path
    why = why_cannot_build()
    if why:
        raise RootfsError(why)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RootfsError(f"cannot make the cache directory {d} (CTL_TEST_CACHE overrides it): {e.strerror}") from None
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file():
            _build(path)
    return path


def _build(path: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=path.parent))
    try:
        root = work / "rootfs"
        debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
        _run([debootstrap, "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(root), MIRROR],
             f"debootstrap {SUITE} from {MIRROR}")
        # What a container never needs: downloaded .debs, apt's lists, documentation (a smaller tarball to unpack
        # at every test host's start).
        for sub in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man",
                    "usr/share/locale", "usr/share/info"):
            target = root / sub
            if target.is_dir():
                for entry in target.iterdir():
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry)
                    else:
                        entry.unlink()
        tmp = work / path.name
        _run(["tar", "--numeric-owner", "-czf", str(tmp), "-C", str(root), "."], "packing the rootfs")
        os.replace(tmp, path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def unpack(tarball: Path, dest: Path, base: int = ID_BASE, count: int = ID_COUNT) -> None:
    """Unpack the template into dest as pve-container restores one for an unprivileged container: tar runs in a
    user namespace with the container's idmap, so each file's owner is its container owner shifted by `base`.
    Device nodes are left out (none can be made there; LXC's autodev fills /dev)."""
    dest.mkdir(parents=True, exist_ok=True)
    os.chown(dest, base, base)
    _run(["lxc-usernsexec", "-m", f"u:0:{base}:{count}", "-m", f"g:0:{base}:{count}", "--",
          "tar", "--numeric-owner", "-xpzf", str(tarball), "-C", str(dest), "--exclude=./dev/*"],
         f"unpacking {tarball.name} into {dest} in the container's user namespace", timeout=600)


def main() -> int:
    t0 = time.monotonic()
    try:
        if os.geteuid() == 0:
            add_subids()
        path = ensure()
    except (RootfsError, OSError, subprocess.TimeoutExpired) as e:
        print(f"rootfs: {e}", file=sys.stderr)
        return 1
    with contextlib.suppress(OSError):
        print(f"rootfs: {path} ({path.stat().st_size >> 20} MiB, {time.monotonic() - t0:.1f}s)", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
