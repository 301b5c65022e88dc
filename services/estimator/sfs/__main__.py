"""Maintenance commands of the SFS package.

python -m services.estimator.sfs build-native  # compile the replay kernel with mypyc
python -m services.estimator.sfs kernel        # which replay kernel loads, and why
"""

from __future__ import annotations

import argparse
import sys

from services.estimator.sfs import native


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m services.estimator.sfs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("command", choices=["build-native", "kernel"])
    args = ap.parse_args()
    if args.command == "kernel":
        print(f"SFS kernel: {native.IMPL_NOTE}")
        return
    try:
        path = native.build(quiet=True)
    except RuntimeError as exc:
        print(f"SFS kernel: native build failed, the plain module will run: {exc}", file=sys.stderr)
        sys.exit(1)
    print(f"SFS kernel: native build at {path}")


if __name__ == "__main__":
    main()
