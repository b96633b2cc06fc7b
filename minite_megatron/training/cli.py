"""What every miniTE command line shares: bad input is one line naming the flag, file or value,
and exit status 2 (argparse's), never a usage dump or a traceback."""

from __future__ import annotations

import argparse
import sys


class OneLineArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors print ``PROG: error: MESSAGE`` (one line, status
    2) without the usage text (``--help`` still prints it). Subparsers inherit the class."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


__all__ = ["OneLineArgumentParser"]
