#!/usr/bin/env python3
"""Keep the output blocks of the README and docs/fleet.md equal to what the committed runs produce today.

    python scripts/readme-outputs.py --check    # exit 1 and name every block that differs
    python scripts/readme-outputs.py --write    # regenerate every block in place

A block is a marker line naming the exact command, then a ```text fence with its output:

    <!-- output: commbench floor RUN_DIR --model deepseek-v3 -->
    ```text
    ...
    ```

Each command runs as `python -m commbench ...` from the repository root with its output piped and
COLUMNS unset, so at the width a user's pipe gets (commbench.terminal.DEFAULT_WIDTH, 100 columns); it must exit
0, or 1 (a FAIL verdict).
Add a block by writing the marker and an empty fence, then --write.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "docs" / "fleet.md"]
BLOCK = re.compile(r"(<!-- output: (?P<command>.+?) -->\n```text\n)(?P<output>.*?)(```)", re.DOTALL)


def run(command: str) -> str:
    words = shlex.split(command)
    if words[:1] != ["commbench"]:
        sys.exit(f"readme-outputs: {command!r}: a block's command must start with 'commbench'")
    env = {**{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}, "TERM": "dumb"}
    done = subprocess.run([sys.executable, "-m", "commbench", *words[1:]], capture_output=True, text=True,
                          cwd=ROOT, env=env)
    if done.returncode not in (0, 1):   # 1: a verdict (qualify's FAIL) is output like any other
        sys.exit(f"readme-outputs: {command!r} exited with {done.returncode}: {done.stderr.strip()[-500:]}")
    return "".join(line.rstrip() + "\n" for line in done.stdout.splitlines())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--check", action="store_true", help="exit 1 when a block differs from its command's output")
    what.add_argument("--write", action="store_true", help="rewrite every block with its command's output")
    args = parser.parse_args()
    stale_pages = 0
    for page in PAGES:
        stale_pages += check_page(page, args.write)
    return 1 if stale_pages and not args.write else 0


def check_page(page: Path, write: bool) -> int:
    """Check (or with `write`, rewrite) one page's blocks; the number that differed."""
    name = page.relative_to(ROOT)
    text = page.read_text()
    blocks = list(BLOCK.finditer(text))
    if not blocks:
        sys.exit(f"readme-outputs: {name}: no output blocks")
    stale = []
    for block in blocks:
        fresh = run(block["command"])
        if fresh != block["output"]:
            stale.append((block, fresh))
    if write:
        for block, fresh in reversed(stale):
            text = text[:block.start("output")] + fresh + text[block.end("output"):]
        page.write_text(text)
        print(f"readme-outputs: {name}: {len(stale)} of {len(blocks)} block(s) rewritten")
        return len(stale)
    for block, fresh in stale:
        print(f"readme-outputs: the output of `{block['command']}` differs from {name}'s block:")
        sys.stdout.writelines(difflib.unified_diff(block["output"].splitlines(True), fresh.splitlines(True),
                                                   str(name), "now", n=1))
    print(f"readme-outputs: {name}: {len(blocks) - len(stale)} of {len(blocks)} block(s) match")
    return len(stale)


if __name__ == "__main__":
    raise SystemExit(main())
