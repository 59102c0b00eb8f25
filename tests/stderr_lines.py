"""A child process's stderr, collected line by line on a thread as it comes, so that a test can
read what a running service logged without blocking on the pipe."""

from __future__ import annotations

import subprocess
import threading


def collect_stderr(proc: subprocess.Popen[str]) -> tuple[list[str], threading.Thread]:
    """``(lines, reader)``: ``lines`` grows as ``proc`` writes (text mode, ``stderr=PIPE``);
    join ``reader`` after the process exited to have them all."""
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return lines, reader
