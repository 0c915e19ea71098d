"""NVFP4 (in progress)."""


def _nvfp4_fake_quantize(x, axis, block_2d, noise, amax):
    raise NotImplementedError("nvfp4 is being implemented")
