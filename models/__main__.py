"""`python -m models NAME [NAME...]`: make sure the models exist, print paths."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from models import NAMES, OUT_DIR, ensure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models", description=__doc__)
    parser.add_argument("names", nargs="+", choices=NAMES, metavar="NAME", help=" | ".join(NAMES))
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR, help=f"default: {OUT_DIR}")
    args = parser.parse_args(argv)
    for name in args.names:
        print(ensure(name, args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
