"""Progress of a capture directory for shell drivers (run_tensor_collection.sh).

    python -m megatron.tensor_capture.progress snapshot DIR > before.txt
    python -m megatron.tensor_capture.progress count DIR --since before.txt   # 12 3456789 3.3 MiB
    python -m megatron.tensor_capture.progress errors DIR --since before.txt
    python -m megatron.tensor_capture.progress human 3456789                  # 3.3 MiB

`count` and `errors` look only at the runs whose manifests were not in the snapshot, and
`count` counts only complete manifest lines. Nothing here imports torch: a poll is cheap.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence

from megatron.tensor_capture import format as capture_format


def human_bytes(nbytes: int) -> str:
    value, units = float(nbytes), ("B", "KiB", "MiB", "GiB", "TiB")
    unit = 0
    while value >= 1024 and unit < len(units) - 1:
        value /= 1024
        unit += 1
    return f"{int(value)} {units[unit]}" if unit == 0 else f"{value:.1f} {units[unit]}"


def snapshot(directory: str) -> List[str]:
    """File names of the manifests now in `directory` (none if it does not exist)."""
    if not os.path.isdir(directory):
        return []
    return [os.path.basename(p) for p in capture_format.manifest_files(directory)]


def new_manifests(directory: str, since: Optional[str]) -> List[str]:
    """Paths of the manifests in `directory` not listed in the snapshot file `since`."""
    before = set()
    if since is not None and os.path.exists(since):
        with open(since, "r", encoding="utf-8") as f:
            before = {line.strip() for line in f if line.strip()}
    return [os.path.join(directory, name) for name in snapshot(directory) if name not in before]


def count(directory: str, since: Optional[str]) -> tuple:
    records = nbytes = 0
    for path in new_manifests(directory, since):
        r, b = capture_format.count_complete(path)
        records, nbytes = records + r, nbytes + b
    return records, nbytes


def errors(directory: str, since: Optional[str]) -> List[str]:
    """The `error` of each summary of the new runs (an unreadable summary is an error too)."""
    found = []
    for manifest in new_manifests(directory, since):
        path = capture_format.summary_for_manifest(manifest)
        if not os.path.exists(path):
            continue        # the run has not ended yet
        try:
            error = capture_format.read_json(path).get("error")
        except (OSError, ValueError) as exc:
            error = f"unreadable summary {path}: {exc}"
        if error:
            found.append(str(error))
    return found


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron.tensor_capture.progress",
        description="Records, bytes and errors of the runs a capture directory gained.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("snapshot", help="print the manifest file names now in DIR")
    p.add_argument("directory", metavar="DIR")
    for name, text in (("count", "print 'RECORDS BYTES HUMAN' of the new runs"),
                       ("errors", "print the capture errors of the new runs, one per line")):
        p = commands.add_parser(name, help=text)
        p.add_argument("directory", metavar="DIR")
        p.add_argument("--since", metavar="FILE", default=None,
                       help="a snapshot file; manifests listed there are not new "
                            "(default: every manifest is new)")
    p = commands.add_parser("human", help="print a byte count as e.g. '3.3 MiB'")
    p.add_argument("bytes", type=int)
    args = parser.parse_args(argv)

    if args.command == "snapshot":
        lines = snapshot(args.directory)
    elif args.command == "count":
        records, nbytes = count(args.directory, args.since)
        lines = [f"{records} {nbytes} {human_bytes(nbytes)}"]
    elif args.command == "errors":
        lines = errors(args.directory, args.since)
    else:
        lines = [human_bytes(args.bytes)]
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
