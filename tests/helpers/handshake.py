"""The step handshake of the preemption and kill tests: a child training loop prints ``step {n}`` and waits for a
``go`` line on stdin before each step, so a test sends a signal at a known step without sleeping."""

from __future__ import annotations

import subprocess


def until(proc: subprocess.Popen, line: str) -> list[str]:
    """Read the child's lines up to ``line`` (returned with the earlier ones), letting it go on after each earlier
    ``step`` line; the child's stderr is in the failure when it ends first."""
    seen = []
    while True:
        out = proc.stdout.readline()
        assert out, f"the child ended before {line!r}: {seen} {proc.stderr.read()[-3000:]}"
        seen.append(out.strip())
        if out.strip() == line:
            return seen
        if out.startswith("step "):
            proc.stdin.write("go\n")
            proc.stdin.flush()
