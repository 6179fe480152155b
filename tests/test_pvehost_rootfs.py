"""The pure parts of the unprivileged test container's rootfs builder (tests/pvehost/rootfs.py): the cache's name,
the idmap lines, root's subuid/subgid range. The build and unpack themselves run in test_unpriv_pve.py."""

from __future__ import annotations

from pathlib import Path

from tests.pvehost import rootfs


def test_tarball_name_follows_what_goes_in() -> None:
    name = rootfs.tarball_name("bullseye", ("python3", "tmux"), "amd64")
    assert name.startswith("ct-bullseye-amd64-") and name.endswith(".tar.gz")
    # the same set in another order or with a repeat is the same tarball; anything else is another one
    assert rootfs.tarball_name("bullseye", ("tmux", "python3", "tmux"), "amd64") == name
    others = {rootfs.tarball_name("bookworm", ("python3", "tmux"), "amd64"),
              rootfs.tarball_name("bullseye", ("python3", "tmux", "tini"), "amd64"),
              rootfs.tarball_name("bullseye", ("python3", "tmux"), "arm64")}
    assert name not in others and len(others) == 3


def test_idmap_lines_are_pve_containers() -> None:
    assert rootfs.idmap_lines() == ["lxc.idmap = u 0 100000 65536", "lxc.idmap = g 0 100000 65536"]


def test_subid_range_must_cover_the_whole_map() -> None:
    assert rootfs.subid_missing("")
    assert not rootfs.subid_missing("root:100000:65536\n")
    assert not rootfs.subid_missing("alice:100000:65536\nroot:100000:131072\n")  # a wider range covers it
    assert rootfs.subid_missing("root:100000:65535\n")  # one id short
    assert rootfs.subid_missing("root:165536:65536\n")  # another range
    assert rootfs.subid_missing("alice:100000:65536\n")  # another user's
    assert rootfs.subid_missing("root:100000\n#root:100000:65536\n")


def test_add_subids_appends_once(tmp_path: Path) -> None:
    uid, gid = tmp_path / "subuid", tmp_path / "subgid"
    uid.write_text("alice:165536:65536")  # no trailing newline: the new line must not join it
    files = (str(uid), str(gid))  # subgid does not exist yet
    assert rootfs.add_subids(files) == list(files)
    assert uid.read_text() == "alice:165536:65536\nroot:100000:65536\n"
    assert gid.read_text() == "root:100000:65536\n"
    assert rootfs.missing_subids(files) is None
    assert rootfs.add_subids(files) == []
    assert uid.read_text() == "alice:165536:65536\nroot:100000:65536\n"
