"""Analysis of tensor captures: statistics, figures and an HTML report (docs/analysis.md).

Entry points: `analyze(Options(...))` (or the CLI tools/visualization/tensor_visualizer.py),
`load_record(path)` for one record file, `read_capture(dir, Problems())` for a manifest.
Submodules are imported lazily so that reading one record does not pull in matplotlib.
"""

from megatron.analysis.loading import Problems, load_record, read_capture  # noqa: F401


def analyze(options):
    """Run the whole analysis; see megatron.analysis.pipeline.analyze."""
    from megatron.analysis.pipeline import analyze as _analyze

    return _analyze(options)


def __getattr__(name):
    if name == "Options":
        from megatron.analysis.pipeline import Options

        return Options
    raise AttributeError(name)
