"""The QDQ kernels' launch configuration: a fixed one under Triton's interpreter, triton's
autotuner over the work per program and the warps on a GPU (no kernel runs here: the
launches are recorded)."""

from megatron.quantization.kernels import tuning


class Recorded:
    """A stand-in kernel: records the grid and the keywords of each launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def test_the_interpreter_runs_the_first_size_untuned(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = Recorded()
    tuning.launch(kernel, "GROUP_", [64, 32, 128], lambda g: 1000 // g, ("x",), key=("n",),
                  LAYOUT=2)
    assert kernel.launches == [((15,), ("x",), {"GROUP_": 64, "LAYOUT": 2})]


def test_a_gpu_launch_goes_through_the_autotuner_with_a_grid_per_configuration(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tuned = Recorded()
    made = []

    def autotuned(kernel, meta, sizes, key):
        made.append((kernel, meta, sizes, key))
        return tuned
    monkeypatch.setattr(tuning, "_autotuned", autotuned)
    kernel = object()
    tuning.launch(kernel, "BLOCK_", [2048, 1024], lambda b: -(-5000 // b), ("x", "y"),
                  key=("numel", "STOCHASTIC"), STOCHASTIC=True)
    assert made == [(kernel, "BLOCK_", (2048, 1024), ("numel", "STOCHASTIC"))]
    ((grid, args, kwargs),) = tuned.launches
    assert args == ("x", "y") and kwargs == {"STOCHASTIC": True}     # the tuned size is not
    assert grid({"BLOCK_": 1024}) == (5,) and grid({"BLOCK_": 2048}) == (3,)   # passed twice


def test_the_autotuner_tries_every_size_with_every_warp_count(monkeypatch):
    from megatron.quantization.kernels.mx import mx_qdq_kernel
    tuned = tuning._autotuned(mx_qdq_kernel, "GROUP_", (64, 32), ("n_blocks", "LAYOUT"))
    assert tuned is tuning._autotuned(mx_qdq_kernel, "GROUP_", (64, 32), ("n_blocks", "LAYOUT"))
    assert sorted((c.kwargs["GROUP_"], c.num_warps) for c in tuned.configs) == [
        (32, 4), (32, 8), (64, 4), (64, 8)]
    assert list(tuned.keys) == ["n_blocks", "LAYOUT"]
    # Each configuration is timed briefly (the first step of a run pays for the tuning).
    timed = []
    monkeypatch.setattr(tuning.triton.testing, "do_bench",
                        lambda fn, **kw: timed.append(kw) or [1.0, 1.0, 1.0])
    tuning._quick_bench(lambda: None, quantiles=(0.5, 0.2, 0.8))
    assert timed == [dict(warmup=5, rep=20, quantiles=(0.5, 0.2, 0.8))]


def test_the_launch_shapes_of_runs_and_tiles():
    from megatron.quantization.kernels.bits import COLUMNS, FLAT
    args, layout, groups, programs = tuning.axis_launch((6, 256), 1, 32)
    assert args == (48, 256, 1, 8) and layout == FLAT and groups == [64, 32, 128, 256]
    assert programs(64) == 1 and programs(32) == 2
    args, layout, groups, programs = tuning.axis_launch((256, 96), 0, 32)
    assert layout == COLUMNS and programs(32) == 8 * 3      # 8 block-rows x 3 column groups
    args, _, groups, programs = tuning.tile_launch((40, 70), 16)    # 3 x 5 tiles of 16x16
    assert args == (15, 40, 70, 5) and groups == [8, 4, 16, 32] and programs(8) == 2
    assert tuning.tile_launch((200, 150), 128)[2] == [1]              # one 128x128 tile each
