"""`ctl runbook`: the format's errors (one line naming file, line and key), and whole runbooks against the
`local` transport with a real tmux server and the fake payload: a 4.6K run against a 12.8K baseline takes
the SLOW branch (stopped, exit 21), a healthy one reaches mark-good; dry runs change nothing."""

from __future__ import annotations

import json
import re
import shutil
import textwrap
from pathlib import Path

import pytest

from controller.core import runbook
from controller.errors import ExitCode, InputError
from controller.registry import Registry
from tests.conftest import LocalEnv  # the `env` fixture (local inventory, tmux, state dir) is in conftest


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "rb.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def error_of(tmp_path: Path, text: str, **given: str) -> str:
    p = write(tmp_path, text)
    with pytest.raises(InputError) as e:
        book = runbook.load(p, given)
        runbook.variables_for(book, given)
    return str(e.value).replace(str(p), "RB")


# --- the format ------------------------------------------------------------------------------------

GOOD = """\
name: relaunch
vars: {ct: loc, n: 5}
steps:
  - deploy: {containers: ["{{ ct }}"]}
  - launch: {ct: "{{ ct }}", run: null}
  - watch: {run: "{{ run }}", until_step: "{{ n }}", for: 30m}
    on:
      SLOW: [{stop: {run: "{{ run }}"}}, {fail: "{{ run }} is slow"}]
      CRASHED: [{fail: crashed}]
  - mark-good: {run: "{{ run }}"}
"""


def test_a_good_runbook_parses_with_on_as_a_key_and_its_branches(tmp_path: Path) -> None:
    book = runbook.load(write(tmp_path, GOOD))
    assert book.name == "relaunch" and [s.kind for s in book.steps] == ["deploy", "launch", "watch", "mark-good"]
    watch = book.steps[2]
    assert [k for k, _ in watch.on] == ["SLOW", "CRASHED"]  # `on:` is not YAML 1.1's True
    assert watch.on[0][1][1].path == "steps[2].on.SLOW[1]" and watch.line == 6
    assert book.count() == (7, 2)
    args = runbook.render_args(book, watch, {"ct": "loc", "n": 5, "run": "fresh3"})
    assert args == {"run": "fresh3", "until_step": 5, "for": "30m", "every": "5s", "slow_ratio": 0.8,
                    "stall_after": "10m", "checkpoints": None}


@pytest.mark.parametrize(("text", "message"), [
    ("name: x\nsteps:\n  - reboot: {ct: loc}\n",
     "RB:3: steps[0].reboot: unknown step kind (known: deploy, env-check, launch, watch, stop, mark-good, "
     "cache-restore, fail)"),
    ("name: x\nsteps:\n  - shell: rm -rf /\n",
     "RB:3: steps[0].shell: unknown step kind (known: deploy, env-check, launch, watch, stop, mark-good, "
     "cache-restore, fail)"),
    ("name: x\nsteps:\n  - launch: {ct: loc, command: 'bash -c x'}\n",
     "RB:3: steps[0].launch.command: unknown key (known: ct, run, allow_drift, force, allow_env_mismatch)"),
    ("name: x\nsteps:\n  - watch: {run: r1,\n      until_step: soon}\n",
     "RB:4: steps[0].watch.until_step: 'soon' is not a number"),
    ("name: x\nsteps:\n  - watch: {run: r1, for: 5 minutes}\n",
     "RB:3: steps[0].watch.for: '5 minutes' is not a duration such as 90s, 10m, 1h30m"),
    ("name: x\nsteps:\n  - watch: {run: r1}\n", "RB:3: steps[0].watch: give until_step or for (or both)"),
    ("name: x\nsteps:\n  - launch: {ct: 'ct200; reboot'}\n",
     "RB:3: steps[0].launch.ct: invalid container name 'ct200; reboot': use letters, digits, '.', '_' and '-' "
     "(at most 64, starting with a letter or digit)"),
    ("name: x\nsteps:\n  - launch: {run: fresh7}\n", "RB:3: steps[0].launch.ct: required key is missing"),
    ("name: x\nsteps:\n  - deploy: {containers: [loc], allow_dirty: yes}\n",
     "RB:3: steps[0].deploy.allow_dirty: must be true or false"),
    ("name: x\nsteps:\n  - deploy: {containers: [loc]}\n    launch: {ct: loc}\n",
     "RB:3: steps[0]: one step kind per step, found deploy, launch"),
    ("name: x\nsteps:\n  - stop: {run: r1}\n    on: {CRASHED: [{fail: x}]}\n",
     "RB:4: steps[0].on.CRASHED: unknown exit-code name (known: OK, FAILURE, USAGE, INVENTORY, INPUT, CONNECTION, "
     "HOST_KEY, NOT_RUNNING, DRIFT, BUSY, CLOBBER, ENV_MISMATCH, DISK, VERIFY, GPU_SETUP, RUN_FAILED, SLOW, STALLED, "
     "API)"),
    ("name: x\nsteps:\n  - watch: {run: r1, for: 1m}\n    on: {SLOWISH: [{fail: x}]}\n",
     "RB:4: steps[0].on.SLOWISH: unknown verdict or exit-code name (known: FINISHED, OK, WARMUP, NO_BASELINE, "
     "SLOW, STALLED, CRASHED, FAILURE, USAGE, INVENTORY, INPUT, CONNECTION, HOST_KEY, NOT_RUNNING, DRIFT, BUSY, "
     "CLOBBER, ENV_MISMATCH, DISK, VERIFY, GPU_SETUP, RUN_FAILED, API)"),
    ("name: x\nsteps:\n  - watch: {run: r1, for: 1m}\n    on: {SLOW: {fail: x}}\n",
     "RB:4: steps[0].on.SLOW: must be a non-empty list of steps"),
    ("name: x\nsteps:\n  - fail: {message: x}\n", "RB:3: steps[0].fail: give the message as a string: `- fail: TEXT`"),
    ("name: x\nsteps:\n  - watch: {run: '{{ rnu }}', for: 1m}\n",
     "RB:3: steps[0].watch.run: undefined variable 'rnu' (variables here: none)"),
    ("name: x\nvars: {ct: loc}\nsteps:\n  - mark-good: {run: '{{ run }}'}\n  - launch: {ct: '{{ ct }}'}\n",
     "RB:4: steps[0].mark-good.run: undefined variable 'run' (variables here: ct)"),
    ("name: x\nsteps:\n  - fail: '{{ oops'\n", "RB:3: steps[0].fail: template error: unexpected end of template, "
     "expected 'end of print statement'."),
    ("name: x\nsteps:\n  - deploy: {containers: [loc]}\n  - deploy: {containers: [loc], containers: [b]}\n",
     "RB:4: steps[1].deploy.containers: duplicate key"),
    ("name: x\nsteps: []\n", "RB:2: steps: must be a non-empty list of steps"),
    ("steps:\n  - fail: x\n", "RB:1: name: required key is missing"),
    ("name: x\nstep:\n  - fail: x\n", "RB:2: step: unknown key (known: name, description, vars, steps)"),
    ("name: x\nsteps:\n  - fail: x\n   bad indent: [\n", "RB:4: YAML syntax error: expected <block end>, but found "
     "'<block mapping start>'"),
    ("name: 'a b'\nsteps:\n  - fail: x\n", "RB:1: name: invalid runbook name 'a b': use letters, digits, '.', '_' "
     "and '-' (at most 64, starting with a letter or digit)"),
])
def test_bad_runbooks_are_one_line_naming_file_line_and_key(tmp_path: Path, text: str, message: str) -> None:
    assert error_of(tmp_path, text) == message


def test_variables_required_unknown_and_rendered_through_the_validators(tmp_path: Path) -> None:
    text = "name: x\nvars: {ct: null}\nsteps:\n  - launch:\n      ct: '{{ ct }}'\n"
    assert error_of(tmp_path, text) == "RB: vars.ct: required: give --var ct=VALUE"
    assert error_of(tmp_path, text, cts="a") == "RB: --var cts: not a variable of this runbook (declared: ct)"
    book = runbook.load(write(tmp_path, text), {"ct": "x;reboot"})
    with pytest.raises(InputError) as e:
        runbook.render_args(book, book.steps[0], runbook.variables_for(book, {"ct": "x;reboot"}))
    assert str(e.value).replace(str(book.path), "RB") == (
        "RB:5: steps[0].launch.ct: invalid container name 'x;reboot': use letters, digits, '.', '_' and '-' "
        "(at most 64, starting with a letter or digit) (rendered: 'x;reboot')")
    # StrictUndefined at run time too (an attribute no variable has), naming file, line, step and key.
    book = runbook.load(write(tmp_path, "name: x\nvars: {ct: loc}\nsteps:\n  - fail: '{{ ct.vmid }}'\n"))
    with pytest.raises(InputError) as e2:
        runbook.render_args(book, book.steps[0], {"ct": "loc"})
    assert str(e2.value).replace(str(book.path), "RB") == "RB:4: steps[0].fail: 'str object' has no attribute 'vmid'"
    # The sandbox: no way from a template to Python internals.
    book = runbook.load(write(tmp_path, "name: x\nvars: {ct: loc}\nsteps:\n  - fail: '{{ ct.__class__.__mro__ }}'\n"))
    with pytest.raises(InputError, match=r"steps\[0\]\.fail: access to attribute '__class__' of 'str' object is "
                                         "unsafe"):
        runbook.render_args(book, book.steps[0], {"ct": "loc"})
    with pytest.raises(InputError, match=r"--var 'ct': give NAME=VALUE"):
        runbook.parse_var_options(["ct"])


def test_branches_exit_codes_and_fail_in_process(tmp_path: Path) -> None:
    """The engine with stub actions: a handled failure continues, an unhandled one stops with its code."""
    book = runbook.load(write(tmp_path, """\
        name: x
        steps:
          - launch: {ct: loc}
            on: {BUSY: [{mark-good: {run: other}}]}
          - watch: {run: "{{ run }}", for: 1m}
            on:
              SLOW: [{stop: {run: "{{ run }}"}}, {fail: "{{ run }} slow"}]
          - mark-good: {run: "{{ run }}"}
        """))
    calls: list[tuple[str, str]] = []

    def make(kind: str, state: str | None = None, code: int = 0) -> runbook.Action:
        def act(args: object, dry: bool) -> runbook.Done:
            calls.append((kind, str(dict(args)).replace(" ", "")))  # type: ignore[call-overload]
            return runbook.Done(kind, state=state, exit_code=code, sets={"run": "fresh9"} if kind == "launch" else {})
        return act

    from controller.errors import BusyError

    def busy(args: object, dry: bool) -> runbook.Done:
        raise BusyError("tmux session taken")

    acts = {"launch": busy, "watch": make("watch", "SLOW", 21), "stop": make("stop"), "mark-good": make("mark-good")}
    # launch fails BUSY -> branch handles it -> watch cannot render {{ run }}: launch never set it.
    res = runbook.execute(book, {}, acts)
    assert not res.ok and res.exit_code == ExitCode.INPUT and res.failed_at == "steps[1]"
    assert "undefined variable 'run'" in (res.message or "")
    acts["launch"] = make("launch")
    res = runbook.execute(book, {}, acts)
    assert not res.ok and res.exit_code == ExitCode.SLOW and res.message == "fresh9 slow"
    assert res.failed_at == "steps[1].on.SLOW[1]"
    assert [(s.path, s.outcome, s.exit_code) for s in res.steps] == [
        ("steps[0]", "ok", 0), ("steps[1]", "SLOW", 21), ("steps[1].on.SLOW[0]", "ok", 0),
        ("steps[1].on.SLOW[1]", "FAILED", 21)]
    acts["watch"] = make("watch", "OK", 0)
    res = runbook.execute(book, {}, acts)
    assert res.ok and [s.kind for s in res.steps] == ["launch", "watch", "mark-good"]
    acts["watch"] = make("watch", "STALLED", 22)  # no branch: stops with the step's code
    res = runbook.execute(book, {}, acts)
    assert (res.ok, res.exit_code, res.failed_at) == (False, 22, "steps[1]")


# --- end to end, `local` transport + real tmux -------------------------------------------------------

RELAUNCH = """\
name: relaunch-local
vars: {ct: loc, name: null, until: 30}
steps:
  - deploy: {containers: ["{{ ct }}"], allow_dirty: true}
  - launch: {ct: "{{ ct }}", run: "{{ name }}"}
  - watch: {run: "{{ run }}", until_step: "{{ until }}", for: 2m, every: 0.3s}
    on:
      SLOW:
        - stop: {run: "{{ run }}", grace: 2}
        - fail: throughput below baseline
      CRASHED: [{fail: run crashed}]
  - mark-good: {run: "{{ run }}"}
  - stop: {run: "{{ run }}", grace: 2}
"""


def _args(env: LocalEnv, run: str, args: str) -> None:
    (env.root / "root" / "args").mkdir(parents=True, exist_ok=True)
    (env.root / "root" / "args" / run).write_text(args)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_slow_run_takes_the_slow_branch_and_a_healthy_one_reaches_mark_good(env: LocalEnv) -> None:
    rb = env.dir / "relaunch.yaml"
    rb.write_text(RELAUNCH)
    env.launch("fresh1", "--tok-s 12800 --steps 12 --interval 0.02 --jitter 0", follow=True)
    env.ok("mark-good", "fresh1")

    _args(env, "fresh2", "--tok-s 4600 --steps 600 --interval 0.05 --jitter 0")
    r = env.ctl("runbook", "run", str(rb), "--var", "name=fresh2", timeout=120)
    assert r.returncode == ExitCode.SLOW, r.stdout + r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith("runbook relaunch-local (") and "sha256 " in out[0]
    lines = {ln.split()[0]: ln for ln in out[1:]}
    assert " ok " in lines["steps[0]"] and "deploy loc" in lines["steps[0]"]
    assert " ok " in lines["steps[1]"] and "fresh2: tmux session" in lines["steps[1]"]
    assert " SLOW " in lines["steps[2]"] and "0.36x the baseline 12.8K (loc/fresh1)" in lines["steps[2]"]
    assert lines["steps[2]"].endswith("-> on SLOW")
    assert "stop fresh2" in lines["steps[2].on.SLOW[0]"] and "stopped" in lines["steps[2].on.SLOW[0]"]
    assert " FAILED " in lines["steps[2].on.SLOW[1]"] and "throughput below baseline" in lines["steps[2].on.SLOW[1]"]
    assert not any(k.startswith("steps[3]") for k in lines), "mark-good must not run"
    assert r.stderr == ("ctl: error: runbook relaunch-local failed at steps[2].on.SLOW[1] (exit 21): "
                        "throughput below baseline\n")
    for ln in out[1:]:  # one line per step: path, label, outcome, seconds, detail
        assert re.match(r"^ *steps\S+ +[a-z-]+( \S+)? +(ok|SLOW|FAILED) +\d+\.\d\ds  \S", ln), ln
    reg = Registry(Path(env.env["CTL_STATE_DIR"]) / "registry.sqlite3")
    slow = reg.find_run("loc/fresh2")
    assert slow.state == "stopped" and not slow.good

    _args(env, "fresh3", "--tok-s 12800 --steps 600 --interval 0.03 --jitter 0")
    r = env.ctl("--json", "runbook", "run", str(rb), "--var", "name=fresh3", "--var", "until=15", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and [s["kind"] for s in doc["steps"]] == ["deploy", "launch", "watch", "mark-good", "stop"]
    assert doc["steps"][2]["outcome"] == "OK" and "1.00x the baseline" in doc["steps"][2]["detail"]
    assert reg.find_run("loc/fresh3").good

    hist = json.loads(env.ok("--json", "runbook", "history"))
    import hashlib

    sha = hashlib.sha256(rb.read_bytes()).hexdigest()
    assert [(h["name"], h["outcome"], h["exit_code"], h["sha256"]) for h in hist] == [
        ("relaunch-local", "ok", 0, sha), ("relaunch-local", "failed", 21, sha)]
    assert hist[1]["message"] == "throughput below baseline" and hist[1]["vars"]["name"] == "fresh2"
    assert [s["path"] for s in hist[1]["steps"]][-1] == "steps[2].on.SLOW[1]"
    text = env.ok("runbook", "history")
    assert "failed" in text and "steps[2].on.SLOW[1]: throughput below baseline" in text


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_dry_run_prints_the_plan_and_changes_nothing(env: LocalEnv) -> None:
    rb = env.dir / "relaunch.yaml"
    rb.write_text(RELAUNCH.replace('run: "{{ name }}"', "run: null"))
    (env.dir / "emit_metrics.py").write_text((env.dir / "emit_metrics.py").read_text() + "# changed\n")
    r = env.ctl("runbook", "run", str(rb), "--dry-run", "--var", "name=unused")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dry run" in r.stdout.splitlines()[0]
    assert "would change 1 of 2 files" in r.stdout and "update  /root/emit_metrics.py" in r.stdout
    assert "would launch fresh1 on loc" in r.stdout and "would watch fresh1 until step 30 or 2m" in r.stdout
    assert "would fail (exit 1): throughput below baseline" in r.stdout  # every branch is shown
    assert r.stdout.rstrip().endswith("plan ok (8 steps)")
    reg = Registry(Path(env.env["CTL_STATE_DIR"]) / "registry.sqlite3")
    assert reg.runs() == [] and reg.runbook_runs() == []
    assert "# changed" not in (env.root / "root" / "emit_metrics.py").read_text()
    # check: ok, with what it needs; and a bad file is exit 4 with one line.
    assert "ok: runbook relaunch-local, 8 step(s), 2 branch(es); needs --var name=..." in env.ok(
        "runbook", "check", str(rb))
    rb.write_text(RELAUNCH.replace("until_step:", "until_stp:"))
    r = env.ctl("runbook", "check", str(rb))
    assert r.returncode == ExitCode.INPUT and r.stdout == ""
    assert r.stderr == (f"ctl: error: {rb}:6: steps[2].watch.until_stp: unknown key (known: run, until_step, for, "
                        "every, slow_ratio, stall_after, checkpoints)\n")


def test_runbooks_in_the_repo_check(tmp_path: Path) -> None:
    for p in sorted((Path(__file__).resolve().parents[1] / "runbooks").glob("*.yaml")):
        book = runbook.load(p)
        assert book.steps, p
