"""``python -m vllm_affinity build-model``: the small local models, Llama (``tiny_model``) or
hybrid (``hybrid_model``), built once into a cache folder; prints the folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .hybrid_model import build_hybrid
from .tiny_model import ARCHS, SIZES, build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a small local test model.")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="llama only")
    args = parser.parse_args(argv)
    if args.arch != "llama":
        if args.size is not None:
            parser.error("--size applies to --arch llama only")
        print(build_hybrid(args.arch, args.out))
        return 0
    print(build(args.out, size=args.size or "tiny"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
