"""One Registry shared by worker threads (what `ctl deploy A B C` does): every record lands, none nests."""

from __future__ import annotations

import threading

from controller.registry import DeployRecord, Registry


def test_threads_sharing_one_registry_record_every_deploy(tmp_path):
    reg = Registry(tmp_path / "reg.sqlite3")
    n_threads, per_thread = 8, 25
    start = threading.Barrier(n_threads)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            start.wait()
            for i in range(per_thread):
                reg.add_deploy(DeployRecord(f"d{t}-{i}", f"ct{t}", "deploy", float(i), None, False, True,
                                            [{"dest": "/root/x", "sha256": "0" * 64}], None))
                assert reg.deploys(f"ct{t}", limit=1)[0].id == f"d{t}-{i}"
        except BaseException as e:  # collected: the main thread asserts there were none
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert sum(len(reg.deploys(f"ct{t}", limit=100)) for t in range(n_threads)) == n_threads * per_thread
    reg.close()
    assert len(Registry(tmp_path / "reg.sqlite3").deploys("ct3", limit=100)) == per_thread


def test_threads_that_end_pass_their_connection_on(tmp_path):
    """A long-lived process (ctl supervise, ctl dashboard) starts threads per poll and per request: their
    connections must be reused, not left open (nor closed: SQLite keeps a closed connection's file descriptor
    while another connection of the process holds a lock on the file), or its descriptors run out in hours."""
    import os

    reg = Registry(tmp_path / "reg.sqlite3")
    reg.claim_run("fresh1", "ct200")

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    seen = []
    for _ in range(300):
        th = threading.Thread(target=lambda: seen.append(len(reg.runs(None))))
        th.start()
        th.join()
    assert seen == [1] * 300
    assert open_fds() <= before + 3  # one more connection at most (db, -wal, -shm)
    assert len(reg._conns) == 2  # the main thread's, and the one the 300 threads passed on
    # Threads at the same time get a connection each, and give them back.
    gate = threading.Barrier(4)

    def together() -> None:
        gate.wait()
        reg.runs(None)
        gate.wait()

    threads = [threading.Thread(target=together) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(reg._conns) == 5 and len(reg._free) == 4
    reg.close()
    assert open_fds() < before


def test_threads_of_one_process_take_turns_to_write_without_sqlite_s_busy_sleeps(tmp_path):
    """A writer that finds the database locked sleeps in SQLite's busy handler (1, 2, 5, 10 ms...), which a
    fan-out's threads met in turn: the registry's threads queue on a lock of its own, and SQLite's wait is left
    to other processes. Here the second writer's SQLite wait is off: only the registry's lock can order it."""
    import sqlite3

    reg = Registry(tmp_path / "reg.sqlite3")
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def first() -> None:
        with reg.tx() as db:
            db.execute("PRAGMA user_version")
            inside.set()
            release.wait(10)

    def second() -> None:
        reg._db.execute("PRAGMA busy_timeout=0")  # this thread's connection: refuse at once when locked
        try:
            reg.claim_run("second", "ct200")
        except sqlite3.OperationalError as e:  # "database is locked": it met the first writer's lock
            errors.append(e)

    a = threading.Thread(target=first)
    a.start()
    assert inside.wait(10)
    b = threading.Thread(target=second)
    b.start()
    b.join(0.3)
    assert b.is_alive()  # waiting for the first writer, in the registry's lock
    release.set()
    a.join()
    b.join()
    assert errors == []
    assert [r.name for r in reg.runs("ct200")] == ["second"]
