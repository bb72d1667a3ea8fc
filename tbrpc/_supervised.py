"""A ``tbrpc node`` that stops when whoever started it goes away.

``tbrpc launch`` (and the drop-in ``Llama``) start nodes as
``python -m tbrpc._supervised <tbrpc node options>``, locally or through
``ssh``, with a pipe on the node's standard input. When the launcher exits
for any reason -- a clean stop, Ctrl-C, a crash, even SIGKILL -- the pipe
closes (over ssh: the connection drops and sshd closes the remote stdin),
the node sees end-of-file and shuts down as on SIGTERM. So no node outlives
its launcher, on this machine or on another.

Before serving it prints ``tbrpc node pid N`` on stderr, which the launcher
records so a person (or a test) can check that the process is gone.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def _stop_on_stdin_eof() -> None:
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> None:
    print(f"tbrpc node pid {os.getpid()}", file=sys.stderr, flush=True)
    threading.Thread(target=_stop_on_stdin_eof, name="tbrpc-stdin-watch", daemon=True).start()
    from tbrpc.cli import main as cli

    cli(["node", *argv], prog_name="tbrpc")


if __name__ == "__main__":
    main(sys.argv[1:])
