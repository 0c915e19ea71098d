"""The small-vocabulary tokenizer, the BPE variant of the embedded data, and tools/study.py.

A tiny study (2 schemes x 2 seeds, a few iterations of a small model on the BPE-tokenized
Wikipedia data) is checked against the study.json schema, its paired intervals against a
direct computation with Student's t from the printed table, its figure, and the reuse of
finished runs by a second invocation.
"""

import json
import math
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron.analysis import study as study_stats
from megatron.training import bpe_tokenizer, corpora, train_tokenizer
from megatron.training.study import parse_scheme_spec
from megatron.training.tokenizer import HuggingFaceTokenizer

from conftest import REPO_ROOT

VOCAB = 1024
# t(0.975) for 1 and 2 degrees of freedom, from the standard table (to 9 decimals).
T_975 = {1: 12.706204736, 2: 4.302652730}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    corpora.ensure_bpe_dataset("wikipedia", VOCAB, root, log=lambda m: None)
    return root


def _texts(root, n):
    return list(bpe_tokenizer.read_jsonl_texts(root / "wikipedia" / "wikipedia.jsonl"))[:n]


def test_bpe_training_is_deterministic(data_root, tmp_path):
    texts = _texts(data_root, 400)
    first = bpe_tokenizer.train_bpe(texts, 600).to_str()
    second = bpe_tokenizer.train_bpe(list(texts), 600).to_str()
    assert first == second
    # The command line gives byte-identical files too.
    sample = tmp_path / "sample.jsonl"
    sample.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    outputs = []
    for name in ("a", "b"):
        assert train_tokenizer.main(["--input", str(sample), "--vocab-size", "600",
                                     "--output", str(tmp_path / name)]) == 0
        outputs.append((tmp_path / name / "tokenizer.json").read_bytes())
    assert outputs[0] == outputs[1]
    vocab = json.loads(outputs[0])["model"]["vocab"]
    assert len(vocab) == 600                  # 2 specials + 256 byte symbols + 342 merges
    assert vocab["<|begin_of_text|>"] == 0 and vocab["<|end_of_text|>"] == 1
    assert len(json.loads(outputs[0])["model"]["merges"]) == 600 - 258


def test_bpe_tokenizer_round_trips_and_has_every_byte(data_root):
    tok = HuggingFaceTokenizer(corpora.bpe_tokenizer_path("wikipedia", VOCAB, data_root))
    assert tok.vocab_size == VOCAB
    assert tok.eod == tok._tk.token_to_id("<|end_of_text|>")
    text = "The capital of France is Paris. Ünïcödé 😀 \t\n x=1;"
    ids = tok.tokenize(text)
    assert tok.detokenize(ids) == text
    assert max(ids) < VOCAB and tok.eod not in ids
    assert len(tok.tokenize("the the the the")) < len("the the the the")


def test_bpe_dataset_holds_the_same_documents(data_root):
    prefix = corpora.bpe_data_prefix("wikipedia", VOCAB, data_root)
    meta = json.loads((data_root / f"wikipedia-bpe{VOCAB}" / "sources.json").read_text())
    base = json.loads((data_root / "wikipedia" / "sources.json").read_text())
    assert meta["documents"] == base["documents"]
    assert meta["tokenizer"]["vocab_size"] == VOCAB
    tokens = np.fromfile(prefix + ".bin", dtype=np.uint16)
    assert len(tokens) == meta["tokens"]
    # The first document, tokenized independently, then the end-of-document id.
    tok = HuggingFaceTokenizer(corpora.bpe_tokenizer_path("wikipedia", VOCAB, data_root))
    first = tok.tokenize(_texts(data_root, 1)[0]) + [tok.eod]
    assert tokens[:len(first)].tolist() == first
    # Rebuilt on demand only: a second ensure does not rebuild.
    stamp = (data_root / f"wikipedia-bpe{VOCAB}" / "sources.json").stat().st_mtime_ns
    corpora.ensure_bpe_dataset("wikipedia", VOCAB, data_root, log=lambda m: None)
    assert (data_root / f"wikipedia-bpe{VOCAB}" / "sources.json").stat().st_mtime_ns == stamp


def test_bpe_vocab_size_errors():
    with pytest.raises(ValueError, match="too small.*>= 258"):
        bpe_tokenizer.check_vocab_size(100)


def test_scheme_specs():
    assert parse_scheme_spec("FA_linear_mxfp4").label == "FA_linear_mxfp4"
    spec = parse_scheme_spec("scaled=FA_linear_hifp8 --hifp8-scaling tensor")
    assert (spec.label, spec.scheme, spec.flags) == ("scaled", "FA_linear_hifp8",
                                                      ("--hifp8-scaling", "tensor"))
    with pytest.raises(ValueError, match="'mxfp9' is not a scheme"):
        parse_scheme_spec("x=mxfp9")


def test_paired_gap_against_a_direct_computation():
    base = {1: 5.0, 2: 5.2, 3: 4.9}
    scheme = {1: 5.1, 2: 5.25, 3: 5.0, 4: 9.9}        # seed 4 has no baseline: not paired
    gap = study_stats.paired_gap(base, scheme)
    d = np.array([100 * (scheme[s] - base[s]) / base[s] for s in (1, 2, 3)])
    half = T_975[2] * d.std(ddof=1) / math.sqrt(3)
    assert gap["seeds"] == [1, 2, 3]
    assert gap["mean"] == pytest.approx(d.mean())
    assert gap["ci95"] == pytest.approx([d.mean() - half, d.mean() + half], rel=1e-8)
    assert gap["verdict"] == "worse"                   # every seed worse, interval above 0
    noisy = study_stats.paired_gap(base, {1: 5.2, 2: 5.0, 3: 4.95})
    assert noisy["ci95"][0] < 0 < noisy["ci95"][1] and noisy["verdict"] == "within noise"
    assert study_stats.paired_gap(base, {1: 4.0})["verdict"] == "insufficient seeds"


def _study(data_root, out, *extra):
    cmd = [sys.executable, f"{REPO_ROOT}/tools/study.py", "--output-dir", str(out),
           "--data-root", str(data_root), "--tokenizer", f"bpe{VOCAB}",
           "--schemes", "bf16", "mx4=linear_mxfp4 --quant-skip-layers 1",
           "--seeds", "2", "--train-iters", "4", "--evals", "2", "--eval-iters", "2",
           "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "2",
           *extra, "--", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size",
           "128", "--num-attention-heads", "2", "--num-query-groups", "1"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=out.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, time.perf_counter() - start


def test_tiny_study_end_to_end(data_root, tmp_path):
    out = tmp_path / "study"
    log, _ = _study(data_root, out)
    assert "run 4/4" in log and "ETA" in log
    assert "[study] caveat: 2 seed(s) of 4 iterations" in log        # a small study says so
    study = json.loads((out / "study.json").read_text())
    assert study["baseline"] == "bf16"
    assert study["budget"]["train_iters"] == 4 and study["budget"]["tokens"] == 4 * 2 * 64
    assert {"model", "tokenizer"} <= set(study["budget"])
    assert len(study["runs"]) == 4
    for run in study["runs"]:
        assert set(run) >= {"scheme", "seed", "final_val_loss", "log", "status"}
        assert run["status"] == "done" and math.isfinite(run["final_val_loss"])
        # The value is the log's last validation line, at the end of training.
        lines = [l for l in open(run["log"]) if "validation loss at iteration" in l]
        assert "iteration 4 |" in lines[-1] and f"{run['final_val_loss']:.6E}" in lines[-1]
        assert "precision: bf16 run (--bf16)" in open(run["log"]).read()
    schemes = study["schemes"]
    assert list(schemes) == ["bf16", "mx4"] and "gap_vs_baseline_pct" not in schemes["bf16"]
    finals = {(r["scheme"], r["seed"]): r["final_val_loss"] for r in study["runs"]}
    for name, entry in schemes.items():
        values = [finals[(name, s)] for s in (1, 2)]
        assert entry["seeds"] == [1, 2] and entry["final_val_loss"] == values
        assert entry["mean"] == pytest.approx(np.mean(values))
        assert entry["std"] == pytest.approx(np.std(values, ddof=1))
    d = np.array([100 * (finals[("mx4", s)] - finals[("bf16", s)]) / finals[("bf16", s)]
                  for s in (1, 2)])
    gap = schemes["mx4"]["gap_vs_baseline_pct"]
    half = T_975[1] * d.std(ddof=1) / math.sqrt(2)
    assert gap["mean"] == pytest.approx(d.mean())
    assert gap["ci95"] == pytest.approx([d.mean() - half, d.mean() + half], rel=1e-8)
    low, high = gap["ci95"]
    assert schemes["mx4"]["verdict"] == ("worse" if low > 0 else "better" if high < 0
                                         else "within noise")
    png = (out / "study.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "| mx4 | 2 |" in (out / "study.md").read_text()
    assert "<table>" in (out / "study.html").read_text()

    # The analysis report renders it as a section (table, notes, figure).
    report = tmp_path / "report"
    proc = subprocess.run([sys.executable, f"{REPO_ROOT}/tools/visualization/tensor_visualizer.py",
                           "--study", str(out / "study.json"), "--output-dir", str(report),
                           "--no-progress"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    html_text = (report / "report.html").read_text()
    assert "Scheme study over seeds" in html_text and "<td>mx4</td>" in html_text
    assert "Noise floor" in html_text and "<figure id='study_curves'>" in html_text
    assert (report / "figures" / "study_curves.png").read_bytes() == png
    text = (report / "statistics.txt").read_text()
    assert "== Scheme study over seeds (tools/study.py) ==" in text
    assert json.loads((report / "statistics.json").read_text())["study"]["schemes"] == schemes
    broken = tmp_path / "broken.json"
    broken.write_text('{"runs": []}')
    proc = subprocess.run([sys.executable, f"{REPO_ROOT}/tools/visualization/tensor_visualizer.py",
                           "--study", str(broken), "--output-dir", str(report)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: --study {broken}: not a study.json (no 'baseline' str; tools/study.py "
        "writes one)"]

    # A second invocation reuses every run and writes the same study.
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/seed*/result.json")}
    log, seconds = _study(data_root, out)
    assert "reusing 4 finished run(s)" in log and "[study] start" not in log
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/seed*/result.json")} == stamps
    assert json.loads((out / "study.json").read_text())["schemes"] == schemes


def test_gpu_recipe_dry_run(capsys):
    from megatron.training.study import main
    assert main(["--dry-run", "--pretrain-script", f"{REPO_ROOT}/pretrain_gpt.py",
                 "--model-preset", "llama32-1b", "--tokenizer", "llama3", "--data-path",
                 "/data/corpus_text_document", "--launcher",
                 "torchrun --standalone --nproc-per-node 8", "--tokens", "2000000000",
                 "--seq-length", "4096", "--global-batch-size", "256", "--schemes", "bf16",
                 "FA_linear_mxfp4", "--seeds", "3", "--", "--num-workers", "2"]) == 0
    commands = capsys.readouterr().out.splitlines()
    assert len(commands) == 6
    first = commands[0].split()
    assert first[:4] == ["torchrun", "--standalone", "--nproc-per-node", "8"]
    assert "--bf16" in first and first[-2:] == ["--num-workers", "2"]
    assert first[first.index("--train-iters") + 1] == str(math.ceil(2e9 / (256 * 4096)))
    assert [c.split()[c.split().index("--seed") + 1] for c in commands] == \
        ["1", "1", "2", "2", "3", "3"]


def test_sigterm_ends_the_trainings_and_says_how_to_resume(data_root, tmp_path):
    """SIGTERM to the study: its running trainings end with it (no orphan keeps writing into a
    run a restarted study reuses), one line says where to resume, exit status 143."""
    import psutil
    import signal

    out = tmp_path / "study"
    cmd = [sys.executable, f"{REPO_ROOT}/tools/study.py", "--output-dir", str(out),
           "--data-root", str(data_root), "--tokenizer", f"bpe{VOCAB}", "--schemes", "bf16",
           "--seeds", "2", "--train-iters", "400", "--seq-length", "64", "--micro-batch-size",
           "2", "--global-batch-size", "2", "--jobs", "1", "--", "--num-layers", "2",
           "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "2",
           "--num-query-groups", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:                  # wait until a training has started
        lines.append(line)
        if "[study] start" in line:
            break
    children, deadline = [], time.time() + 30   # the line is logged just before the start
    while not children and time.time() < deadline:
        time.sleep(0.2)
        children = psutil.Process(proc.pid).children(recursive=True)
    assert children
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 143
    assert "[study] stopped by SIGTERM after 0 of 2 run(s); ended bf16 seed 1" in rest
    assert "run the same command again to resume" in rest and "Traceback" not in rest
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive
    assert not (out / "runs" / "bf16" / "seed1" / "result.json").exists()


def test_one_study_per_output_directory(tmp_path):
    """A second study on the same --output-dir stops with one line naming the first (which
    holds the directory's lock), before it starts any training."""
    from megatron.training import run_lock

    out = tmp_path / "study"
    holder = run_lock.acquire(str(out), "--output-dir", command="tools/study.py (the first)")
    try:
        proc = subprocess.run([sys.executable, f"{REPO_ROOT}/tools/study.py", "--output-dir",
                               str(out), "--dataset", "wikipedia", "--data-root",
                               str(tmp_path / "data"), "--seeds", "1", "--train-iters", "2"],
                              capture_output=True, text=True, timeout=300)
    finally:
        holder.release()
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --output-dir {out} is in use by "
                                                   "another run (pid "), proc.stderr
    assert "tools/study.py (the first)" in lines[0] and "[study] start" not in proc.stdout
