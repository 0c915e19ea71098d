"""Wall time of each training iteration, for the benchmarks that time steps."""

import time

from megatron.training.training import TrainingCallback


class StepTimer(TrainingCallback):
    """times: {iteration: seconds}, in the order the iterations ran."""

    def __init__(self):
        self.times = {}
        self._start = None

    def on_iteration_start(self, iteration):
        self._start = time.perf_counter()

    def on_iteration_end(self, iteration):
        self.times[iteration] = time.perf_counter() - self._start

    def after(self, warmup: int):
        """Step times of the iterations after the first `warmup`."""
        return list(self.times.values())[warmup:]
