"""FP8 with float32 scales: per-tensor (current or delayed scaling) and blockwise. (in progress)"""
FP8_SCALINGS = ("tensor", "block")


def _check_fp8_options(x, scaling, margin, pow2_scale, block):
    raise NotImplementedError("fp8 formats are being implemented")


def _fp8_fake_quantize(x, fmt, axis, scaling, amax, margin, pow2_scale, block, noise):
    raise NotImplementedError("fp8 formats are being implemented")
