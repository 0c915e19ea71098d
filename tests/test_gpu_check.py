"""`make gpu-check` without a GPU: the stage runner survives a failing and a hanging stage, the
summary is written, kernel names are classified, and benchmarks/gpu_throughput.py times each
scheme in its own process with the ratio and the profile breakdown (llama-tiny on the CPU)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, child_env

BENCH_DIR = os.path.join(REPO_ROOT, "benchmarks")
sys.path.insert(0, BENCH_DIR)

import gpu_check  # noqa: E402
import gpu_throughput  # noqa: E402


def _python(code):
    return lambda limit, out: [sys.executable, "-c", code]


def _fake_stages():
    return [
        gpu_check.Stage("fails", "exits 3", _python("print('boom'); import sys; sys.exit(3)"),
                        weight=1, needs_cuda=False),
        gpu_check.Stage("hangs", "sleeps past its limit",
                        _python("import time; print('waiting', flush=True); time.sleep(60)"),
                        weight=1, needs_cuda=False, limit_s=1),
        gpu_check.Stage("works", "prints", _python("print('done')"), weight=1, needs_cuda=False),
        gpu_check.Stage("cuda", "needs a GPU", _python("pass"), weight=1, needs_cuda=True),
    ]


def test_a_failing_and_a_hanging_stage_are_reported_and_the_next_still_runs(tmp_path):
    results = gpu_check.run_stages(_fake_stages(), 60, str(tmp_path), cuda=None,
                                   echo=lambda *a, **k: None)
    status = {r.stage.name: r.status for r in results}
    assert status == {"fails": "failed (exit 3)", "hangs": "timed out", "works": "passed",
                      "cuda": "skipped: needs CUDA (no CUDA device here)"}
    hung = results[1]
    assert hung.limit_s == 1 and hung.seconds < 10
    assert "waiting" in gpu_check.tail(hung.log)
    assert gpu_check.tail(results[2].log) == "done"
    assert [r.failed for r in results] == [True, True, False, False]


def test_check_writes_the_summary_and_fails_with_a_failed_stage(tmp_path, capsys):
    status = gpu_check.check(_fake_stages(), 60, str(tmp_path))
    text = (tmp_path / "summary.md").read_text()
    assert status == 1
    assert "| fails | failed (exit 3) |" in text and "| hangs | timed out |" in text
    assert "## fails: failed (exit 3) (end of its log)" in text and "boom" in text
    assert "| works | passed |" in text
    assert text in capsys.readouterr().out


def test_a_stage_left_without_time_is_not_run(tmp_path):
    stages = _fake_stages()[2:3]
    results = gpu_check.run_stages(stages, 0.5, str(tmp_path), cuda=None,
                                   echo=lambda *a, **k: None)
    assert results[0].status.startswith("not run") and results[0].failed


def test_without_cuda_every_stage_says_so_and_the_summary_is_written(tmp_path, capsys):
    # conftest hides the GPUs from the suite, so the probe finds none even on a GPU node.
    assert gpu_check.main(["--out-dir", str(tmp_path)]) == 0
    text = (tmp_path / "summary.md").read_text()
    for stage in ("tests", "throughput", "qdq", "attention"):
        assert f"| {stage} | skipped: needs CUDA (no CUDA device here) |" in text
    assert "| linear_mxfp8 step x bf16 (auto) | - | <= 1.10x | not measured |" in text
    assert "| attention kernels fwd+bwd x SDPA, seq 8192, d 128 | - | <= 4x | not measured |" \
        in text
    assert "no CUDA device" in capsys.readouterr().out


def test_the_dry_run_plan_fits_the_budget(capsys):
    assert gpu_check.main(["--dry-run", "--budget-s", "480"]) == 0
    out = capsys.readouterr().out
    limits = [float(line.split("up to")[1].split()[0]) for line in out.splitlines()
              if "up to" in line]
    assert len(limits) == 4 and sum(limits) <= 480
    assert "gpu_throughput.py" in out and "--attention-json" in out


def test_figures_read_the_stages_outputs(tmp_path):
    (tmp_path / "tests.log").write_text("....F\n1 failed, 87 passed, 2 skipped in 93.21s\n")
    rows = gpu_check.qdq_rows("bfloat16", 64_000_000, {"copy_": 0.08, "triton mxfp4": 0.1})
    (tmp_path / "qdq.json").write_text(json.dumps({"size": 8, "rows": rows}))
    tests = gpu_check._test_figures(str(tmp_path))
    assert tests[0].value == "1 failed, 87 passed, 2 skipped" and tests[0].verdict == "FAIL"
    qdq = {f.name: f for f in gpu_check._qdq_figures(str(tmp_path))}
    assert qdq["QDQ mxfp4 bfloat16"].verdict == "pass"          # 80% of the copy's 1600 GB/s
    assert "80% of copy (1600 GB/s)" in qdq["QDQ mxfp4 bfloat16"].value
    assert qdq["QDQ mxfp4 float32"].verdict == "not measured"


@pytest.mark.parametrize("name,label", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_NNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn>", "gemm"),
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn", "gemm"),
    ("aten::mm", "gemm"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_params>",
     "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80", "attention"),
    ("_forward_kernel", "attention"),
    ("_backward_key_kernel", "attention"),
    ("_backward_query_kernel", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("mx_qdq_kernel", "quantization"),
    ("nvfp4_qdq_kernel", "quantization"),
    ("hifp8_qdq_kernel", "quantization"),
    ("fp8_tensor_kernel", "quantization"),
    ("fp8_block_kernel", "quantization"),
    ("amax_kernel", "quantization"),
    ("aten::amax", "quantization"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
     "other"),
    ("Memcpy DtoD (Device -> Device)", "other"),
    ("triton_poi_fused_mul_0", "other"),
    ("_QuantizedLinearBackward", "other"),
])
def test_kernel_names_are_classified(name, label):
    assert gpu_throughput.kernel_class(name) == label


def test_a_failing_run_is_a_row_and_the_next_run_still_happens(tmp_path, monkeypatch):
    row = {"scheme": "linear_mxfp8", "mode": "auto", "ms": 12.0, "tokens_per_s": 1.0,
           "peak_gib": 0.0, "breakdown": dict.fromkeys(gpu_throughput.CLASSES, 1.0)}

    def command(scheme, mode, json_path, args):
        if scheme == "bf16":
            return [sys.executable, "-c", "print('CUDA out of memory'); raise SystemExit(4)"]
        return [sys.executable, "-c", f"import json; json.dump({row!r}, open({json_path!r}, 'w'))"]

    monkeypatch.setattr(gpu_throughput, "_child_command", command)
    args = gpu_throughput.parse(["--schemes", "bf16", "linear_mxfp8", "--log-dir",
                                 str(tmp_path), "--json", str(tmp_path / "rows.json")])
    rows = gpu_throughput.run_all(args)
    assert rows[0]["error"] == "exit 4: CUDA out of memory"
    assert rows[1]["ms"] == 12.0 and rows[1]["ratio"] is None      # no bf16 step to divide by
    table = gpu_throughput.markdown(rows)
    assert "| bf16 | auto | - | - |" in table and "error: exit 4" in table
    assert len(json.loads((tmp_path / "rows.json").read_text())["rows"]) == 2


def test_tiny_throughput_times_each_scheme_in_its_own_process(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH_DIR, "gpu_throughput.py"), "--tiny", "--num-layers",
         "1", "--iters", "1", "--warmup", "1", "--schemes", "bf16", "linear_mxfp8", "--json",
         str(out)], capture_output=True, text=True, env=child_env(), timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["scheme"], r["mode"]) for r in rows] == [("bf16", "auto"),
                                                       ("linear_mxfp8", "auto")]
    assert len({r["pid"] for r in rows}) == 2            # one process per run
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio"] > 0
    for row in rows:
        assert row["error"] is None and row["model"].startswith("llama-tiny, 1 layers")
        assert row["breakdown_of"] == "CPU self time of ops"
        assert set(row["breakdown"]) == set(gpu_throughput.CLASSES)
        assert row["breakdown"]["gemm"] > 0 and row["breakdown"]["attention"] > 0
    assert "| scheme | mode | ms/step | x bf16 |" in proc.stdout
    assert "| linear_mxfp8 | auto |" in proc.stdout and "<= 1.10x" in proc.stdout
