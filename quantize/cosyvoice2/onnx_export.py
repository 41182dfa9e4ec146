"""The one way the build host traces a torch module into an ONNX graph (every family, every stage: CosyVoice3's
exports import it from here, as they import CosyVoice2's graph wrappers).

TorchScript exporter (no onnxscript needed), opset 17, constant folding, the exporter's deprecation and tracer
notices silenced; then, when asked, one pass over the saved model: an `edit` of the graph and its
`metadata_props`. The graph contracts themselves (signatures, example shapes, dynamic axes) stay with each
stage's export module.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import nn

ONNX_OPSET = 17


def trace_to_onnx(graph: nn.Module, args: tuple[Any, ...], path: Path, inputs: Sequence[str], outputs: Sequence[str],
                  axes: dict[str, dict[int, str]], metadata: dict[str, str] | None = None,
                  edit: Callable[[onnx.ModelProto], None] | None = None) -> Path:
    """Write `graph` traced on `args` to `path`; `edit` (in place) then `metadata` are applied to the saved file."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer notices
        torch.onnx.export(graph, args, str(path), dynamo=False, opset_version=ONNX_OPSET, input_names=list(inputs),
                          output_names=list(outputs), dynamic_axes=axes, do_constant_folding=True)
    if edit is not None or metadata is not None:
        model = onnx.load(str(path))
        if edit is not None:
            edit(model)
        if metadata is not None:
            onnx.helper.set_model_props(model, metadata)
        onnx.save(model, str(path))
    return path
