"""TensorRT on Jetson-class GPUs through ONNX Runtime's TensorRT execution provider.

Optimisation profiles derived from a bundle's manifest and a device profile, engine / timing caches keyed by the
GPU and the TensorRT version, the `build-engines`, `memory-plan` and `providers` commands. Nothing here imports
TensorRT: the provider options and trtexec command lines are plain data, so they are checked without a GPU.
"""
