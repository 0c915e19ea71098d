"""TensorBoard event files: finding them and reading their scalars (no TensorFlow needed).

Training writes one directory of event files per run (`--tensorboard-dir`); a resumed run
appends a new file, so a (tag, step) may appear twice: the value written last (by wall time)
wins.
"""

from __future__ import annotations

import glob
import os
from typing import Callable, Dict, List

EVENT_MARK = "tfevents"


def is_event_file(path: str) -> bool:
    return EVENT_MARK in os.path.basename(path)


def event_files(path: str) -> List[str]:
    """Event files at `path`: the file itself, or every one below a directory, sorted."""
    if os.path.isfile(path):
        return [path] if is_event_file(path) else []
    return sorted(glob.glob(os.path.join(glob.escape(path), "**", f"*{EVENT_MARK}*"),
                            recursive=True))


def read_scalars(files: List[str], keep: Callable[[str], bool] = lambda tag: True
                 ) -> Dict[str, Dict[int, float]]:
    """{tag: {step: value}} of the scalar tags accepted by `keep`, over several files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points: Dict[str, Dict[int, tuple]] = {}
    for file in files:
        acc = EventAccumulator(file, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            if not keep(tag):
                continue
            series = points.setdefault(tag, {})
            for event in acc.Scalars(tag):
                old = series.get(event.step)
                if old is None or event.wall_time >= old[0]:
                    series[event.step] = (event.wall_time, float(event.value))
    return {tag: {step: value for step, (_, value) in series.items()}
            for tag, series in points.items()}
