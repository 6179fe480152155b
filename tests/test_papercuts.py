"""Wrong turns a new user takes, each answered with one clear line (issue: papercuts), on the `local` target
with real tmux and the fake payload."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from controller.errors import ExitCode
from controller.registry import Registry
from tests.conftest import LocalEnv, local_env

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def test_mark_good_refuses_a_run_stopped_for_being_slow_unless_forced(env: LocalEnv) -> None:
    env.launch("fresh1", "--tok-s 12800 --steps 6 --interval 0.01 --jitter 0", follow=True)
    env.launch("fresh2", "--tok-s 4600 --steps 100000 --interval 0.05 --jitter 0")
    env.ok("stop", "fresh2", "--grace", "2")
    r = env.ctl("mark-good", "fresh2")
    assert r.returncode == ExitCode.INPUT, r.stdout + r.stderr
    assert "fresh2 cannot be the baseline: it is stopped" in r.stderr and "--force" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not json.loads(env.ok("--json", "show", "fresh2"))["good"]
    forced = json.loads(env.ok("--json", "mark-good", "fresh2", "--force"))
    assert forced["good"] and forced["forced"]
    shown = json.loads(env.ok("--json", "show", "fresh2"))
    assert shown["good"] and "marked good with --force: it is stopped" in shown["note"]
    # A run that finished cleanly needs no force.
    done = json.loads(env.ok("--json", "mark-good", "fresh1"))
    assert done == {"run": "loc/fresh1", "good": True, "forced": False, "why": "finished with exit 0"}


def test_mark_good_takes_a_live_run_judged_ok(env: LocalEnv) -> None:
    env.launch("fresh1", "--tok-s 12800 --steps 100000 --interval 0.02 --jitter 0")
    try:
        for _ in range(50):  # past the warm-up window, the run is judged (no baseline: OK on its own)
            r = env.ctl("--json", "mark-good", "fresh1")
            if r.returncode == 0:
                break
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["why"].startswith("live and ")
    finally:
        env.ctl("stop", "fresh1", "--grace", "1")


def test_env_lock_without_a_venv_names_the_inventory_key(env: LocalEnv) -> None:
    env.env.pop("VIRTUAL_ENV", None)
    r = env.ctl("env", "lock", "loc", "-o", str(env.dir / "loc.lock"))
    assert r.returncode == ExitCode.INPUT, r.stdout + r.stderr
    assert f"set `vars.venv` for loc in {env.inventory}" in r.stderr
    assert "--venv" not in r.stderr and not (env.dir / "loc.lock").exists()


def test_runs_of_an_unknown_container_is_refused_like_status(env: LocalEnv) -> None:
    r = env.ctl("--json", "runs", "ct999")
    s = env.ctl("--json", "status", "ct999")
    assert r.returncode == s.returncode == ExitCode.INPUT
    assert "unknown container 'ct999'" in r.stderr and r.stdout == ""


def test_attach_to_an_ended_run_says_so_and_points_to_tail(env: LocalEnv) -> None:
    env.launch("fresh1", "--tok-s 12800 --steps 3 --interval 0", follow=True)
    r = env.ctl("attach", "fresh1")
    assert r.returncode == ExitCode.INPUT
    assert r.stderr.strip() == ("ctl: error: run loc/fresh1 has ended (finished, exit status 0): there is no session "
                                "to attach to; `ctl tail loc/fresh1` shows its log")
    assert "no sessions" not in r.stderr + r.stdout and "Pseudo-terminal" not in r.stderr


def test_attach_without_a_terminal_is_refused(env: LocalEnv) -> None:
    env.launch("fresh1", "--tok-s 12800 --steps 100000 --interval 0.05")
    try:
        r = env.ctl("attach", "fresh1")
        assert r.returncode == ExitCode.INPUT and "needs a terminal" in r.stderr and "ctl tail" in r.stderr
    finally:
        env.ctl("stop", "fresh1", "--grace", "1")


def test_deploy_without_names_needs_all_when_the_inventory_has_several(env: LocalEnv) -> None:
    (env.dir / "root2").mkdir()
    doc = env.inventory.read_text().replace("containers:\n", f"containers:\n  loc2: {{transport: local, root: "
                                                                f"{env.dir / 'root2'}}}\n", 1)
    env.inventory.write_text(doc)
    r = env.ctl("deploy", "--allow-dirty")
    assert r.returncode == ExitCode.INPUT and "has 2: loc2, loc), or pass --all" in r.stderr, r.stderr
    out = env.ok("deploy", "--all", "--allow-dirty")
    assert out.startswith("deploying to all 2 containers") and "loc2" in out


def test_two_checkouts_local_targets_keep_their_own_runs(env: LocalEnv, tmp_path: Path) -> None:
    """Two clones of a project, one user: one registry (state dir) and one tmux server, a `loc` target each
    under its own root. Each sees, tails and stops its own runs only; a run recorded before roots were part of
    a target's identity (bare `loc`) stays readable from both."""
    (tmp_path / "clone2").mkdir()
    other = local_env(tmp_path / "clone2", tmp_path / "state", tmp_path / "tmux")
    try:
        env.launch("fresh1", "--tok-s 1100 --steps 3 --interval 0 --jitter 0", follow=True)
        env.launch("fresh2", "--tok-s 1100 --steps 3 --interval 0 --jitter 0", follow=True)
        # The same name in the second clone is a run of its own, not "already exists".
        other.launch("fresh1", "--tok-s 2200 --steps 3 --interval 0 --jitter 0", follow=True)
        other.launch("fresh3", "--tok-s 2200 --steps 3 --interval 0 --jitter 0", follow=True)
        old = Registry(tmp_path / "state" / "registry.sqlite3").claim_run("old1", "loc")  # as main recorded it

        def runs(e: LocalEnv) -> dict[str, str]:
            return {r["name"]: r["key"] for r in json.loads(e.ok("--json", "runs"))}

        first, second = f"loc@{env.root.resolve()}", f"loc@{other.root.resolve()}"
        assert runs(env) == {"fresh1": first, "fresh2": first, "old1": "loc"}
        assert runs(other) == {"fresh1": second, "fresh3": second, "old1": "loc"}
        assert json.loads(other.ok("--json", "show", "loc/fresh1"))["key"] == second
        assert json.loads(other.ok("--json", "inventory"))["keys"] == {"loc": second}
        assert [(d["run"], d["key"]) for d in other.status("loc/fresh3")[1]] == [("fresh3", second)]
        # Tail from the second clone reads its own log (its own rate), not the first clone's.
        assert "2.2Ktok/s" in other.ok("tail", "fresh1") and "1.1Ktok/s" in env.ok("tail", "fresh1")
        assert "1.1Ktok/s" not in other.ok("tail", "fresh1")
        for verb in (["tail", "fresh2"], ["show", "fresh2"], ["status", "fresh2"], ["stop", "fresh2"],
                     ["tail", "loc/fresh2"]):
            r = other.ctl(*verb)
            assert r.returncode == ExitCode.INPUT, (verb, r.stdout, r.stderr)
            ref = verb[1]
            assert r.stderr.strip() == (f"ctl: error: run {ref!r} is another checkout's: it ran in loc at "
                                        f"{env.root.resolve()}, and this inventory's loc is {other.root.resolve()}"
                                        ), verb
        assert json.loads(env.ok("--json", "show", "fresh2"))["state"] == "finished"  # `stop` touched nothing
        for e in (env, other):
            assert json.loads(e.ok("--json", "show", "old1"))["id"] == old.id
    finally:
        other.end()
