"""The relay's frame splitter: frames come out whole whatever the chunking of the byte stream."""

from __future__ import annotations

from controller.transport.relay import HEADER, frames


def test_frames_survive_any_chunking() -> None:
    sent = [(b"O", 1, b"hello"), (b"E", 2, b""), (b"X", 1, b"0"), (b"O", 7, bytes(range(256)) * 300)]
    stream = b"".join(HEADER.pack(k, sid, len(d)) + d for k, sid, d in sent)
    for size in (1, 3, HEADER.size, 4096, len(stream)):
        chunks = [stream[i:i + size] for i in range(0, len(stream), size)]
        assert list(frames(chunks)) == sent, size
    assert list(frames([stream[:-1]])) == sent[:-1]  # a frame cut short is not yielded
