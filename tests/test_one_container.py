"""One rule for every verb that takes containers, as `ctl deploy` had it: with none named, the inventory's only
container; with several in the inventory, one clear line asking for the name (a one-container verb), never
typer's `Missing argument`."""

from __future__ import annotations

import yaml

from tests.conftest import LocalEnv


def test_launch_follow_and_the_env_verbs_act_on_the_only_container(env: LocalEnv) -> None:
    (env.root / "root" / "args").mkdir(parents=True, exist_ok=True)
    (env.root / "root" / "args" / "only1").write_text("--tok-s 12800 --steps 3 --interval 0.01 --jitter 0")
    launched = env.ctl("launch", "--run", "only1", "-f")
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert "launched only1 on loc:" in launched.stdout, launched.stdout
    assert "run only1: finished, exit status 0" in launched.stdout
    check = env.ctl("env", "check")  # reaches loc; it has no lock, and says so in its own words
    assert check.returncode == 4 and "loc: no lock configured" in check.stderr, check.stderr


def test_several_containers_need_a_name(env: LocalEnv) -> None:
    doc = yaml.safe_load(env.inventory.read_text())
    doc["containers"]["other"] = dict(doc["containers"]["loc"])
    env.inventory.write_text(yaml.safe_dump(doc))
    for argv in (["launch", "--run", "x1"], ["env", "check"], ["cache", "status"]):
        r = env.ctl(*argv)
        assert r.returncode == 4, (argv, r.stdout, r.stderr)
        assert r.stderr.strip() == f"ctl: error: name the container ({env.inventory} has 2: loc, other)", r.stderr
