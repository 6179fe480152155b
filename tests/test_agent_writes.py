"""Writes of ctl's agent (controller/farside/agent/) on the `local` target: destinations are walked without
following symlinks, the commit phase either puts every old file back or names what stays replaced (and
`ctl deploy --rollback` restores it), no temporary file remains, and store copies keep the file's mode."""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path

import pytest
import yaml

from controller import farside
from controller.commands import deploy as deploy_mod
from controller.commands.pins import pin
from controller.errors import InputError
from controller.inventory import load
from controller.registry import Registry
from controller.remote.client import ApplyReply
from controller.transport.pool import Pool
from tests.helpers import sha_bytes

agent_mod = farside.load("agent")


@pytest.fixture
def box(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(directory with the sources and inventory, the target's root, the elsewhere a symlink points to)."""
    root = tmp_path / "root"
    (root / "root" / "app").mkdir(parents=True)
    elsewhere = tmp_path / "etc-cron.d"
    elsewhere.mkdir()
    for n in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / n).write_bytes(n.encode() * 10)
    return tmp_path, root, elsewhere


def inventory(tmp_path: Path, root: Path, dests: list[tuple[str, str]], **ct: object) -> Path:
    doc = {"containers": {"loc": {"transport": "local", "root": str(root), **ct}},
           "payload": [{"src": s, "dest": d} for s, d in dests]}
    p = tmp_path / "inventory.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def run_deploy(inv_path: Path, state: Path) -> tuple[deploy_mod.DeployResult, Registry]:
    inv = load(inv_path)
    ct = inv.container("loc")
    reg = Registry(state / "registry.sqlite3")
    with Pool(inv) as pool:
        return deploy_mod.deploy(inv, ct, pool.container(ct), reg, allow_dirty=True), reg


def leftovers(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if ".ctl-" in p.name or ".tmp" in p.name]


def test_symlinked_parent_is_refused_naming_the_component(box: tuple[Path, Path, Path]) -> None:
    src, root, elsewhere = box
    (root / "root" / "app" / "sub").symlink_to(elsewhere)
    inv = inventory(src, root, [("a.txt", "/root/app/sub/x")])
    with pytest.raises(InputError) as e:
        run_deploy(inv, src / "state")
    assert "/root/app/sub is a symlink" in str(e.value) and "/root/app/sub/x" in str(e.value)
    assert list(elsewhere.iterdir()) == []


def test_agent_apply_refuses_a_symlink_even_without_the_plan(box: tuple[Path, Path, Path]) -> None:
    """Defence in depth: the apply verb itself (rollback's path) walks without following symlinks."""
    _src, root, elsewhere = box
    (root / "root" / "app" / "sub").symlink_to(elsewhere)
    body = b"* * * * * root id\n"
    tar = deploy_mod.bundle([{"index": 0, "dest": "/root/app/sub/x", "sha256": sha_bytes(body), "mode": "0644",
                              "from": "tar"}], [body])
    out = agent_mod.apply(str(root), str(root / "var/lib/ctl"), "d1", io.BytesIO(tar))
    assert not out["ok"] and out["code"] == "symlink" and "/root/app/sub is a symlink" in out["error"]
    assert list(elsewhere.iterdir()) == [] and leftovers(root) == []
    # The same walk for hashes: the file behind the symlink is not read either.
    (elsewhere / "y").write_text("secret")
    h = agent_mod.hashes(str(root), ["/root/app/sub/y"])["files"]["/root/app/sub/y"]
    assert h["code"] == "symlink" and "sha256" not in h


def test_follow_symlinks_prefix_allows_it(box: tuple[Path, Path, Path]) -> None:
    src, root, elsewhere = box
    (root / "root" / "app" / "sub").symlink_to(elsewhere)
    inv = inventory(src, root, [("a.txt", "/root/app/sub/x")], follow_symlinks=["/root/app/sub"])
    res, _reg = run_deploy(inv, src / "state")
    assert res.changed == 1 and (elsewhere / "x").read_bytes() == (src / "a.txt").read_bytes()


def test_symlink_as_the_destination_itself_is_refused(box: tuple[Path, Path, Path]) -> None:
    src, root, elsewhere = box
    (elsewhere / "target").write_text("keep")
    (root / "root" / "app" / "x").symlink_to(elsewhere / "target")
    inv = inventory(src, root, [("a.txt", "/root/app/x")])
    with pytest.raises(InputError, match="a symlink"):
        run_deploy(inv, src / "state")
    assert (elsewhere / "target").read_text() == "keep"


def _fail_rename_of(monkeypatch: pytest.MonkeyPatch, name: str, *, also_undo: bool = False) -> None:
    real = os.replace

    def replace(a: object, b: object, **kw: object) -> None:
        if b == name and (also_undo or ".ctl-undo-" not in str(a)):
            raise OSError(16, "Device or resource busy", name)
        real(a, b, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(agent_mod.os, "replace", replace)


def _v1_then_v2(src: Path, root: Path) -> tuple[Path, dict[str, bytes], list[dict[str, str]], bytes]:
    """Deploy a, b, c (v1); return the bundle of v2 of all three for the agent's apply verb."""
    inv = inventory(src, root, [(n, f"/root/app/{n}") for n in ("a.txt", "b.txt", "c.txt")])
    run_deploy(inv, src / "state")
    v1 = {n: (root / "root/app" / n).read_bytes() for n in ("a.txt", "b.txt", "c.txt")}
    entries, bodies = [], []
    for i, n in enumerate(("a.txt", "b.txt", "c.txt")):
        body = v1[n] + b" v2"
        (src / n).write_bytes(body)
        entries.append({"index": i, "dest": f"/root/app/{n}", "sha256": sha_bytes(body), "mode": "0644", "from": "tar"})
        bodies.append(body)
    return inv, v1, entries, deploy_mod.bundle(entries, bodies)


def test_rename_failing_midway_puts_every_old_file_back(box: tuple[Path, Path, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    src, root, _ = box
    _inv, v1, _entries, tar = _v1_then_v2(src, root)
    _fail_rename_of(monkeypatch, "b.txt")
    out = agent_mod.apply(str(root), str(root / "var/lib/ctl"), "d2", io.BytesIO(tar))
    assert not out["ok"] and out["stage"] == "commit" and not out.get("partial")
    assert "Device or resource busy" in out["error"] and "put back" in out["error"]
    assert {n: (root / "root/app" / n).read_bytes() for n in v1} == v1
    assert leftovers(root) == []


def test_read_back_mismatch_is_rolled_back_not_reported_as_nothing_replaced(
        box: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    src, root, _ = box
    _inv, v1, _entries, tar = _v1_then_v2(src, root)
    real = agent_mod._stat_at

    def lying(fd: int, name: str, where: str, follow: object = ()) -> object:
        got = real(fd, name, where, follow)
        if name == "c.txt" and got and got.get("sha256") == sha_bytes(v1["c.txt"] + b" v2"):
            return dict(got, sha256="0" * 64)
        return got

    monkeypatch.setattr(agent_mod, "_stat_at", lying)
    out = agent_mod.apply(str(root), str(root / "var/lib/ctl"), "d3", io.BytesIO(tar))
    assert not out["ok"] and out["code"] == "verify" and "read back" in out["error"]
    assert {n: (root / "root/app" / n).read_bytes() for n in v1} == v1
    assert leftovers(root) == []


def test_when_the_undo_fails_too_ctl_names_what_stays_replaced_and_rollback_restores_it(
        box: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    src, root, _ = box
    inv_path, v1, _entries, _tar = _v1_then_v2(src, root)
    real = os.replace

    def replace(a: object, b: object, **kw: object) -> None:
        if b == "b.txt" or (b == "a.txt" and ".ctl-undo-" in str(a)):  # b cannot land, a cannot go back
            raise OSError(16, "Device or resource busy", str(b))
        real(a, b, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(agent_mod.os, "replace", replace)
    # The local transport runs the agent in a subprocess; run it in-process through apply via sync's path.
    inv = load(inv_path)
    ct = inv.container("loc")
    reg = Registry(src / "state" / "registry.sqlite3")
    manifest = pin(inv, ct)
    entries = [{"index": i, "dest": f.dest, "sha256": f.sha256, "mode": f.mode, "size": f.size, "from": "tar"}
               for i, f in enumerate(manifest.files)]
    doc = agent_mod.apply(str(root), str(root / "var/lib/ctl"), "d4",
                          io.BytesIO(deploy_mod.bundle(entries, [f.content for f in manifest.files])))
    assert not doc["ok"] and doc["partial"] and doc["replaced"] == ["/root/app/a.txt"]
    assert (root / "root/app/a.txt").read_bytes() == v1["a.txt"] + b" v2"
    assert (root / "root/app/b.txt").read_bytes() == v1["b.txt"]
    assert (root / "root/app/c.txt").read_bytes() == v1["c.txt"]
    assert leftovers(root) == []
    assert "PARTIAL: /root/app/a.txt stay replaced" in deploy_mod._failure_suffix(ApplyReply.of(doc), "d4")
    record = json.loads((root / "var/lib/ctl/deploys/d4.json").read_text())
    assert record["partial"] and [f["dest"] for f in record["files"]] == ["/root/app/a.txt"]
    monkeypatch.setattr(agent_mod.os, "replace", real)
    # What the controller records for such an answer; then `ctl deploy --rollback` restores a.txt.
    files = [{"dest": "/root/app/a.txt", "sha256": doc["files"][0]["sha256"], "mode": "0644",
              "previous": sha_bytes(v1["a.txt"]), "action": "update", "previous_mode": "0644"}]
    reg.add_deploy(deploy_mod.DeployRecord("d4", "loc", "partial", 1e12, None, True, False, files, doc["error"]))
    with Pool(inv) as pool:
        res = deploy_mod.rollback(ct, pool.container(ct), reg)
    assert res.changed == 1
    assert (root / "root/app/a.txt").read_bytes() == v1["a.txt"]


def test_store_copies_keep_the_file_mode_and_the_store_is_private(box: tuple[Path, Path, Path]) -> None:
    src, root, _ = box
    inv = inventory(src, root, [("a.txt", "/root/app/secret.env")])
    doc = yaml.safe_load(inv.read_text())
    doc["payload"][0]["mode"] = "0600"
    inv.write_text(yaml.safe_dump(doc))
    run_deploy(inv, src / "state")
    obj = root / "var/lib/ctl/objects" / sha_bytes((src / "a.txt").read_bytes())
    assert stat.S_IMODE(obj.stat().st_mode) == 0o600
    assert stat.S_IMODE((root / "var/lib/ctl/objects").stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "var/lib/ctl").stat().st_mode) == 0o700
