"""Capture of the tensors that flow through attention and linear GEMMs.

See docs/capture-format.md for the files written and megatron.tensor_capture.load for reading
them back.
"""
