"""Runbooks: a small, explicit YAML format for the operator's chains (deploy, check, launch, watch, react).

    name: relaunch-dflash
    vars: {ct: ct200}                         # null = required: `--var ct=...`
    steps:
      - deploy: {containers: ["{{ ct }}"]}
      - launch: {ct: "{{ ct }}"}              # sets {{ run }} to the run's name
      - watch: {run: "{{ run }}", until_step: 50, for: 30m}
        on:                                   # keyed by verdict state or exit-code name
          SLOW: [{stop: {run: "{{ run }}"}}, {fail: "throughput below baseline"}]
      - mark-good: {run: "{{ run }}"}

There is no shell step and no free-form command: every step is one of KINDS, every key is typed and
checked by the same validators as the CLI (names, durations, globs), before and after rendering.
Values are Jinja2 templates rendered in a sandbox with StrictUndefined from `vars:`, `--var` and what
earlier steps set; an unknown variable is found by `check` already and names file, line, step and variable.

Semantics: steps run in order; a step that fails (a CtlError, or a watch verdict with a non-zero exit
code) stops the runbook with its exit code, unless one of its `on:` keys matches (the verdict state
first, then the exit-code name): then that branch runs instead and, if it does not fail, the runbook goes
on with the next step. `fail: MESSAGE` stops the runbook with the exit code of the step whose branch it
is in (1 outside a failing branch). This module parses, checks and sequences; the step actions (bound to
the domain functions the CLI commands call) are supplied by the caller (controller.cli.runbook).
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from controller.errors import CtlError, ExitCode, InputError
from controller.names import check_name
from controller.yamlpos import DuplicateKey, dotted, line_index

# --- the step kinds ------------------------------------------------------------------------------

VERDICTS = ("FINISHED", "OK", "WARMUP", "NO_BASELINE", "SLOW", "STALLED", "CRASHED")  # metrics.RunState names
EXIT_NAMES = tuple(c.name for c in ExitCode)


@dataclass(frozen=True)
class Param:
    key: str
    type: str  # str | ct | cts | run | runref | name | int | float | bool | duration | ratio | glob
    required: bool = False
    default: Any = None


@dataclass(frozen=True)
class Kind:
    name: str
    params: tuple[Param, ...] = ()
    scalar: bool = False  # `fail: MESSAGE`: the value is the one param, not a mapping
    verdicts: bool = False  # `on:` may name verdict states as well as exit codes
    sets: tuple[str, ...] = ()  # variables the step defines for later steps

    def param(self, key: str) -> Param | None:
        return next((p for p in self.params if p.key == key), None)


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("deploy", (Param("containers", "cts", required=True), Param("allow_dirty", "bool", default=False))),
    Kind("env-check", (Param("ct", "ct", required=True), Param("lock", "str"))),
    Kind("launch", (Param("ct", "ct", required=True), Param("run", "run"), Param("allow_drift", "bool", default=False),
                    Param("force", "bool", default=False), Param("allow_env_mismatch", "bool", default=False)),
         sets=("run",)),
    Kind("watch", (Param("run", "runref", required=True), Param("until_step", "int"), Param("for", "duration"),
                   Param("every", "duration", default="5s"), Param("slow_ratio", "ratio", default=0.8),
                   Param("stall_after", "duration", default="10m"), Param("checkpoints", "glob")), verdicts=True),
    Kind("stop", (Param("run", "runref", required=True), Param("grace", "float", default=30.0))),
    Kind("mark-good", (Param("run", "runref", required=True),)),
    Kind("cache-restore", (Param("ct", "ct", required=True), Param("name", "name", required=True),
                           Param("force", "bool", default=False))),
    Kind("fail", (Param("message", "str", required=True),), scalar=True),
)}

_VAR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_TEMPLATE = re.compile(r"\{\{|\{%|\{#")
_RUNREF = re.compile(r"^#\d{1,18}$")


# --- the parsed runbook --------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    kind: str
    args: Mapping[str, Any]  # as written (templates unrendered)
    on: tuple[tuple[str, tuple[Step, ...]], ...]
    path: str  # steps[3] | steps[3].on.SLOW[0]
    line: int | None
    arg_lines: Mapping[str, int | None] = field(default_factory=dict)

    @property
    def spec(self) -> Kind:
        return KINDS[self.kind]


@dataclass(frozen=True)
class Runbook:
    name: str
    path: Path
    sha256: str
    description: str | None
    vars: Mapping[str, Any]  # declared defaults; None = required
    steps: tuple[Step, ...]

    def count(self) -> tuple[int, int]:
        """(steps, branches), branches' steps included."""
        def walk(steps: tuple[Step, ...]) -> tuple[int, int]:
            n, b = len(steps), 0
            for s in steps:
                for _key, sub in s.on:
                    sn, sb = walk(sub)
                    n, b = n + sn, b + 1 + sb
            return n, b
        return walk(self.steps)


class RunbookError(InputError):
    """A runbook is invalid, or a value is after rendering: one line naming file, line and key (exit 4)."""

    def __init__(self, path: str, message: str, *, line: int | None = None, key: str | None = None) -> None:
        where = path if line is None else f"{path}:{line}"
        super().__init__(f"{where}: {message}" if key is None else f"{where}: {key}: {message}")
        self.path, self.line, self.key = path, line, key


# --- loading and checking ------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """YAML 1.2 booleans only: `on:` is a key, not True (PyYAML's 1.1 resolver reads on/off/yes/no as bools)."""


_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def load(path: str | Path, extra_vars: Mapping[str, str] | None = None) -> Runbook:
    """Read and check a runbook: structure, kinds, keys, types, literal values, template syntax and every
    variable a template uses (declared in `vars:` or set by an earlier step). Raises RunbookError."""
    p = Path(path)
    name = str(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise RunbookError(name, "runbook file not found") from None
    except OSError as e:
        raise RunbookError(name, f"cannot read: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
        node = yaml.compose(text, Loader=_Loader)
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except UnicodeDecodeError:
        raise RunbookError(name, "not UTF-8 text") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise RunbookError(name, f"YAML syntax error: {e.problem or e.context}",
                           line=mark.line + 1 if mark else None) from None
    except yaml.YAMLError as e:
        raise RunbookError(name, f"YAML error: {e}") from None
    if node is None or not isinstance(data, dict):
        raise RunbookError(name, "expected a mapping with 'name' and 'steps'", line=1)
    try:
        lines = line_index(node, unique=True)
    except DuplicateKey as e:
        raise RunbookError(name, "duplicate key", line=e.line, key=dotted(e.path)) from None
    return _Parser(name, lines).runbook(p, raw, data, extra_vars or {})


class _Parser:
    def __init__(self, file: str, lines: dict[tuple[Any, ...], int]) -> None:
        self.file = file
        self.lines = lines

    def error(self, loc: tuple[Any, ...], message: str) -> RunbookError:
        line = None
        for n in range(len(loc), -1, -1):
            if loc[:n] in self.lines:
                line = self.lines[loc[:n]]
                break
        return RunbookError(self.file, message, line=line, key=dotted(loc) or None)

    def runbook(self, p: Path, raw: bytes, data: dict[Any, Any], extra_vars: Mapping[str, str]) -> Runbook:
        for key in data:
            if key not in ("name", "description", "vars", "steps"):
                raise self.error((key,), "unknown key (known: name, description, vars, steps)")
        for key in ("name", "steps"):
            if key not in data:
                raise self.error((key,), "required key is missing")
        book_name = data["name"]
        if not isinstance(book_name, str):
            raise self.error(("name",), "must be a string")
        try:
            check_name(book_name, "runbook name")
        except InputError as e:
            raise self.error(("name",), e.message) from None
        desc = data.get("description")
        if desc is not None and not isinstance(desc, str):
            raise self.error(("description",), "must be a string")
        declared = data.get("vars") or {}
        if not isinstance(declared, dict):
            raise self.error(("vars",), "must be a mapping of variable names to values")
        for k, v in declared.items():
            if not isinstance(k, str) or not _VAR.fullmatch(k):
                raise self.error(("vars", k), "variable names are letters, digits and '_', not starting with a digit")
            if not (v is None or isinstance(v, str | int | float | bool)):
                raise self.error(("vars", k), "a variable is a string, number, boolean or null (null: required)")
        for k in extra_vars:
            if k not in declared:
                names = ", ".join(declared) or "none"
                raise RunbookError(self.file, f"--var {k}: not a variable of this runbook (declared: {names})")
        steps = data["steps"]
        if not isinstance(steps, list) or not steps:
            raise self.error(("steps",), "must be a non-empty list of steps")
        known = set(declared)
        parsed = self.steps(steps, ("steps",), known)
        return Runbook(book_name, p.resolve(), hashlib.sha256(raw).hexdigest(), desc, dict(declared), parsed)

    def steps(self, items: list[Any], loc: tuple[Any, ...], known: set[str]) -> tuple[Step, ...]:
        out = []
        for i, item in enumerate(items):
            step = self.step(item, (*loc, i), known)
            known |= set(step.spec.sets)
            out.append(step)
        return tuple(out)

    def step(self, item: Any, loc: tuple[Any, ...], known: set[str]) -> Step:
        if not isinstance(item, dict) or not item:
            raise self.error(loc, "a step is a mapping such as `- deploy: {containers: [ct200]}`")
        kinds = [k for k in item if k != "on"]
        for k in kinds:
            if k not in KINDS:
                raise self.error((*loc, k), f"unknown step kind (known: {', '.join(KINDS)})")
        if len(kinds) != 1:
            raise self.error(loc, "one step kind per step" + (f", found {', '.join(map(str, kinds))}" if kinds
                                                               else ", found only 'on'"))
        kind = KINDS[kinds[0]]
        kloc = (*loc, kind.name)
        value = item[kind.name]
        if kind.scalar:
            if isinstance(value, dict | list) or value is None:
                raise self.error(kloc, f"give the {kind.params[0].key} as a string: `- {kind.name}: TEXT`")
            args: dict[str, Any] = {kind.params[0].key: value}
            arg_locs = {kind.params[0].key: kloc}
        else:
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise self.error(kloc, f"must be a mapping of {', '.join(p.key for p in kind.params)}")
            args = dict(value)
            arg_locs = {k: (*kloc, k) for k in args}
        for key, v in args.items():
            param = kind.param(key)
            if param is None:
                raise self.error(arg_locs[key], f"unknown key (known: {', '.join(p.key for p in kind.params)})")
            self.check_value(param, v, arg_locs[key], known)
        for param in kind.params:
            if param.required and args.get(param.key) is None:
                raise self.error((*kloc, param.key), "required key is missing")
        if kind.name == "watch" and args.get("until_step") is None and args.get("for") is None:
            raise self.error(kloc, "give until_step or for (or both)")
        branches: list[tuple[str, tuple[Step, ...]]] = []
        on = item.get("on")
        if "on" in item:
            if not isinstance(on, dict) or not on:
                raise self.error((*loc, "on"), "must map a verdict or exit-code name to a list of steps")
            allowed = (VERDICTS if kind.verdicts else ()) + EXIT_NAMES
            for key, sub in on.items():
                if key not in allowed:
                    what = "verdict or exit-code name" if kind.verdicts else "exit-code name"
                    raise self.error((*loc, "on", key), f"unknown {what} (known: {', '.join(dict.fromkeys(allowed))})")
                if not isinstance(sub, list) or not sub:
                    raise self.error((*loc, "on", key), "must be a non-empty list of steps")
                branches.append((key, self.steps(sub, (*loc, "on", key), known | set(kind.sets))))
        return Step(kind.name, args, tuple(branches), dotted(loc), self.lines.get(loc),
                    {k: self.lines.get(arg_locs[k]) for k in args})

    def check_value(self, param: Param, value: Any, loc: tuple[Any, ...], known: set[str]) -> None:
        """Literal values through the validators now; templates: syntax and variables now, values when run."""
        if param.type == "cts" and isinstance(value, list):
            if not value:
                raise self.error(loc, "must name at least one container or group")
            for i, v in enumerate(value):
                self.check_value(Param(param.key, "ct", required=True), v, (*loc, i), known)
            return
        if _is_template(value):
            try:
                used = template_variables(value)
            except ValueError as e:
                raise self.error(loc, str(e)) from None
            for var in sorted(used - known):
                raise self.error(loc, f"undefined variable {var!r} ({_known_text(known)})")
            return
        try:
            coerce(param, value)
        except ValueError as e:
            raise self.error(loc, str(e)) from None


def _known_text(known: set[str]) -> str:
    return "variables here: " + (", ".join(sorted(known)) or "none")


# --- templates -----------------------------------------------------------------------------------


def _env() -> Any:
    from jinja2 import StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(undefined=StrictUndefined, autoescape=False, keep_trailing_newline=True)


def template_variables(text: str) -> set[str]:
    """The variables a template uses; ValueError for a syntax error."""
    from jinja2 import TemplateSyntaxError, meta

    try:
        return set(meta.find_undeclared_variables(_env().parse(text)))
    except TemplateSyntaxError as e:
        raise ValueError(f"template error: {e.message}") from None


def render_value(value: Any, variables: Mapping[str, Any]) -> Any:
    """Render a string (or each string of a list) with StrictUndefined; other values pass through."""
    from jinja2 import TemplateError

    if isinstance(value, list):
        return [render_value(v, variables) for v in value]
    if not (isinstance(value, str) and _TEMPLATE.search(value)):
        return value
    try:
        return _env().from_string(value).render(**variables)
    except TemplateError as e:  # UndefinedError (StrictUndefined), SecurityError (the sandbox)
        text = str(e.message or type(e).__name__)
        m = re.fullmatch(r"'(\w+)' is undefined", text)
        raise KeyError(f"undefined variable {m.group(1)!r}" if m else text) from None


# --- values --------------------------------------------------------------------------------------


def _is_template(v: Any) -> bool:
    return isinstance(v, str) and bool(_TEMPLATE.search(v))


def coerce(param: Param, value: Any) -> Any:
    """A value of `param`'s type, through the CLI's validators; ValueError with the reason otherwise.
    Rendered templates arrive as strings: "50" is an int, "true" a bool, "" or "null" is null."""
    t = param.type
    if isinstance(value, str) and value.strip() in ("", "null", "None") and t not in ("str",):
        value = None
    if value is None:
        if param.required:
            raise ValueError("must not be null")
        return param.default
    try:
        if t == "str":
            if not isinstance(value, str | int | float) or isinstance(value, bool) or not str(value).strip():
                raise ValueError("must be a non-empty string")
            text = str(value)
            if len(text) > 500 or any(ord(c) < 32 and c not in "\t" for c in text):
                raise ValueError("must be one line of at most 500 characters")
            return text
        if t == "cts":
            items = value if isinstance(value, list) else [value]
            if not items:
                raise ValueError("must name at least one container or group")
            return [coerce(Param(param.key, "ct", required=True), v) for v in items]
        if t in ("ct", "run", "name"):
            if not isinstance(value, str):
                raise ValueError("must be a string")
            return check_name(value, {"ct": "container name", "run": "run name", "name": "cache name"}[t])
        if t == "runref":
            if not isinstance(value, str):
                raise ValueError("must be a string: NAME, CT/NAME or #ID")
            if not _RUNREF.fullmatch(value):
                for part in value.split("/", 1):
                    check_name(part, "run")
            return value
        if t == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            raise ValueError("must be true or false")
        if t in ("int", "float", "ratio"):
            if isinstance(value, bool):
                raise ValueError("must be a number")
            if isinstance(value, str):
                try:
                    value = int(value) if t == "int" else float(value)
                except ValueError:
                    raise ValueError(f"{value!r} is not a number") from None
            if t == "int":
                if not isinstance(value, int) or value < 0:
                    raise ValueError("must be a whole number >= 0")
                return value
            if not isinstance(value, int | float) or value != value or value < 0:
                raise ValueError("must be a number >= 0")
            if t == "ratio" and not 0.0 < value <= 1.0:
                raise ValueError(f"must be in (0, 1], got {value}")
            return float(value)
        if t == "duration":
            from controller.core.metrics import parse_duration

            text = str(value) if isinstance(value, str | int | float) and not isinstance(value, bool) else ""
            seconds = parse_duration(text) if text else None
            if seconds is None or seconds <= 0:
                raise ValueError(f"{value!r} is not a duration such as 90s, 10m, 1h30m")
            return text
        if t == "glob":
            from controller.settings import checkpoint_glob

            if not isinstance(value, str):
                raise ValueError("must be a string")
            return checkpoint_glob(value)
    except InputError as e:
        raise ValueError(e.message) from None
    raise AssertionError(f"unknown parameter type {t}")  # pragma: no cover


def variables_for(book: Runbook, given: Mapping[str, str]) -> dict[str, Any]:
    """`vars:` defaults overlaid with --var; a required (null) variable must be given."""
    out = dict(book.vars)
    for k, v in given.items():
        if k not in out:
            raise RunbookError(str(book.path), f"--var {k}: not a variable of this runbook "
                                               f"(declared: {', '.join(out) or 'none'})")
        out[k] = v
    missing = [k for k, v in out.items() if v is None]
    if missing:
        raise RunbookError(str(book.path), f"vars.{missing[0]}: required: give --var {missing[0]}=VALUE")
    return out


def parse_var_options(items: list[str] | None) -> dict[str, str]:
    """`--var k=v` options -> {k: v}; one clear error for anything else."""
    out: dict[str, str] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not _VAR.fullmatch(k):
            raise InputError(f"--var {item!r}: give NAME=VALUE (NAME: letters, digits, '_')")
        if k in out:
            raise InputError(f"--var {k} given twice")
        out[k] = v
    return out


# --- running -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Done:
    """What a step action returns. A non-zero exit_code fails the step (unless an `on:` branch matches)."""

    detail: str
    state: str | None = None  # a verdict (watch): SLOW, OK, ...
    exit_code: int = 0
    sets: Mapping[str, Any] = field(default_factory=dict)
    lines: tuple[str, ...] = ()  # shown under the step's line (a dry-run plan, differences)


Action = Callable[[Mapping[str, Any], bool], Done]  # (rendered and checked args, dry_run) -> Done


@dataclass(frozen=True)
class StepResult:
    path: str
    kind: str
    label: str
    outcome: str  # ok | FAILED | a verdict state | planned
    exit_code: int
    seconds: float
    detail: str
    depth: int
    lines: tuple[str, ...] = ()
    branch: str | None = None  # the `on:` key taken after this step

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "kind": self.kind, "label": self.label, "outcome": self.outcome,
                "exit_code": self.exit_code, "seconds": round(self.seconds, 3), "detail": self.detail,
                "branch": self.branch}


@dataclass(frozen=True)
class Result:
    runbook: str
    path: str
    sha256: str
    ok: bool
    exit_code: int
    message: str | None
    failed_at: str | None
    steps: tuple[StepResult, ...]
    dry_run: bool
    variables: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"runbook": self.runbook, "path": self.path, "sha256": self.sha256, "ok": self.ok,
                "exit_code": self.exit_code, "message": self.message, "failed_at": self.failed_at,
                "dry_run": self.dry_run, "vars": dict(self.variables), "steps": [s.to_json() for s in self.steps]}


class _Stop(Exception):
    def __init__(self, code: int, message: str, path: str) -> None:
        super().__init__(message)
        self.code, self.message, self.path = code, message, path


def render_args(book: Runbook, step: Step, variables: Mapping[str, Any]) -> dict[str, Any]:
    """The step's arguments rendered and through the validators; defaults filled in."""
    file = str(book.path)
    kloc = f"{step.path}.{step.kind}"
    out: dict[str, Any] = {}
    for param in step.spec.params:
        key = kloc if step.spec.scalar else f"{kloc}.{param.key}"
        line = step.arg_lines.get(param.key) or step.line
        try:
            value = render_value(step.args.get(param.key), variables)
        except KeyError as e:
            raise RunbookError(file, e.args[0], line=line, key=key) from None
        try:
            out[param.key] = coerce(param, value)
        except ValueError as e:
            raise RunbookError(file, f"{e} (rendered: {value!r})" if _is_template(step.args.get(param.key))
                               else str(e), line=line, key=key) from None
    if step.kind == "watch" and out["until_step"] is None and out["for"] is None:
        raise RunbookError(file, "give until_step or for (or both)", line=step.line, key=kloc)
    return out


def label_of(kind: str, args: Mapping[str, Any]) -> str:
    for key in ("containers", "ct", "run", "name"):
        v = args.get(key)
        if v:
            return f"{kind} {','.join(v) if isinstance(v, list) else v}"
    return kind


def execute(
    book: Runbook, variables: Mapping[str, Any], actions: Mapping[str, Action], *, dry_run: bool = False,
    emit: Callable[[StepResult], None] | None = None, clock: Callable[[], float] = time.monotonic,
) -> Result:
    """Run (or with dry_run, plan) the steps in order; stop at the first unhandled failure."""
    env = dict(variables)
    results: list[StepResult] = []

    def record(r: StepResult) -> None:
        results.append(r)
        if emit is not None:
            emit(r)

    def run_steps(steps: tuple[Step, ...], depth: int, trigger: int) -> None:
        for step in steps:
            t0 = clock()
            label, outcome, code, detail, done = step.kind, "ok", 0, "", Done("")
            try:
                args = render_args(book, step, env)
                label = label_of(step.kind, args)
                if step.kind == "fail":
                    code = trigger or int(ExitCode.FAILURE)
                    if dry_run:
                        outcome, code, detail = "planned", 0, f"would fail (exit {trigger or 1}): {args['message']}"
                    else:
                        outcome, detail = "FAILED", args["message"]
                else:
                    done = actions[step.kind](args, dry_run)
                    code, detail = done.exit_code, done.detail
                    outcome = done.state or ("planned" if dry_run else "ok" if code == 0 else "FAILED")
            except CtlError as e:
                outcome, code, detail = "FAILED", int(e.exit_code), str(e)
            keys = [k for k in (done.state, _exit_name(code)) if k]
            branch = next(((k, sub) for k in keys for (bk, sub) in step.on if bk == k), None)
            record(StepResult(step.path, step.kind, label, outcome, code, clock() - t0, detail, depth, done.lines,
                              branch[0] if branch else None))
            if step.kind == "fail" and not dry_run:
                raise _Stop(code, detail, step.path)
            if code == 0:
                env.update(done.sets)
            if dry_run:
                for _key, sub in step.on:  # a plan shows every branch
                    run_steps(sub, depth + 1, 0)
                if code != 0:
                    raise _Stop(code, detail, step.path)
                continue
            if branch is not None:
                run_steps(branch[1], depth + 1, code)
            elif code != 0:
                raise _Stop(code, detail, step.path)

    try:
        run_steps(book.steps, 0, 0)
    except _Stop as s:
        return Result(book.name, str(book.path), book.sha256, False, s.code, s.message, s.path, tuple(results),
                      dry_run, dict(variables))
    return Result(book.name, str(book.path), book.sha256, True, 0, None, None, tuple(results), dry_run,
                  dict(variables))


def _exit_name(code: int) -> str | None:
    try:
        return ExitCode(code).name
    except ValueError:
        return None
