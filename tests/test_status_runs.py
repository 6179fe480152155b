"""`ctl status` takes a run as `ctl tail` does (NAME, CT/NAME, #ID), beside containers and groups; a run that has
ended shows no ETA; an empty ratio to the baseline says why."""

from __future__ import annotations

import json

from tests.conftest import LocalEnv


def test_status_of_a_run_by_name_and_what_an_ended_run_shows(env: LocalEnv) -> None:
    env.launch("fresh1", "--tok-s 12800 --steps 6 --interval 0.01 --jitter 0", follow=True)
    env.launch("fresh2", "--tok-s 12800 --steps 6 --interval 0.01 --jitter 0", follow=True)
    for ref in ("fresh1", "loc/fresh1", "#1"):
        _code, got = env.status(ref)
        assert [(s["ct"], s["run"]) for s in got] == [("loc", "fresh1")], (ref, got)
    _code, both = env.status("fresh2", "fresh1")
    assert [s["run"] for s in both] == ["fresh2", "fresh1"]
    (ended,) = both[1:]
    assert ended["state"] == "finished" and ended["eta_s"] is None  # its last metric line still had an ETA
    assert ended["ratio"] is None and ended["no_ratio_why"] == "no baseline marked (ctl mark-good RUN)"
    header, row = [line for line in env.ok("status", "fresh1").splitlines() if "ETA" in line or "fresh1" in line]
    at = header.index("ETA")
    assert row[at:at + 3].strip() == "-", (header, row)  # the ETA column of an ended run
    env.ok("mark-good", "fresh1")
    _code, judged = env.status("fresh2")
    assert judged[0]["ratio"] is not None and judged[0]["no_ratio_why"] is None


def test_a_name_that_is_neither_container_nor_run_is_one_line(env: LocalEnv) -> None:
    r = env.ctl("status", "fresh9")
    assert r.returncode == 4
    assert r.stderr.strip() == (f"ctl: error: 'fresh9' is neither a container, group or job of {env.inventory} nor "
                                "a run of the registry (`ctl runs` lists them)")
    assert json.loads(env.ok("--json", "status")) == []  # nothing named: the containers' latest runs (none yet)
