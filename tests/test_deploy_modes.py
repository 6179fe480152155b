"""A payload file is never made more readable than its source: with no `mode:` it lands with the source's own
permission bits (as scp keeps a new file's), `mode:` still wins, and `ctl deploy --dry-run` shows the mode."""

from __future__ import annotations

import os
import stat

import yaml

from tests.conftest import LocalEnv


def test_a_0600_source_lands_as_0600_and_mode_still_wins(env: LocalEnv) -> None:
    secret = env.dir / "credentials.json"
    secret.write_text('{"token": "not-for-others"}\n')
    os.chmod(secret, 0o600)
    script = env.dir / "tool.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    os.chmod(script, 0o4755)  # setuid on the operator's machine is never carried over
    doc = yaml.safe_load(env.inventory.read_text())
    doc["payload"] += [{"src": "credentials.json", "dest": "/root/credentials.json"},
                       {"src": "tool.sh", "dest": "/root/tool.sh"},
                       {"src": "credentials.json", "dest": "/root/shared.json", "mode": "0644"}]
    env.inventory.write_text(yaml.safe_dump(doc))

    plan = env.ok("deploy", "--allow-dirty", "--dry-run")
    assert "create  /root/credentials.json" in plan and " 0600" in plan.split("/root/credentials.json")[1][:30]
    env.ok("deploy", "--allow-dirty")
    landed = {name: stat.S_IMODE((env.root / "root" / name).stat().st_mode)
              for name in ("credentials.json", "tool.sh", "shared.json")}
    assert landed == {"credentials.json": 0o600, "tool.sh": 0o755, "shared.json": 0o644}

    # Tightening the source is a change the next deploy makes (a `mode` action), nothing else travels.
    os.chmod(secret, 0o400)
    again = env.ok("--json", "deploy", "--allow-dirty")
    files = {f["dest"]: f for f in yaml.safe_load(again)[0]["files"]}
    assert files["/root/credentials.json"]["action"] == "mode" and files["/root/credentials.json"]["mode"] == "0400"
    assert files["/root/shared.json"]["action"] == "same"
    assert stat.S_IMODE((env.root / "root" / "credentials.json").stat().st_mode) == 0o400
