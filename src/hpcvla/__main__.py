"""`python -m hpcvla` and the `hpcvla` command (pyproject.toml): the CLI (cli.py), then exit."""

import gc
import os
import sys

from hpcvla.cli import main


def run() -> None:
    try:
        code = main()
    except BrokenPipeError:  # `hpcvla config --doc | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error
        code = 141  # 128 + SIGPIPE, as a shell reports a command it stopped the same way
    # At exit the interpreter searches every object left for reference cycles: with torch
    # loaded ~1 s of CPU per process, ~1.4 s with DeepSpeed, every rank of a world at once (the
    # default 4-rank world took ~2 s from its last line to its exit, 0.3-0.5 s frozen). Nothing
    # is left for that search to free: files, windows and engines were closed by their owners.
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
