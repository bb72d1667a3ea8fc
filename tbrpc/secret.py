"""The cluster secret: one file of 64 hex digits that the head and every node hold.

Heads and nodes prove to each other that they hold the same secret (HMAC-SHA256
over fresh nonces, ``ggml_backend/auth.c``; ``docs/protocol.md``, AUTH); the
secret itself never crosses the network. ``tbrpc secret new PATH`` makes one;
``docs/cluster.md`` shows how to hand it to each machine.

Where a process finds its secret, first match wins: an explicit
``secret_file`` (``--secret-file``, ``tbrpc.connect(..., secret_file=)``), the
one this process chose with ``use()`` (``tbrpc launch``/``doctor``/``status``
from their options or the cluster file), then the ``TBRPC_SECRET_FILE``
environment variable. None of them: no secret.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tbrpc.native import TbrpcError

ENV = "TBRPC_SECRET_FILE"
SECRET_BYTES = 32
MIN_BYTES, MAX_BYTES = 16, 64          # what a node accepts (ggml_backend/auth.h: TB_SECRET_MAX)
DEFAULT_PATH = "~/.config/tbrpc/secret"

_chosen: str | None = None


class SecretFileError(TbrpcError):
    """A secret file that cannot be used: missing, readable by others, or not a secret."""


def new(path: str | os.PathLike[str] = DEFAULT_PATH) -> Path:
    """Write a fresh 32-byte secret as hex to `path` (mode 0600); refuse to overwrite anything."""
    target = Path(os.path.expanduser(path))
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise SecretFileError(f"{target} exists already; a secret is never overwritten "
                              "(delete it first if you mean to replace it on every machine)") from None
    with os.fdopen(fd, "w") as out:
        out.write(os.urandom(SECRET_BYTES).hex() + "\n")
    os.chmod(target, 0o600)   # whatever the umask said
    return target


def read(path: str | os.PathLike[str]) -> bytes:
    """The secret in `path`; refuses a file that group or others may read or write."""
    target = Path(os.path.expanduser(path))
    try:
        info = target.stat()
    except OSError as exc:
        raise SecretFileError(f"secret file {target}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise SecretFileError(f"secret file {target} is not a regular file")
    if info.st_mode & 0o077:
        raise SecretFileError(f"secret file {target} is open to group or others (mode {stat.S_IMODE(info.st_mode):04o}); "
                              f"run `chmod 600 {target}`")
    text = target.read_text(errors="replace").strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise SecretFileError(f"secret file {target} does not hold hex digits (make one with `tbrpc secret new`)") from None
    if not MIN_BYTES <= len(secret) <= MAX_BYTES:
        raise SecretFileError(f"secret file {target} holds {len(secret)} bytes; a secret has {MIN_BYTES} to {MAX_BYTES}")
    return secret


def use(path: str | os.PathLike[str] | None) -> None:
    """Make `path` this process's secret file (checked now); None forgets the choice."""
    global _chosen
    if path is not None:
        read(path)
    _chosen = os.path.expanduser(str(path)) if path is not None else None


def file_for(explicit: str | os.PathLike[str] | None = None) -> str | None:
    """The secret file this process uses: `explicit`, else the one chosen with use(), else $TBRPC_SECRET_FILE."""
    if explicit is not None:
        return os.path.expanduser(str(explicit))
    return _chosen or os.environ.get(ENV) or None


def load(explicit: str | os.PathLike[str] | None = None) -> bytes | None:
    """The secret this process uses (see file_for), or None."""
    path = file_for(explicit)
    return read(path) if path else None
