"""Cost of checkpoint checksums: hashing seconds per GB, and a real save with and without.

    python benchmarks/checkpoint_checksum.py [--mb 384] [--rounds 15] [--vocab-size 8192]
                                             [--dir DIR] [--json out.json]

1. Hashing. A file of --mb MB of random bytes is written (and fsynced) in --dir (default: a
   temporary directory), then read back plainly (the floor: what any verification must pay
   to see the bytes) and hashed with the checkpoints' SHA-256 (`file_digest`), and for
   comparison with BLAKE2b and CRC-32. Each is the best of three passes, in seconds per GB
   (10^9 bytes). The file was just written, so it is read from the page cache, as at save
   time (the save hashes files it has just written); a --load from cold storage adds the
   read time of the storage, which the load pays anyway.
2. A real save. A llama-tiny training run (mock data, this process, world size 1) stops at
   its first save; there the same model and optimizer state are saved --rounds times with
   checksums and --rounds times without, alternating, each into a fresh directory (the
   whole save_checkpoint: dist_checkpointing.save, hashing, checksums.json, rename,
   tracker). Reported: best and median seconds of each and their ratios (the best is the
   robust figure on a shared machine: other processes only ever add time), the checksum
   step alone (hashing that checkpoint's files, best of 3) in seconds per GB, and the
   verification of one checkpoint at --load (checkpoint_to_load).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
import zlib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

GB = 1e9
CHUNK = 8 << 20


def _read_all(path, update=None):
    from megatron.training.checkpoint_files import file_chunks

    for chunk in file_chunks(path):
        if update is not None:
            update(chunk)


def _crc32(path):
    state = [0]

    def update(chunk):
        state[0] = zlib.crc32(chunk, state[0])
    _read_all(path, update)
    return state[0]


def _best_of(fn, passes=3):
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def hashing(directory: str, megabytes: int) -> dict:
    from megatron.training.checkpoint_files import file_digest

    path = os.path.join(directory, "checksum-bench.bin")
    block = os.urandom(CHUNK)
    with open(path, "wb") as f:
        for _ in range(max(1, megabytes * (1 << 20) // CHUNK)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    size = os.path.getsize(path)
    try:
        seconds = {
            "read only": _best_of(lambda: _read_all(path)),
            "sha256 (checkpoints)": _best_of(lambda: file_digest(path)),
            "blake2b": _best_of(lambda: _read_all(path, hashlib.blake2b().update)),
            "crc32": _best_of(lambda: _crc32(path)),
        }
    finally:
        os.remove(path)
    return {"bytes": size, "s_per_gb": {k: v * GB / size for k, v in seconds.items()}}


def _train(pretrain, pretrain_gpt, argv):
    result = pretrain(pretrain_gpt.forward_step, argv)
    assert result.exit_code == 0, result.exit_reason


def saves(directory: str, rounds: int, vocab_size: int) -> dict:
    with warnings.catch_warnings():           # megatron-core's fallback notices
        warnings.simplefilter("ignore")
        import pretrain_gpt
        from megatron.training import checkpointing
        from megatron.training.checkpoint_files import digest_files, list_files
        from megatron.training.training import pretrain

    timings = {"with checksums": [], "without checksums": []}
    found = {}
    real_save = checkpointing.save_checkpoint

    def benchmark_then_save(root, iteration, *args, **kwargs):
        quiet = dict(kwargs, log=lambda *_: None)
        for r in range(rounds):
            order = [True, False] if r % 2 == 0 else [False, True]
            for checksums in order:
                target = os.path.join(directory, f"save-{r}-{int(checksums)}")
                start = time.perf_counter()
                real_save(target, iteration, *args, checksums=checksums, **quiet)
                elapsed = time.perf_counter() - start
                timings["with checksums" if checksums else "without checksums"].append(elapsed)
                if checksums and "bytes" not in found:
                    ckpt = checkpointing.checkpoint_dir(target, iteration)
                    found["bytes"] = sum(os.path.getsize(os.path.join(ckpt, n))
                                         for n in list_files(ckpt))
                    start = time.perf_counter()
                    checkpointing.checkpoint_to_load(target, log=lambda *_: None)
                    found["verify_s"] = time.perf_counter() - start
                    names = list_files(ckpt)
                    found["read_s"] = _best_of(
                        lambda: [_read_all(os.path.join(ckpt, n)) for n in names])
                    found["hash_s"] = _best_of(lambda: digest_files(ckpt, names))
                else:
                    shutil.rmtree(target, ignore_errors=True)
        return real_save(root, iteration, *args, **kwargs)

    checkpointing.save_checkpoint = benchmark_then_save
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _train(pretrain, pretrain_gpt, [
                "--model-preset", "llama-tiny", "--micro-batch-size", "1",
                "--global-batch-size", "1", "--seq-length", "64", "--mock-data",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab_size),
                "--lr", "3e-4", "--train-iters", "1", "--log-interval", "1000",
                "--eval-interval", "100000", "--eval-iters", "0", "--num-workers", "0",
                "--save", os.path.join(directory, "run")])
    finally:
        checkpointing.save_checkpoint = real_save
    medians = {k: statistics.median(v) for k, v in timings.items()}
    best = {k: min(v) for k, v in timings.items()}
    return {"checkpoint_bytes": found["bytes"], "rounds": rounds, "seconds": timings,
            "median_s": medians, "best_s": best,
            "ratio_median": medians["with checksums"] / medians["without checksums"],
            "ratio_best": best["with checksums"] / best["without checksums"],
            "hash_s": found["hash_s"], "hash_s_per_gb": found["hash_s"] * GB / found["bytes"],
            "verify_at_load_s": found["verify_s"], "plain_read_s": found["read_s"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=384, help="size of the hashed file (MB)")
    parser.add_argument("--rounds", type=int, default=15, help="saves of each kind")
    parser.add_argument("--vocab-size", type=int, default=8192,
                        help="llama-tiny's vocabulary (sets the checkpoint size)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)

    directory = tempfile.mkdtemp(prefix="ckpt-checksum-", dir=args.dir)
    try:
        hashed = hashing(directory, args.mb)
        print(f"hashing a {hashed['bytes'] / GB:.2f} GB file (page cache), best of 3, on "
              f"{os.cpu_count()} cores:")
        floor = hashed["s_per_gb"]["read only"]
        for name, value in hashed["s_per_gb"].items():
            print(f"  {name:22s} {value:6.3f} s/GB  ({value / floor:5.2f}x reading)")
        saved = saves(directory, args.rounds, args.vocab_size)
        print(f"save_checkpoint of llama-tiny (vocab {args.vocab_size}, model + Adam state, "
              f"{saved['checkpoint_bytes'] / 1e6:.1f} MB), {args.rounds} of each, alternating:")
        for kind in ("without checksums", "with checksums"):
            print(f"  {kind:18s} best {saved['best_s'][kind]:6.3f} s   median "
                  f"{saved['median_s'][kind]:6.3f} s")
        print(f"  ratio with/without: best {saved['ratio_best']:.2f}x, median "
              f"{saved['ratio_median']:.2f}x")
        print(f"  the checksum step alone (hashing the checkpoint's files, best of 3): "
              f"{saved['hash_s']:.3f} s = {saved['hash_s_per_gb']:.2f} s/GB of checkpoint, "
              f"{saved['hash_s'] / saved['best_s']['without checksums']:.0%} of the best save "
              "without checksums")
        print(f"--load verification of that checkpoint (structure + checksums): "
              f"{saved['verify_at_load_s']:.3f} s (reading its files plainly: "
              f"{saved['plain_read_s']:.3f} s)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"hashing": hashed, "save": saved}, f, indent=1)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
