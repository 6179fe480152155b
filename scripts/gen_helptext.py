"""Write controller/launch/helptext.py: what typer prints for `ctl --help`, which `ctl --help` prints without
importing typer. Run after changing a command's name or short help (tests/test_cli_startup.py says when):

    python scripts/gen_helptext.py
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from controller.launch.main import render_help  # noqa: E402

OUT = REPO / "controller" / "launch" / "helptext.py"


def source(text: str) -> str:
    lines = "".join(f"    {line!r}\n" for line in text.splitlines(keepends=True))
    return ('"""What typer prints for `ctl --help` (written by scripts/gen_helptext.py; tests/test_cli_startup.py\n'
            'keeps it equal to typer\'s own output)."""\n\n'
            f"TEXT = (\n{lines})\n")


if __name__ == "__main__":
    OUT.write_text(source(render_help()))
    print(f"wrote {OUT.relative_to(REPO)}")
