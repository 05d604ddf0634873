#!/usr/bin/env python3
"""Keep the README's output blocks equal to what the committed runs produce today.

    python scripts/readme-outputs.py --check    # exit 1 and name every block that differs
    python scripts/readme-outputs.py --write    # regenerate every block in place

A block is a marker line naming the exact command, then a ```text fence with its output:

    <!-- output: commbench floor RUN_DIR --model deepseek-v3 -->
    ```text
    ...
    ```

Each command runs as `python -m commbench ...` from the repository root, 120 columns wide.
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
README = ROOT / "README.md"
WIDTH = 120
BLOCK = re.compile(r"(<!-- output: (?P<command>.+?) -->\n```text\n)(?P<output>.*?)(```)", re.DOTALL)


def run(command: str) -> str:
    words = shlex.split(command)
    if words[:1] != ["commbench"]:
        sys.exit(f"readme-outputs: {command!r}: a block's command must start with 'commbench'")
    env = {**os.environ, "COLUMNS": str(WIDTH), "TERM": "dumb"}
    done = subprocess.run([sys.executable, "-m", "commbench", *words[1:]], capture_output=True, text=True,
                          cwd=ROOT, env=env)
    if done.returncode != 0:
        sys.exit(f"readme-outputs: {command!r} exited with {done.returncode}: {done.stderr.strip()[-500:]}")
    return "".join(line.rstrip() + "\n" for line in done.stdout.splitlines())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--check", action="store_true", help="exit 1 when a block differs from its command's output")
    what.add_argument("--write", action="store_true", help="rewrite every block with its command's output")
    args = parser.parse_args()
    text = README.read_text()
    blocks = list(BLOCK.finditer(text))
    if not blocks:
        sys.exit(f"readme-outputs: {README}: no output blocks")
    stale = []
    for block in blocks:
        fresh = run(block["command"])
        if fresh != block["output"]:
            stale.append((block, fresh))
    if args.write:
        for block, fresh in reversed(stale):
            text = text[:block.start("output")] + fresh + text[block.end("output"):]
        README.write_text(text)
        print(f"readme-outputs: {len(stale)} of {len(blocks)} block(s) rewritten")
        return 0
    for block, fresh in stale:
        print(f"readme-outputs: the output of `{block['command']}` differs from the README's block:")
        sys.stdout.writelines(difflib.unified_diff(block["output"].splitlines(True), fresh.splitlines(True),
                                                   "README.md", "now", n=1))
    print(f"readme-outputs: {len(blocks) - len(stale)} of {len(blocks)} block(s) match")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
