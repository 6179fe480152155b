"""Commands a GPU probe starts side by side and then collects: a part of both probes, joined before the probe."""

import subprocess


def _start(argv):
    """argv started now, its output piped; one that cannot start has its answer at once (rc 127)."""
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as e:
        return {"rc": 127, "out": "", "err": "%s: %s" % (argv[0], e.strerror)}


def _finish(proc, timeout, late, keep):
    """What a started command answered: {"rc", "out" (its last `keep` characters), "err"}. Still running after
    `timeout` seconds: killed, and the answer is rc 124 with the line `late`."""
    if isinstance(proc, dict):
        return proc
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"rc": 124, "out": "", "err": late}
    return {"rc": proc.returncode, "out": out.decode("utf-8", "replace")[-keep:],
            "err": err.decode("utf-8", "replace")[-4000:]}
