"""Follows through ctl's host relay (the path of every `tail -f`, `launch -f` and download through a persistent
session): output as it comes, silence reported, and a follow the caller leaves abandoned (K) so that its child
ends, as when an SSH channel closes. Both ends run here (tests/test_relay_ids.py's local relay)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.transport.relay import HostRelay, frames
from tests.relay_fakes import LocalHost


@pytest.fixture
def relay() -> Iterator[HostRelay]:
    host = LocalHost()
    r = HostRelay(host)  # type: ignore[arg-type]
    assert r.available(), r.why_unavailable
    yield r
    r.close()
    for c in host.chans:
        if c.proc.poll() is None:
            c.proc.kill()
        c.proc.wait()


def test_stream_yields_output_as_it_comes_then_the_exit_status(relay: HostRelay) -> None:
    seen: list[tuple[str, bytes, float]] = []
    t0 = time.monotonic()
    for kind, data in relay.stream(["sh", "-c", "echo a; echo oops >&2; sleep 0.6; echo b; exit 3"]):
        seen.append((kind, data, time.monotonic() - t0))
    kinds = [(k, d) for k, d, _ in seen]
    assert kinds[-1] == ("exit", b"3")
    assert b"".join(d for k, d in kinds if k == "out") == b"a\nb\n"
    assert b"".join(d for k, d in kinds if k == "err") == b"oops\n"
    first_a = next(t for k, d, t in seen if k == "out" and d.startswith(b"a"))
    assert first_a < 0.5 < seen[-1][2]  # `a` arrived before the command ended
    assert not relay._streams


def test_stream_reports_silence_and_keeps_following(relay: HostRelay) -> None:
    kinds = [k for k, _ in relay.stream(["sh", "-c", "sleep 1.2; echo late"], idle=0.3)]
    assert kinds.count("idle") >= 2 and kinds[-2:] == ["out", "exit"]


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (it may vanish between any two looks at /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def test_a_follow_left_early_ends_its_child_and_frees_its_id(relay: HostRelay, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    gen = relay.stream(["sh", "-c", f"echo $$ > {pidfile}; while :; do echo tick; sleep 0.1; done"])
    kind, data = next(gen)
    assert (kind, data[:4]) == ("out", b"tick")
    gen.close()  # the caller stops reading: K
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.05)
    assert not _running(pid)
    while time.monotonic() < deadline and relay._streams:  # its X frame frees the id
        time.sleep(0.05)
    assert not relay._streams
    assert relay.run(["echo", "next"]).stdout == b"next\n"  # the relay goes on


def test_a_command_with_its_whole_input_goes_out_in_one_write(relay: HostRelay) -> None:
    """Start, input and close of a request travel together: over SSH one packet instead of three (each a
    paramiko encrypt and MAC in the session process), over the session socket one send."""
    chan = relay._chan
    writes: list[bytes] = []
    send = chan.send

    def counted(data: bytes) -> int:
        writes.append(bytes(data))
        return send(data)

    chan.send = counted  # the real socket still carries every byte to the real relay process
    res = relay.run(["cat"], stdin=b"hello\n")
    assert (res.returncode, res.stdout) == (0, b"hello\n")
    assert len(writes) == 1
    assert [(k, d) for k, _, d in frames([writes[0]])] == [(b"S", b'["cat"]'), (b"I", b"hello\n"), (b"C", b"")]
    big = b"x" * (70 << 10)  # past one frame's worth: the input follows the start, as it comes
    writes.clear()
    res = relay.run(["wc", "-c"], stdin=big)
    assert res.stdout.strip() == str(len(big)).encode()
    assert len(writes) > 1 and writes[0][:1] == b"S"
    # open() sends input only with the start, in one write: a session that ends during a longer input would
    # otherwise have MuxRelay.open send again a request the relay had begun
    with pytest.raises(ValueError, match="one frame"):
        relay.open(["cat"], stdin=big)
    assert not relay._streams  # no stream id taken by the refusal
