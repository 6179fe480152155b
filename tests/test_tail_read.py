"""The agent's `tailinfo` reads back from a log's end only as far as its last N lines need (agent._tail_read):
what it answers is what reading the whole last TAIL_WINDOW bytes answered, held to that on random logs (small
window, chunk and line cap, so that every boundary is met), line end offsets (through LOG.times) included."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller import farside

agent = farside.load("agent")


def whole_window(path: Path, n: int) -> dict[str, object]:
    """tailinfo as it was: the last TAIL_WINDOW bytes read and split whole."""
    data_all = path.read_bytes()
    size = len(data_all)
    start = max(0, size - agent.TAIL_WINDOW)
    data = data_all[start:]
    ends: list[int] = []
    lines = agent._tail_lines(data, start > 0 and not data.startswith((b"\n", b"\r")), ends) if n > 0 else []
    if start > 0 and len(lines) > n:
        lines, ends = lines[1:], ends[1:]
    lines, ends = (lines[-n:], ends[-n:]) if n > 0 else ([], [])
    text = b"".join(line + b"\n" for line in lines)
    return {"ok": True, "size": size, "text": text.decode("utf-8", "replace"),
            "times": agent._line_times(str(path), [start + e for e in ends])}


logs = st.lists(st.sampled_from([b"a", b"bc", b"\n", b"\r", b"\r\n", b"x" * 20, b"\xff", b"\n\n", b"\r\r"]),
                max_size=120).map(b"".join)


@settings(max_examples=400, deadline=None)
@given(log=logs, n=st.integers(min_value=0, max_value=9), window=st.integers(min_value=1, max_value=200),
       chunk=st.integers(min_value=1, max_value=64))
def test_the_tail_is_the_whole_windows_tail(log: bytes, n: int, window: int, chunk: int) -> None:
    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as d:
        mp.setattr(agent, "TAIL_WINDOW", window)
        mp.setattr(agent, "TAIL_CHUNK", chunk)
        mp.setattr(agent, "LINE_CAP", 12)
        path = Path(d) / "train.log"
        path.write_bytes(log)
        # a launcher's size sample at every byte: each line's time is its end offset
        Path(d, "train.log.times").write_text("".join(f"{i} {i}.0\n" for i in range(len(log) + 1)))
        got = agent.tailinfo({"log": str(path), "lines": n, "times": True})
        assert got == whole_window(path, n)


def test_a_large_logs_last_lines_read_one_chunk(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"".join(b"step=%d loss=1.0\n" % i for i in range(200_000)))
    reads: list[int] = []
    real_open = open

    class Counting:
        def __init__(self, f: object) -> None:
            self.f = f

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()  # type: ignore[attr-defined]

        def read(self, k: int) -> bytes:
            reads.append(k)
            return self.f.read(k)  # type: ignore[attr-defined, no-any-return]

        def __getattr__(self, name: str) -> object:
            return getattr(self.f, name)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(agent, "open", lambda p, m="r": Counting(real_open(p, m)), raising=False)
        got = agent.tailinfo({"log": str(log), "lines": 20})
    assert got["text"].splitlines() == [f"step={i} loss=1.0" for i in range(199_980, 200_000)]
    assert reads == [agent.TAIL_CHUNK]
