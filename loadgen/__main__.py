"""`python -m loadgen ...` runs a benchmark; `python -m loadgen compare A B` compares two."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from loadgen.bench import run_bench
from loadgen.cli import build_compare_parser, build_parser
from loadgen.compare import print_comparison
from loadgen.config import BenchConfig


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `loadgen` console script."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "compare":
        ns = build_compare_parser().parse_args(args[1:])
        fields = ns.fields.split(",") if ns.fields else None
        print_comparison(Path(ns.a), Path(ns.b), sys.stdout, fields)
        return 0
    parser = build_parser()
    config = BenchConfig.from_args(parser.parse_args(args))
    try:
        result = asyncio.run(run_bench(config))
    except (ValueError, OSError) as exc:  # bad options or files: say so, no traceback
        print(f"loadgen: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 130 if result["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
