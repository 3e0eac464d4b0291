"""`hpcvla inspect FILE|RUN_DIR ...`: the trajectory dumps' command line (its parser and
what it runs), kept with the dumps so the top-level command (cli.py) stays a table of
commands."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hpcvla.config import whole_number


def add_inspect_parser(sub) -> None:
    """The `inspect` subcommand on the top-level parser's subparsers."""
    inspect = sub.add_parser("inspect", help="summarise HDF5 trajectory dumps "
                                              "(run.dump_trajectories=true)")
    inspect.add_argument("paths", nargs="+", metavar="FILE|RUN_DIR",
                         help="dump files, or run directories (all their dumps)")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.add_argument("--video", type=whole_number(0), default=0, metavar="K",
                         help="also write the first K episodes of each file as MP4, to "
                              "<file>-videos/ beside it (default 0: none)")
    inspect.add_argument("--verify", action="store_true",
                         help="also read every dataset, checking each chunk's checksum")


def inspect_command(args) -> int:
    """Summarise each dump (with --verify every chunk checked, with --video K episodes as
    MP4), each file on its own: one that cannot be read is named with why, and the others are
    still summarised; a run directory's files set aside (`.unreadable`: a resumed run could
    not read them; `.staging`: a killed writer's) are named too. Exit status 2 where a path
    holds no dump or a file could not be read."""
    from hpcvla.metrics.dump import DumpError, describe, summarize, verify
    files, aside = [], []
    for path in map(Path, args.paths):
        found = sorted((path / "trajectories").glob("rank*.h5")) if path.is_dir() else [path]
        if not found:
            print(f"hpcvla inspect: {path} holds no trajectories/rank*.h5 (was the run "
                  "started with run.dump_trajectories=true?)", file=sys.stderr)
            return 2
        files += found
        if path.is_dir():
            aside += sorted(p for p in (path / "trajectories").glob("rank*.h5.*")
                            if not p.name.endswith("-videos"))
    summaries, failed = [], 0
    for f in files:
        try:
            summary = summarize(f)
            if args.verify:  # reads everything: slower, catches a corrupted chunk anywhere
                summary["verified_bytes"] = verify(f)
            if args.video > 0:
                from hpcvla.metrics.video import dump_videos
                summary["videos"] = dump_videos(f, args.video, f.with_name(f.stem + "-videos"))
            summaries.append(summary)
        except (DumpError, ValueError, OSError) as err:  # OSError: a file HDF5 cannot open
            print(f"hpcvla inspect: {err}", file=sys.stderr)
            failed += 1
    for path in aside:
        print(f"hpcvla inspect: {path} set aside ({path.suffix[1:]}: "
              + ("a start that resumed the run could not read it; HDF5's `h5clear -s` may "
                 "restore one a process killed while it appended" if "unreadable" in path.suffix
                 else "a writer's staging file: being appended now, or left by a writer "
                 "killed before it appended") + "); not summarised",
              file=sys.stderr)
    print(json.dumps(summaries, indent=1) if args.json else
          "\n".join(describe(s) + "".join(f"\n  video {v}" for v in s.get("videos", []))
                    + (f"\n  verified: {s['verified_bytes']:,} bytes read, every chunk's "
                       "checksum right" if "verified_bytes" in s else "") for s in summaries))
    return 2 if failed else 0
