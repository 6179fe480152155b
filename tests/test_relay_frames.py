"""Frames of the relay and the session socket: whole whatever the chunking; session ends keep their type."""

from __future__ import annotations

from pathlib import Path

from controller.transport.relay import HEADER, frames


def test_frames_survive_any_chunking() -> None:
    sent = [(b"O", 1, b"hello"), (b"E", 2, b""), (b"X", 1, b"0"), (b"O", 7, bytes(range(256)) * 300)]
    stream = b"".join(HEADER.pack(k, sid, len(d)) + d for k, sid, d in sent)
    for size in (1, 3, HEADER.size, 4096, len(stream)):
        chunks = [stream[i:i + size] for i in range(0, len(stream), size)]
        assert list(frames(chunks)) == sent, size
    assert list(frames([stream[:-1]])) == sent[:-1]  # a frame cut short is not yielded


def test_session_end_kinds_cross_the_socket_as_types() -> None:
    from controller.errors import ConnectionDropped, RelayExited, SessionEnded
    from controller.transport.mux.sock import end_from, end_payload

    for end in (ConnectionDropped("SSH connection dropped: EOF"), RelayExited("ctl's relay exited with status 3"),
                SessionEnded("stopped by `ctl mux stop`")):
        back = end_from(end_payload(end))
        assert type(back) is type(end) and back.message == end.message
    assert type(end_from(b"not json")) is ConnectionDropped  # a reason without a kind: the connection is gone


def test_session_env_keeps_no_secrets(tmp_path: Path) -> None:
    from controller.transport.mux.client import session_env

    env = session_env({"PATH": "/usr/bin", "HOME": "/root", "LC_ALL": "C.UTF-8", "PVE_TOKEN": "xyz",
                       "CTL_PERSIST": "60", "CTL_STATE_DIR": "/elsewhere", "PYTHONPATH": "/opt/lib"}, tmp_path)
    assert env == {"PATH": "/usr/bin", "HOME": "/root", "LC_ALL": "C.UTF-8", "CTL_STATE_DIR": str(tmp_path),
                   "PYTHONPATH": "/opt/lib"}


def test_a_frame_header_claiming_too_much_is_a_protocol_error_not_an_allocation() -> None:
    import pytest

    from controller.transport.relay import MAX_FRAME, FrameError

    ok = HEADER.pack(b"O", 1, 2) + b"hi"
    huge = HEADER.pack(b"O", 1, 0xFFFFFFFF) + b"x" * 10  # a 4 GiB frame, as a hostile stream would claim
    got = frames([ok, huge])
    assert next(got) == (b"O", 1, b"hi")  # what came before the bad header is delivered
    with pytest.raises(FrameError, match="protocol error"):
        next(got)
    assert list(frames([HEADER.pack(b"O", 1, MAX_FRAME) + b"y" * MAX_FRAME])) == [(b"O", 1, b"y" * MAX_FRAME)]


def test_frames_come_in_the_batches_their_chunks_completed() -> None:
    from controller.transport.relay import frame_batches, pack

    a, b, c = (b"A", 1, b'{"argv": []}'), (b"I", 1, b"in"), (b"C", 1, b"")
    whole = pack([a, b, c])
    assert list(frame_batches([whole])) == [[a, b, c]]  # one read: answered together
    cut = len(pack([a])) + 3
    assert list(frame_batches([whole[:cut], whole[cut:]])) == [[a], [b, c]]
    assert list(frame_batches([whole[:2], whole[2:]])) == [[a, b, c]]  # a chunk completing nothing yields nothing
