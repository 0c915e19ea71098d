"""Analysis of tensor captures: statistics, figures and an HTML report (docs/analysis.md).

Entry points: `analyze(Options(...))` (or the CLI tools/visualization/tensor_visualizer.py),
`load_record(path)` for one record file, `read_capture(dir, Problems())` for a manifest.
For notebooks: `load_frame(tensor_dir)` (one row per captured record, pandas) with
`load_tensors(rows)`, and `load_stats_frame(tensorboard_dir)` (the quantization telemetry
training writes to TensorBoard), with `load_scalars_frame` for the other scalars.
Submodules are imported lazily so that reading one record does not pull in matplotlib.
"""

from megatron.analysis.loading import Problems, load_record, read_capture  # noqa: F401

_LAZY = {
    "Options": "megatron.analysis.pipeline",
    "load_frame": "megatron.analysis.frames",
    "load_tensors": "megatron.analysis.frames",
    "load_stats_frame": "megatron.analysis.telemetry",
    "load_scalars_frame": "megatron.analysis.telemetry",
}


def analyze(options):
    """Run the whole analysis; see megatron.analysis.pipeline.analyze."""
    from megatron.analysis.pipeline import analyze as _analyze

    return _analyze(options)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
