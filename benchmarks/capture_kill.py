"""Kill runs at random moments and check what they leave behind: captures, checkpoints, studies.

    python benchmarks/capture_kill.py [--quick] [--kinds capture checkpoint study] [--seed 0]
        [--runs 10] [--checkpoint-runs 8] [--study-kills 3] [--window 6] [--out DIR]

Every kill is a SIGKILL of a run's main process at a seeded random moment, spread over
start-up and work (the first run of a kind measures when its work starts). Each kill ends
in one of four outcomes, checked on what it left and on what the next run made of it:

- intact: every check below passed;
- corrupt: something left behind is damaged or half-written, or was taken as valid anyway;
- silently replaced: a result that was complete before the kill changed afterwards, or a
  later run went on from another result than the one recorded;
- failed otherwise: a check that is neither (the lock of the killed run refusing the next
  one, leftovers not cleaned up, a resumed run that does not finish).

capture: `pretrain_gpt.py` on a tiny model (mock data) capturing every iteration in full
mode (`--runs`). After the kill every line of every manifest parses as JSON, the file ends
with a complete line, each line names an existing record of exactly the listed size that
loads with weights_only=True (else corrupt), and megatron.analysis runs on the directory
and reports the run as unfinished (else failed).

checkpoint: `pretrain_gpt.py` on the same model with `--save D --load D --save-interval 1`
(`--checkpoint-runs` runs, one directory): a save takes most of an iteration, so most kills
after start-up land in a save; every third run is killed at a random time since launch
instead (start-up, lock, --load verification). After each kill: the tracker names a
checkpoint that checkpointing.checkpoint_to_load verifies (checksums), every complete
iter_* directory verifies, the tracker never goes back, and a checkpoint the tracker had
named keeps its checksums (else corrupt / silently replaced). The next run must take the
dead run's lock, load exactly the iteration the tracker named, and remove the stale
`.incomplete` directories at its first save; a last run that is not killed loads the final
state and trains one more iteration. Checkpoints older than the tracker's are pruned
between runs (disk space); only the tracker's and newer ones are checked.

study: tools/study.py with 2 tiny arms (bf16, FA_linear_mxfp4; one seed, 10 iterations of a
small model on the embedded data with an 8k BPE, one training at a time; `--study-kills`
kills). First an uninterrupted reference study; then a study directory is killed and run
again with the same command (the README's resume) until its runs are all done or the kills
are spent, then run to its end, and the next kills go to a new directory. A kill lands in
one of the trainings left or while the results are written; kills alternate between the
study process alone, whose running training outlives it, and its whole process group.
After each kill every result.json and study.json parses (else corrupt) and a run's
result.json that said "done" is unchanged (else silently replaced); the finished study must
reuse every run that was done, list every run as done with the reference study's final
validation loss (the runs are deterministic), and each run's train.log must be the log of
one training ending in that loss (else corrupt).

Processes that outlive a killed run (megatron-core's checkpoint writers and multiprocessing
helpers, a killed study's training) are counted and described; those of a checkpointing run
live on while the next run starts, then are ended. Prints one line per kill, the phases of
the kills and a table; the exit status is 1 when any kill is not intact. The default (10
captures, 8 checkpointing runs, 3 study kills) took 8 minutes on a 2-core machine shared
with other work (2.5 minutes of CPU time); --quick kills 3 captures, 4 checkpointing runs
and 1 study.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import psutil

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
# megatron.core says so on import; the runs themselves say which modules they use.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from megatron.analysis.pipeline import Options, analyze  # noqa: E402
from megatron.tensor_capture import format as capture_format  # noqa: E402
from megatron.tensor_capture.load import RecordError, load_record  # noqa: E402
from megatron.training.child_env import with_repository_path  # noqa: E402
from megatron.training import checkpointing, corpora  # noqa: E402
from megatron.training.checkpoint_files import (  # noqa: E402
    check_files, read_checksums, verify_checkpoint)
from megatron.training.errors import ConfigError  # noqa: E402

SCHEME = "FA_linear_mxfp8"
TRAINING_STARTED = "training from iteration"
LOCK_REFUSED = "is in use by another run"
TINY_MODEL = [
    "--model-preset", "llama-tiny", "--num-layers", "2", "--hidden-size", "128",
    "--ffn-hidden-size", "384", "--num-attention-heads", "4", "--num-query-groups", "2",
    "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
    "--lr", "3e-3", "--train-iters", "100000", "--log-interval", "1",
    "--eval-interval", "1000000", "--eval-iters", "0", "--num-workers", "0",
]
RUN_ARGS = TINY_MODEL + [
    "--quant-scheme", SCHEME, "--save-tensors", "--control-iter", "0",
    "--collect-micro-batches", "2",
]
CHECKPOINT_ARGS = TINY_MODEL + ["--lr-decay-iters", "100000", "--save-interval", "1"]
STUDY_VOCAB = 8192
STUDY_RUNS = 2                           # 2 arms x 1 seed
STUDY_ARGS = [
    "--tokenizer", f"bpe{STUDY_VOCAB}", "--schemes", "bf16", "mx4=FA_linear_mxfp4",
    "--seeds", "1", "--train-iters", "10", "--evals", "2", "--eval-iters", "2",
    "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "2", "--jobs", "1",
    "--", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "2", "--num-query-groups", "1",
]
OUTCOMES = ("corrupt", "silently replaced", "failed otherwise")


@dataclass
class Kill:
    """One kill and what the checks found (problems by outcome)."""

    kind: str
    label: str
    phase: str = ""
    left: int = 0                                     # processes that outlived the kill
    left_text: str = "none"                           # and what they are
    problems: Dict[str, List[str]] = field(default_factory=dict)

    def outlived(self, pgid: int, run: List[str]) -> None:
        """Count and describe what is left of the killed run's process group."""
        members = group_members(pgid)
        self.left, self.left_text = len(members), describe_members(members, run)

    def add(self, outcome: str, problem: str) -> None:
        self.problems.setdefault(outcome, []).append(problem)

    @property
    def outcome(self) -> str:
        return next((o for o in OUTCOMES if self.problems.get(o)), "intact")

    def verdict(self) -> str:
        if self.outcome == "intact":
            return "intact"
        return "; ".join(f"{o.upper()}: {', '.join(self.problems[o])}"
                         for o in OUTCOMES if self.problems.get(o))


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------

_groups: List[int] = []           # process groups started here, ended on the way out


def child_env(threads: int = 1) -> dict:
    env = with_repository_path(REPO_ROOT, OMP_NUM_THREADS=str(threads))
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def launch(argv: List[str], log_path: str, threads: int = 1) -> subprocess.Popen:
    """Start `argv` in a process group of its own (so that whatever it starts can be found
    once it is killed), output to `log_path`."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=child_env(threads), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    _groups.append(proc.pid)
    return proc


def group_members(pgid: int) -> List[psutil.Process]:
    """The live processes of process group `pgid`."""
    members = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def describe_members(members: List[psutil.Process], run: List[str]) -> str:
    """What the processes that outlived the killed run `run` (its command) are, e.g. '1 forked
    copy of the run (lock file open), 2 x multiprocessing helper'."""
    kinds: Dict[str, int] = {}
    for proc in members:
        try:
            command = proc.cmdline()
            lock = any(os.path.basename(f.path) == ".lock" for f in proc.open_files())
        except psutil.Error:
            continue
        kind = ("forked copy of the run" if command == run else
                "multiprocessing helper" if "multiprocessing" in " ".join(command) else
                "training" if any(a.endswith("pretrain_gpt.py") for a in command) else "other")
        if lock:
            kind += " (lock file open)"
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{n} x {k}" for k, n in kinds.items()) or "none"


def end_group(pgid: int, wait: float = 0.0) -> int:
    """Give what is left of group `pgid` up to `wait` seconds to end by itself, then kill it.
    Returns how many processes were still there at the start."""
    left = len(group_members(pgid))
    deadline = time.monotonic() + wait
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    members = group_members(pgid)
    for proc in members:            # one by one: psutil checks that the pid is still theirs
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(members, timeout=10)
    if pgid in _groups:
        _groups.remove(pgid)
    return left


def watch_and_kill(proc: subprocess.Popen, log_path: str, delay_from_start: Optional[float],
                   after_start: Optional[float], marker: str = TRAINING_STARTED,
                   occurrence: int = 1):
    """SIGKILL `proc` at `delay_from_start` seconds after launch, or `after_start` seconds
    after `marker` appears in its log for the `occurrence`-th time. Returns (seconds to that
    or None, killed at seconds, return code); a run that ended first is not killed."""
    launched = time.monotonic()
    started = None
    kill_at = None if delay_from_start is None else launched + delay_from_start
    while proc.poll() is None:
        now = time.monotonic()
        if started is None and read(log_path).count(marker) >= occurrence:
            started = now - launched
            if kill_at is None:
                kill_at = now + after_start
        if kill_at is not None and now >= kill_at:
            break
        time.sleep(0.02)
    killed_at = time.monotonic() - launched
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    if started is None and read(log_path).count(marker) >= occurrence:
        started = killed_at          # reached the marker in the last poll interval
    return started, killed_at, proc.returncode


def read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def last_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[-1][:200]


def kill_plan(rng: random.Random, startup: Optional[float], window: float, whole: bool):
    """(seconds from launch, seconds after the start of the work): the first run of a kind
    (startup unknown) and runs killed during the work wait for it; `whole` runs are killed
    at any time from launch to 1.2 x start-up plus the window."""
    if startup is None or not whole:
        return None, rng.uniform(0, window)
    return rng.uniform(0, 1.2 * startup + window), None


# ---------------------------------------------------------------------------------------------
# Captures
# ---------------------------------------------------------------------------------------------


def manifest_problems(directory: str) -> list:
    """Why the manifests of `directory` are not valid (empty list when they are)."""
    problems = []
    for manifest in capture_format.manifest_files(directory):
        with open(manifest, encoding="utf-8") as f:
            text = f.read()
        if text and not text.endswith("\n"):
            problems.append(f"{manifest}: ends in a partial line")
        for number, line in enumerate(text.splitlines(), 1):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                problems.append(f"{manifest}:{number}: does not parse")
                continue
            if entry.get("file") is None:
                continue
            path = capture_format.record_path(directory, entry["file"])
            if not os.path.isfile(path) or os.path.getsize(path) != entry.get("bytes"):
                problems.append(f"{manifest}:{number}: {entry['file']} missing or not "
                                f"{entry.get('bytes')} bytes")
                continue
            try:
                load_record(path)
            except (RecordError, OSError) as exc:
                problems.append(f"{manifest}:{number}: {exc}")
    return problems


def analysis_reports_unfinished(root: str, directory: str, out: str, killed: bool):
    """(ok, note): the analysis ran without an exception and, when a killed run had opened its
    manifest, reported the run as unfinished."""
    try:
        result = analyze(Options(tensor_dirs=[root], output_dir=out, workers=1,
                                 progress=False, figures=False))
    except Exception as exc:  # noqa: BLE001 - any exception is the failure being measured
        return False, f"analysis raised {type(exc).__name__}: {exc}"
    kinds = {p["kind"] for p in result.problems.items}
    records = (result.statistics or {}).get("timing", {}).get("records", 0)
    note = f"{records} records analysed, problems: {', '.join(sorted(kinds)) or 'none'}"
    capturing = os.path.isdir(directory) and capture_format.manifest_files(directory)
    return ("unfinished_run" in kinds) if capturing and killed else True, note


def capture_kills(base: str, runs: int, window: float, rng: random.Random) -> List[Kill]:
    kills, startup = [], None
    for run in range(runs):
        root = os.path.join(base, f"capture{run:03d}")
        os.makedirs(root, exist_ok=True)
        log_path = os.path.join(root, "train.log")
        plan = kill_plan(rng, startup, window, whole=True)
        argv = [sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"), *RUN_ARGS,
                "--tensor-save-dir", root]
        proc = launch(argv, log_path)
        started, killed_at, code = watch_and_kill(proc, log_path, *plan)
        startup = startup if started is None or startup is not None else started
        kill = Kill("capture", f"capture {run + 1:3d}")
        kill.outlived(proc.pid, argv)
        end_group(proc.pid)
        killed = code == -signal.SIGKILL
        kill.phase = "during training" if started is not None and killed else \
            "before training" if killed else "not killed"
        if not killed:
            kill.add("failed otherwise", f"exited by itself with code {code} before the kill: "
                                         f"{last_line(read(log_path))}")
        directory = os.path.join(root, SCHEME)
        problems = manifest_problems(directory) if os.path.isdir(directory) else []
        for problem in problems[:1]:
            kill.add("corrupt", f"manifest invalid: {problem}")
        lines = sum(capture_format.count_complete(m)[0]
                    for m in capture_format.manifest_files(directory)) \
            if os.path.isdir(directory) else 0
        ok, note = analysis_reports_unfinished(root, directory, os.path.join(root, "analysis"),
                                               killed)
        if not ok:
            kill.add("failed otherwise", f"analysis: {note}")
        kills.append(kill)
        print(f"{kill.label}: killed at {killed_at:6.2f} s ({kill.phase}), {lines} manifest "
              f"lines, analysis: {note}, processes left: {kill.left_text}: {kill.verdict()}",
              flush=True)
    return kills


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------

_INCOMPLETE = re.compile(r"iter_\d{7,}\.incomplete(\..*)?")
_COMPLETE = re.compile(r"iter_(\d{7,})")
_LOADED = re.compile(r"loaded checkpoint \S+ \(iteration (\d+)\)")
_SAVED = "saved checkpoint at iteration"


def checkpoint_problem(ckpt: str) -> Optional[str]:
    """Why the complete checkpoint directory `ckpt` would not load as saved (None when it
    would): the structure and metadata, and every file against checksums.json."""
    try:
        found = verify_checkpoint(ckpt)
        files = read_checksums(ckpt)
    except ConfigError as exc:
        return str(exc)
    if files is None:
        return f"{os.path.basename(ckpt)} has no checksums.json"
    unlisted = [n for n in found.needed if n not in files]
    if unlisted:
        return f"{os.path.basename(ckpt)}/{unlisted[0]} is not in checksums.json"
    bad = check_files(ckpt, files)
    return f"{os.path.basename(ckpt)}/{bad[0]} {bad[1]}" if bad else None


@dataclass
class SaveDirState:
    tracker: Optional[int]
    complete: Dict[int, str]          # iteration -> SHA-256 of its checksums.json
    incomplete: List[str]
    problem: Optional[str] = None     # an unreadable tracker


def save_dir_state(root: str) -> SaveDirState:
    complete, incomplete = {}, []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        match = _COMPLETE.fullmatch(name)
        if match:
            listing = os.path.join(root, name, "checksums.json")
            complete[int(match.group(1))] = hashlib.sha256(open(listing, "rb").read()).hexdigest() \
                if os.path.isfile(listing) else ""
        elif _INCOMPLETE.fullmatch(name):
            incomplete.append(name)
    try:
        return SaveDirState(checkpointing.read_tracker(root) if os.path.isdir(root) else None,
                            complete, incomplete)
    except ConfigError as exc:
        return SaveDirState(None, complete, incomplete, str(exc))


def check_run_log(kill: Kill, text: str, before: SaveDirState, after: SaveDirState) -> bool:
    """What a run (killed or not) made of the state it started from; True when it loaded."""
    if LOCK_REFUSED in text:
        kill.add("failed otherwise", "refused by the lock of a dead run: "
                                     f"{last_line(text)[:120]}")
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    for line in errors[:1]:
        outcome = "corrupt" if ("damaged" in line or "could not be read" in line
                                or "incomplete" in line) else "failed otherwise"
        if LOCK_REFUSED not in line:
            kill.add(outcome, line[:200])
    loaded = [int(i) for i in _LOADED.findall(text)]
    if loaded and loaded[0] != before.tracker:
        kill.add("silently replaced", f"loaded iteration {loaded[0]}, the tracker named "
                                      f"{before.tracker}")
    if "no checkpoint found" in text and before.tracker is not None:
        kill.add("silently replaced", f"started from scratch, the tracker named {before.tracker}")
    if _SAVED in text:
        stale = [n for n in before.incomplete if n in after.incomplete]
        if stale:
            kill.add("failed otherwise", f"stale {', '.join(stale)} not removed by its save")
    return bool(loaded) or ("no checkpoint found" in text and before.tracker is None)


def check_save_dir(kill: Kill, root: str, before: SaveDirState, after: SaveDirState) -> None:
    """The state a kill left: tracker verified and loadable, complete directories intact,
    nothing the tracker had named changed."""
    if after.problem:
        kill.add("corrupt", after.problem)
    if after.tracker is not None:
        try:
            found = checkpointing.checkpoint_to_load(root, log=lambda message: None)
        except ConfigError as exc:
            kill.add("corrupt", f"the tracker's checkpoint does not verify: {exc}")
        else:
            if found is None or found[0] != after.tracker:
                kill.add("corrupt", f"checkpoint_to_load chose {found}, the tracker names "
                                    f"{after.tracker}")
    for iteration in sorted(after.complete):
        problem = checkpoint_problem(checkpointing.checkpoint_dir(root, iteration))
        if problem:
            kill.add("corrupt", f"complete-looking {problem}")
    if before.tracker is not None:
        if after.tracker is None or after.tracker < before.tracker:
            kill.add("silently replaced", f"the tracker went from {before.tracker} to "
                                          f"{after.tracker}")
        for iteration, digest in before.complete.items():
            if iteration <= before.tracker and after.complete.get(iteration) != digest:
                kill.add("silently replaced", f"iter_{iteration:07d} (named by the tracker) "
                                              "changed or disappeared")


def prune(root: str, state: SaveDirState) -> None:
    """Remove the complete checkpoints older than the tracker's (disk space; not checked)."""
    for iteration in list(state.complete):
        if state.tracker is not None and iteration < state.tracker:
            shutil.rmtree(checkpointing.checkpoint_dir(root, iteration))
            del state.complete[iteration]


def loaded_what(text: str) -> str:
    loaded = _LOADED.findall(text)
    if loaded:
        return f"loaded iteration {loaded[0]}"
    return "started fresh" if "no checkpoint found" in text else "loaded nothing yet"


def checkpoint_kills(base: str, runs: int, window: float, rng: random.Random) -> List[Kill]:
    """`runs` runs on one save directory, each killed, then one that is not. What a run makes
    of the directory it starts from (lock, load, clean-up) is the outcome of the kill that
    left the directory so; what a kill leaves is checked right after it."""
    root = os.path.join(base, "checkpoints")
    script = os.path.join(REPO_ROOT, "pretrain_gpt.py")
    kills: List[Kill] = []
    awaiting_load: List[Kill] = []            # kills whose checkpoint no run has loaded yet
    startup = outlived = None
    for run in range(runs + 1):
        final = run == runs
        before = save_dir_state(root)
        prune(root, before)
        log_path = os.path.join(base, f"checkpoint{run:03d}.log")
        extra = ["--exit-interval", str((before.tracker or 0) + 1)] if final else []
        argv = [sys.executable, script, *CHECKPOINT_ARGS, "--save", root, "--load", root, *extra]
        proc = launch(argv, log_path)
        started = killed_at = None
        if final:
            try:
                code = proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        else:
            plan = kill_plan(rng, startup, window, whole=run % 3 == 2)
            started, killed_at, code = watch_and_kill(proc, log_path, *plan)
            startup = startup if started is None or startup is not None else started
        # What outlived the killed run stays while the next run starts (a checkpoint writer
        # it forked holds a descriptor of its lock), and is ended once that run is.
        if final and kills:
            kill = kills[-1]
        else:
            kill = Kill("checkpoint", f"checkpoint {run + 1:3d}")
            time.sleep(0.5)         # a child forked just before the kill settles first
            kill.outlived(proc.pid, argv)
        if outlived is not None:
            end_group(outlived)
        outlived = proc.pid
        after = save_dir_state(root)
        text = read(log_path)
        previous = kills[-1] if kills else kill     # whose leftovers this run started from
        if check_run_log(previous, text, before, after):
            awaiting_load = []
        check_save_dir(kill, root, before, after)
        if final:
            if code != 0 or after.tracker != (before.tracker or 0) + 1 or after.incomplete:
                kill.add("failed otherwise", f"the last run (not killed) ended with code "
                                             f"{code}, tracker {after.tracker}, "
                                             f"{len(after.incomplete)} .incomplete left: "
                                             f"{last_line(text)}")
            for earlier in awaiting_load:
                earlier.add("failed otherwise", "its checkpoint was never loaded")
            print(f"checkpoint last: not killed, exit code {code}, {loaded_what(text)}, "
                  f"saved iteration {after.tracker}, {len(after.incomplete)} .incomplete "
                  "left", flush=True)
            break
        if LOCK_REFUSED in text:     # not a kill: the kill before it is to blame, and was
            print(f"{kill.label}: refused at start-up: {last_line(text)[:160]}", flush=True)
            continue
        if code != -signal.SIGKILL:
            kill.add("failed otherwise", f"exited by itself with code {code} before the kill: "
                                         f"{last_line(text)}")
        own = [n for n in after.incomplete if f".incomplete.{proc.pid}-" in n]
        beyond = [i for i in after.complete if i not in before.complete
                  and (after.tracker is None or i > after.tracker)]
        kill.phase = ("during a save" if own else
                      "between rename and tracker" if beyond else
                      "between saves" if started is not None else "during start-up")
        kills.append(kill)
        awaiting_load.append(kill)
        load = loaded_what(text) if started is not None or _LOADED.search(text) else \
            "killed before loading"
        print(f"{kill.label}: killed at {killed_at:6.2f} s ({kill.phase}), {load}, "
              f"{text.count(_SAVED)} saves, tracker {before.tracker} -> {after.tracker}, "
              f"{len(after.incomplete)} .incomplete, processes left: {kill.left_text}: "
              f"{kill.verdict()}", flush=True)
    for kill in kills:
        if kill.outcome != "intact":
            print(f"{kill.label}: {kill.verdict()}", flush=True)
    return kills


# ---------------------------------------------------------------------------------------------
# Studies
# ---------------------------------------------------------------------------------------------


def study_command(out: str, data_root: str) -> List[str]:
    return [sys.executable, os.path.join(REPO_ROOT, "tools", "study.py"), "--output-dir", out,
            "--data-root", data_root, *STUDY_ARGS]


def result_files(out: str) -> Dict[str, bytes]:
    found = {}
    runs = os.path.join(out, "runs")
    for scheme in sorted(os.listdir(runs)) if os.path.isdir(runs) else []:
        for seed in sorted(os.listdir(os.path.join(runs, scheme))):
            path = os.path.join(runs, scheme, seed, "result.json")
            if os.path.isfile(path):
                found[f"{scheme} {seed}"] = open(path, "rb").read()
    return found


def done(content: bytes) -> bool:
    try:
        return json.loads(content).get("status") == "done"
    except ValueError:
        return False


def interrupted_runs(text: str) -> List[str]:
    """'SCHEME seedS' of the trainings a study log started and did not report on."""
    started = re.findall(r"\[study\] start (\S+) seed (\d+) ->", text)
    ended = set(re.findall(r"\[study\] run \d+/\d+ (\S+) seed (\d+):", text))
    return [f"{s} seed{n}" for s, n in started if (s, n) not in ended]


def log_problem(path: str, value: float) -> Optional[str]:
    """Why a run's train.log is not the log of one training that ended with `value`: NUL
    bytes or iterations out of order (two trainings wrote into it), or another last
    validation loss."""
    try:
        raw = open(path, "rb").read()
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    name = os.path.relpath(path)
    nul = raw.count(b"\0")
    if nul:
        return f"{name} holds {nul} NUL bytes (written by two trainings)"
    text = raw.decode("utf-8", errors="replace")
    for pattern in (r"iteration +(\d+)/", r"validation loss at iteration (\d+)"):
        iterations = [int(i) for i in re.findall(pattern, text)]
        if iterations != sorted(set(iterations)):
            return f"{name}: iterations out of order (written by two trainings)"
    if text.count(TRAINING_STARTED) != 1:
        return f"{name} holds {text.count(TRAINING_STARTED)} trainings"
    lines = [line for line in text.splitlines() if "validation loss at iteration" in line]
    if not lines or f"{value:.6E}" not in lines[-1]:
        return f"{name}: the last validation line does not hold {value:.6E}"
    return None


@dataclass
class Reference:
    """The uninterrupted study: final validation losses, seconds per run and outside runs."""

    losses: Dict[tuple, float]
    shortest: float                  # the shortest run, seconds
    overhead: float                  # start-up and results, seconds


def reference_study(base: str, data_root: str):
    """(Reference, None) or (None, the reason it failed)."""
    out, log_path = os.path.join(base, "study-reference"), os.path.join(base, "study-ref.log")
    t0 = time.monotonic()
    proc = launch(study_command(out, data_root), log_path, threads=os.cpu_count() or 1)
    code = proc.wait()
    seconds = time.monotonic() - t0
    end_group(proc.pid)
    if code != 0:
        return None, f"the reference study ended with code {code}: {last_line(read(log_path))}"
    runs = json.load(open(os.path.join(out, "study.json")))["runs"]
    run_seconds = [r["seconds"] for r in runs]
    return Reference({(r["scheme"], r["seed"]): r["final_val_loss"] for r in runs},
                     min(run_seconds), max(0.0, seconds - sum(run_seconds))), None


def study_kill_plan(rng: random.Random, reference: Reference, unfinished: int):
    """(marker, occurrence, seconds after it): in one of the trainings left, or while the
    results are written (after the log line that ends the trainings)."""
    target = rng.randrange(unfinished + 1)
    if target < unfinished:
        return "[study] start", target + 1, rng.uniform(0, 0.8 * reference.shortest)
    return (" run(s) in " if unfinished else "[study] reusing", 1,
            rng.uniform(0, 0.5 * reference.overhead))


def check_study_files(kill: Kill, out: str, finished: Dict[str, bytes]) -> None:
    """After a kill: every result.json and study.json parses, and no result that said "done"
    changed or went (`finished` holds them as first seen, and gains the new ones)."""
    now = result_files(out)
    for name, content in now.items():
        try:
            json.loads(content)
        except ValueError:
            kill.add("corrupt", f"{name}/result.json does not parse")
            continue
        if name in finished and content != finished[name]:
            kill.add("silently replaced", f"{name}/result.json (done) changed")
        elif name not in finished and done(content):
            finished[name] = content
    for name in finished:
        if name not in now:
            kill.add("silently replaced", f"{name}/result.json (done) disappeared")
    study_json = os.path.join(out, "study.json")
    if os.path.exists(study_json):
        try:
            json.load(open(study_json))
        except ValueError:
            kill.add("corrupt", "study.json does not parse")


def check_finished_study(out: str, text: str, code: int, reused_expected: int,
                         reference: Reference, blame: Dict[str, Kill], last: Kill) -> str:
    """The study that ran to its end: every done run reused, every run done with the
    reference's loss and a log of one training. Problems go to the kill that interrupted the
    run (`blame`), else to `last`. Returns a summary."""
    reused = re.findall(r"reusing (\d+) finished run", text)
    reused = int(reused[0]) if reused else 0
    if code != 0:
        last.add("failed otherwise", f"the resumed study ended with code {code}: "
                                     f"{last_line(text)}")
    elif reused != reused_expected:
        last.add("silently replaced", f"reused {reused} finished runs, {reused_expected} were "
                                      "done")
    try:
        runs = json.load(open(os.path.join(out, "study.json")))["runs"]
    except (OSError, ValueError, KeyError) as exc:
        runs = []
        last.add("corrupt", f"study.json unreadable ({type(exc).__name__})")
    if len(runs) != STUDY_RUNS:
        last.add("corrupt", f"study.json lists {len(runs)} of {STUDY_RUNS} runs")
    for run in runs:
        name = f"{run['scheme']} seed{run['seed']}"
        culprit = blame.get(name, last)
        expected = reference.losses.get((run["scheme"], run["seed"]))
        if run["status"] != "done" or run["final_val_loss"] != expected:
            culprit.add("corrupt", f"{name}: {run['status']}, final validation loss "
                                   f"{run['final_val_loss']} (reference {expected})")
        problem = log_problem(run["log"], run["final_val_loss"] or float("nan"))
        if problem:
            culprit.add("corrupt", problem)
    return f"exit code {code}, reused {reused} finished runs, {len(runs)} runs in study.json"


def study_round(base: str, number: int, kills_left: int, data_root: str, reference: Reference,
                rng: random.Random) -> List[Kill]:
    """One study directory: killed and run again with the same command until it finishes by
    itself, its runs are all done or `kills_left` kills are spent, then run to its end and
    checked."""
    out = os.path.join(base, f"study{number}")
    kills: List[Kill] = []
    finished: Dict[str, bytes] = {}        # result.json of done runs, as first seen
    blame: Dict[str, Kill] = {}            # run -> the last kill that interrupted it
    orphans: List[int] = []                # process groups of studies killed alone
    for invocation in range(kills_left + 1):
        log_path = os.path.join(base, f"study{number}-{invocation}.log")
        reused_expected = sum(done(c) for c in result_files(out).values())
        argv = study_command(out, data_root)
        proc = launch(argv, log_path, threads=os.cpu_count() or 1)
        if invocation == kills_left or (invocation and reused_expected == STUDY_RUNS):
            code, killed_at = proc.wait(), None       # the kills left go to the next round
        else:
            marker, occurrence, delay = study_kill_plan(rng, reference,
                                                        STUDY_RUNS - reused_expected)
            _, killed_at, code = watch_and_kill(proc, log_path, None, delay, marker, occurrence)
        text = read(log_path)
        kill = Kill("study", f"study {number + 1}.{invocation + 1}")
        if LOCK_REFUSED in text:
            kill.add("failed otherwise", f"refused by the lock of a dead study: {last_line(text)}")
        if code != -signal.SIGKILL:
            # Finished (by itself, or not killed): what is left of killed studies ends first.
            left = sum(end_group(pgid, wait=120) for pgid in orphans)
            end_group(proc.pid)
            last = kills[-1] if kills else None
            check_study_files(last or kill, out, finished)
            summary = check_finished_study(out, text, code, reused_expected, reference, blame,
                                           last or kill)
            for outcome, problems in kill.problems.items():
                (last or kill).problems.setdefault(outcome, []).extend(problems)
            print(f"study {number + 1} finished: {summary}, {left} processes of killed studies "
                  "were still running", flush=True)
            if last is None and kill.problems:      # nothing was killed, yet it failed
                kill.phase = "not killed"
                kills.append(kill)
            break
        alone = len(kills) % 2 == 0
        kill.phase = (f"{'study alone' if alone else 'study and its training'}, "
                      f"{'in a training' if interrupted_runs(text) else 'outside the trainings'}")
        if alone:
            kill.outlived(proc.pid, argv)
            orphans.append(proc.pid)
        else:
            end_group(proc.pid)                # its training dies with it
        for name in interrupted_runs(text):
            blame[name] = kill
        check_study_files(kill, out, finished)
        kills.append(kill)
        print(f"{kill.label}: killed at {killed_at:6.2f} s ({kill.phase}), "
              f"{len(finished)}/{STUDY_RUNS} runs done, interrupted "
              f"{', '.join(interrupted_runs(text)) or 'no training'}, processes left: "
              f"{kill.left_text}", flush=True)
    return kills


def study_kills(base: str, kills_wanted: int, data_root: str, rng: random.Random) -> List[Kill]:
    """A reference study, then study directories killed and resumed until `kills_wanted`
    kills are spent, each run to its end and checked."""
    corpora.ensure_bpe_dataset("wikipedia", STUDY_VOCAB, data_root,
                               log=lambda m: print(m, flush=True))
    reference, problem = reference_study(base, data_root)
    if reference is None:
        kill = Kill("study", "study reference")
        kill.add("failed otherwise", problem)
        print(f"{kill.label}: {kill.verdict()}", flush=True)
        return [kill]
    print(f"study reference: {len(reference.losses)} runs, the shortest {reference.shortest:.0f} "
          f"s, {reference.overhead:.1f} s outside the runs", flush=True)
    kills: List[Kill] = []
    for number in range(kills_wanted + 3):     # a round may finish before its kill
        if len(kills) >= kills_wanted:
            break
        kills += study_round(base, number, kills_wanted - len(kills), data_root, reference, rng)
    for kill in kills:
        print(f"{kill.label}: {kill.verdict()}", flush=True)
    return kills


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def print_table(kills: List[Kill], kinds: List[str]) -> None:
    for kind in kinds:
        phases: Dict[str, int] = {}
        for kill in kills:
            if kill.kind == kind and kill.phase:
                phases[kill.phase] = phases.get(kill.phase, 0) + 1
        if phases:
            print(f"{kind} kills: " + ", ".join(f"{n} {p}" for p, n in phases.items()))
    columns = ("kills", "intact", *OUTCOMES, "processes left")
    print()
    print(f"| kind | {' | '.join(columns)} |")
    print("|---|" + "---:|" * len(columns))
    for kind in kinds:
        mine = [k for k in kills if k.kind == kind]
        counts = [len(mine), sum(k.outcome == "intact" for k in mine),
                  *[sum(k.outcome == o for k in mine) for o in OUTCOMES],
                  sum(k.left for k in mine)]
        print(f"| {kind} | {' | '.join(str(c) for c in counts)} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", choices=["capture", "checkpoint", "study"],
                        default=["capture", "checkpoint", "study"], help="what to kill")
    parser.add_argument("--runs", type=int, default=None,
                        help="capture runs (default 10; --quick 3)")
    parser.add_argument("--checkpoint-runs", type=int, default=None,
                        help="killed checkpointing runs (default 8; --quick 4)")
    parser.add_argument("--study-kills", type=int, default=None,
                        help="kills of the study (default 3; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="a few kills of each kind")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the kill times")
    parser.add_argument("--window", type=float, default=6.0, metavar="SECONDS",
                        help="kill window after the work starts (default 6)")
    parser.add_argument("--data-root", default=os.path.join(REPO_ROOT, "data"),
                        help="data root of the study's embedded data (built if missing)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="keep the runs here (default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    runs = args.runs if args.runs is not None else 3 if args.quick else 10
    checkpoint_runs = args.checkpoint_runs if args.checkpoint_runs is not None else \
        4 if args.quick else 8
    study_kill_count = args.study_kills if args.study_kills is not None else \
        1 if args.quick else 3
    logging.getLogger("megatron.analysis").setLevel(logging.ERROR)
    rng = {kind: random.Random(args.seed if kind == "capture" else f"{args.seed}:{kind}")
           for kind in ("capture", "checkpoint", "study")}
    base = args.out or tempfile.mkdtemp(prefix="capture-kill-")
    os.makedirs(base, exist_ok=True)
    kills: List[Kill] = []
    start = time.monotonic()
    try:
        if "capture" in args.kinds:
            kills += capture_kills(base, runs, args.window, rng["capture"])
        if "checkpoint" in args.kinds:
            kills += checkpoint_kills(base, checkpoint_runs, args.window, rng["checkpoint"])
        if "study" in args.kinds:
            kills += study_kills(base, study_kill_count, args.data_root, rng["study"])
    finally:
        for pgid in list(_groups):
            end_group(pgid)
        if args.out is None:
            shutil.rmtree(base, ignore_errors=True)
    print_table(kills, args.kinds)
    print(f"\n{len(kills)} kills in {(time.monotonic() - start) / 60:.1f} min")
    return 0 if all(k.outcome == "intact" for k in kills) else 1


if __name__ == "__main__":
    sys.exit(main())
