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
