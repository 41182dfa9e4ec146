"""Building the precision targets of a `cosyvoice2` bundle: each stage walks its precision ladder under the gates.

A quantized stage ships only when it passes its quality gate against fp32 on identical inputs and noise (gates.py).
A miss fails the build naming target and stage, unless the caller allows fallback: then the stage keeps the next
rung of its ladder and the manifest says so (`fallback_from`, `fallback_reason`), so a bundle never holds a
silently degraded stage. What each target and rung means is in precision_targets.py, the graph transforms in
precision_transforms.py; layout and manifest keys in docs/bundle_cosyvoice2.md, "Precision targets".
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from cosyedge.device.bundle import TARGETS
from cosyedge.device.sessions import return_freed_memory
from cosyedge.quantize.cosyvoice2.precision_targets import (CPU_LLM_METHOD, CPU_TARGETS, CV2_RULES, LADDERS,
                                                            OPTIONAL_INT8, RUNG_ORDER, STAGE_GRAPHS, GraphRules,
                                                            Variant, build_variant, stage_variants, uncalibrated)


@dataclass
class TargetBuild:
    """What `build_targets` adds to a bundle: graph files per component and the manifest entries."""
    files: dict[tuple[str, str], Path]                 # (component, precision) -> written graph (fp32 excluded)
    targets: dict[str, dict]                           # manifest.config["targets"]
    quality: dict[str, dict]                           # manifest.quality


def build_targets(targets: Sequence[str], fp32: dict[str, Path], work: Path, gate_config, allow_fallback: bool = False,
                  cpu_llm_method: str = CPU_LLM_METHOD, log: Callable[[str], None] = lambda _: None,
                  rules: GraphRules = CV2_RULES, gates=None) -> TargetBuild:
    """Build every target's graphs from the fp32 exports in `fp32` (graph -> path) into `work` and gate each stage.

    A stage that misses its gate raises ReleaseError naming target and stage, unless `allow_fallback`: then the stage
    moves down its ladder (int8 -> fp16 -> fp32 for trt-int8, int8 -> fp32 for cpu, the LLM int4 -> int4-b32 -> int8 ->
    fp32 for cpu-int4, fp16 -> fp32 for gpu-fp16) and the manifest records `fallback_from`. The cpu HiFT decoder is
    int8 only when it passes (fp32 otherwise, no error). Graphs two targets share (cpu and cpu-int4 flow / HiFT) are
    built and gated once.
    After the stages, the end-to-end gate (flow + HiFT from the same tokens) must pass as well; with
    `allow_fallback` the lower-precision of flow / HiFT (the flow on a tie) moves up one rung until it does.
    Graphs of rejected attempts are deleted from `work`. Another family passes its node-name `rules` and its
    `gates` (a gates.Gates whose graph feeds fit its signatures; default: CosyVoice2's over `gate_config`).
    """
    from cosyedge.device.errors import ReleaseError
    from cosyedge.quantize.cosyvoice2.gates import Gates

    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ReleaseError(f"unknown precision target {unknown[0]!r}; known: {', '.join(TARGETS)}")
    gates = gates or Gates(gate_config, fp32)
    built: dict[Variant, Path] = {}
    calibration: dict[str, list] = {}
    checked: dict[tuple, object] = {}   # (stage, precision, graph files) -> gates.StageReport

    def check(stage: str, graphs: dict[str, Path], precision: str):
        key = (stage, precision, tuple(sorted(graphs.items())))
        if key not in checked:
            checked[key] = gates.check(stage, graphs, precision)
        return checked[key]

    def calibration_for(graph: str) -> list:
        if graph not in calibration:
            log(f"recording calibration inputs of {graph} from fp32 runs")
            if graph in STAGE_GRAPHS["llm"]:
                calibration.update(gates.llm_calibration())
            else:
                calibration["flow_estimator"], mels = gates.flow_calibration()
                calibration["hift_decoder"] = gates.hift_calibration(mels)
        return calibration.get(graph, [])

    def path_of(v: Variant) -> Path:
        if v.precision == "fp32":
            return fp32[v.graph]
        if v not in built:
            log(f"building {v.work_name}")
            needs = v.precision == "int8" and not (v.component == v.graph and uncalibrated(v.graph, rules))
            built[v] = build_variant(v, fp32[v.graph], work / v.work_name,
                                     calibration_for(v.graph) if needs else None, cpu_llm_method, rules)
            gc.collect()  # the protobuf / numpy buffers of a 1.4 GB graph (RSS grew past 8 GB over two LLM graphs)
            return_freed_memory()
        return built[v]

    config: dict[str, dict] = {}
    quality: dict[str, dict] = {}
    used: set[Variant] = set()
    for target in targets:
        stages: dict[str, str] = {}
        report: dict[str, dict] = {}

        def settle(stage: str, start: int, reason: str | None = None) -> None:
            """Walk the stage's ladder from rank `start` until a precision passes its stage gate (fp32 always does)."""
            ladder = LADDERS[target][stage]
            entry = report.setdefault(stage, {"precision": ladder[0], "attempts": [], "fallback_from": None})
            for rank in range(start, len(ladder)):
                precision = ladder[rank]
                if precision != "fp32":
                    graphs = {v.graph: path_of(v) for v in stage_variants(target, stage, precision, rules)}
                    result = check(stage, graphs, precision)
                    gates.forget(p for g, p in graphs.items() if p != fp32[g])   # full-size sessions are large
                    gc.collect()
                    return_freed_memory()
                    entry["attempts"].append(result.as_dict())
                    log(f"{target} {stage} {precision}: {result.metrics} "
                        f"{'pass' if result.passed else result.failures}")
                    if not result.passed:
                        if not allow_fallback and stage not in OPTIONAL_INT8.get(target, ()):
                            raise ReleaseError(
                                f"quality gate: stage {stage!r} of target {target!r} at {precision} failed "
                                f"({'; '.join(result.failures)}); pass --allow-fallback to keep it at "
                                f"{ladder[rank + 1]}")
                        reason = reason or f"{precision} missed the {stage} gate"
                        continue
                stages[stage] = entry["precision"] = precision
                if rank > 0:
                    entry["fallback_from"] = entry["fallback_from"] or ladder[0]
                    entry["fallback_reason"] = entry.get("fallback_reason") or reason
                return

        for stage in LADDERS[target]:
            settle(stage, 0)
        e2e: list[dict] = []
        while stages["flow"] != "fp32" or stages["hift"] != "fp32":
            graphs = {v.graph: path_of(v) for s in ("flow", "hift") for v in stage_variants(target, s, stages[s], rules)}
            result = check("e2e", graphs, f"flow {stages['flow']}, hift {stages['hift']}")
            e2e.append(result.as_dict())
            log(f"{target} e2e {result.precision}: {result.metrics} {'pass' if result.passed else result.failures}")
            if result.passed:
                break
            if not allow_fallback:
                raise ReleaseError(f"quality gate: stage 'e2e' of target {target!r} ({result.precision}) failed "
                                   f"({'; '.join(result.failures)}); pass --allow-fallback to raise flow / HiFT "
                                   "precision until it passes")
            # step down the lower-precision stage first (int8 before fp16); on a tie the flow, whose error the
            # vocoder inherits
            stage = min(("flow", "hift"), key=lambda s: RUNG_ORDER[stages[s]])
            settle(stage, LADDERS[target][stage].index(stages[stage]) + 1, "end-to-end gate")
        report["e2e"] = {"precision": f"flow {stages['flow']}, hift {stages['hift']}", "attempts": e2e,
                         "fallback_from": None}
        chosen = [v for s in STAGE_GRAPHS for v in stage_variants(target, s, stages[s], rules)]
        used.update(chosen)
        config[target] = {
            "graphs": {v.graph: {"component": v.component, "precision": v.precision} for v in chosen},
            "stages": stages, "validated_with": "onnxruntime-cpu",
            **({"llm_int8": cpu_llm_method} if target in CPU_TARGETS and stages["llm"] == "int8" else {}),
        }
        quality[target] = report
    # graphs of attempts that missed their gate: `built` holds only files build_variant wrote here, each at
    # `work / v.work_name` in the writer's own fresh work directory (fp32 exports are never entered in it)
    for v in [v for v in built if v not in used]:
        built.pop(v).unlink()
    # one file per component and precision: only cpu-int4 has 4-bit rungs, so its chosen block is the only one kept
    return TargetBuild({(v.component, v.precision): path for v, path in built.items()}, config, quality)
