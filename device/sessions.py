"""ONNX Runtime sessions: provider choice with fallback, thread counts, one session per graph."""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import onnxruntime as ort

from cosyedge.device.errors import ProviderError

if TYPE_CHECKING:
    from cosyedge.device.trt.providers import TrtSessionOptions

log = logging.getLogger(__name__)

PROVIDER_NAMES = {"tensorrt": "TensorrtExecutionProvider", "cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}
ARENA_POLICIES = ("shrink", "keep")
VITS_SHRINK_ABOVE = 192  # phoneme ids in one VITS call (rows x ids): an everyday sentence stays under it


@dataclass(frozen=True)
class SessionConfig:
    """Which execution providers to try, in order, and how many threads ORT may use."""
    providers: tuple[str, ...] = ("tensorrt", "cuda", "cpu")
    intra_op_threads: int = 0  # 0 = ORT's default (one per physical core)
    inter_op_threads: int = 1
    trt_cache_dir: Path | None = None
    trt_fp16: bool = True
    # How a session is made: None = ONNX Runtime (`create_session`). The bench injects its stage timers here,
    # so no module attribute is ever patched; the factory receives this config and must honour its providers.
    session_factory: Callable[[Path, "SessionConfig"], Any] | None = None
    # TensorRT: per-graph optimisation profiles, caches and the device's limits (cosyedge.device.trt); None = none.
    trt: "TrtSessionOptions | None" = None
    # ONNX Runtime graph optimizers not to run (their names), e.g. NchwcTransformer where its layout cannot pay.
    disabled_optimizers: tuple[str, ...] = ()
    # What the memory arena of a CPU session of `shrink_graphs` keeps after a graph call: "shrink" hands every
    # region the call no longer uses back (the next call of another length allocates afresh), "keep" lets the arena
    # grow to the largest calls seen (ONNX Runtime's default; requests of varying lengths fragment it: a full-size
    # HiFT decoder grew 154 -> 302 MB over five calls of 300-520 frames, 15-62 MB with "shrink"). Each graph names
    # the smallest call that shrinks (elements of its largest input): VITS shrinks only after long calls (the
    # default voice's service reading hostile texts peaked at 617-752 MB with "keep", ~510 MB with "shrink"),
    # since re-faulting fresh pages after every everyday sentence would cost more than the memory saved. The LLM
    # shrinks after prefills only (its decode steps, small and every few ms, bring their own run options:
    # kvcache.LLMCalls): a full-size prefill of 137 positions left 34 MB in a kept arena for the whole stream
    # (cpu-int4, 250 tokens, one process each: peaks 707-710 -> 689 MB fastest stream on, 747-750 -> 728 official
    # stream on, 742-746 -> 724 fastest stream off; decode steps 10.2-11.4 against 10.4-12.1 ms). Other graphs
    # keep ORT's default. The graphs that shrink share one CPU arena (`_register_shared_arena`).
    arena: str = "shrink"
    shrink_graphs: tuple[tuple[str, int], ...] = (("flow_encoder", 0), ("flow_estimator", 0), ("hift_source", 0),
                                                  ("hift_decoder", 0), ("vits", VITS_SHRINK_ABOVE), ("llm", 0))
    # CosyVoice2 streaming: the flow's per-voice prompt states kept at most (MB; 0: none kept, each streaming call
    # computes its voice's state again). cosyvoice2/prompt_cache.py: a 3.5 s prompt is 26 MB for `fastest`, 172 MB
    # for `official` at CosyVoice2-0.5B sizes; a quarter of that on the cpu targets (int8 states).
    prompt_cache_mb: int = 256

    def __post_init__(self) -> None:
        unknown = [p for p in self.providers if p not in PROVIDER_NAMES]
        if unknown or not self.providers:
            raise ProviderError(f"unknown execution provider(s) {unknown}; choose from {', '.join(PROVIDER_NAMES)}")
        if self.intra_op_threads < 0 or self.inter_op_threads < 0:
            raise ProviderError("thread counts must be >= 0")
        if self.prompt_cache_mb < 0:
            raise ProviderError("the prompt cache size must be >= 0 MB")
        if self.arena not in ARENA_POLICIES:
            raise ProviderError(f"arena policy must be one of {', '.join(ARENA_POLICIES)}")

    @classmethod
    def from_env(cls) -> "SessionConfig":
        """`COSYEDGE_PROVIDERS=cuda,cpu`, `COSYEDGE_THREADS=2`, `COSYEDGE_TRT_CACHE=/var/lib/cosyedge/trt`,
        `COSYEDGE_ARENA=keep`, `COSYEDGE_PROMPT_CACHE_MB=64`."""
        providers = tuple(p.strip() for p in os.environ.get("COSYEDGE_PROVIDERS", "tensorrt,cuda,cpu").split(",") if p.strip())
        cache = os.environ.get("COSYEDGE_TRT_CACHE")
        trt = None
        if "tensorrt" in providers and PROVIDER_NAMES["tensorrt"] in ort.get_available_providers():  # CPU path: never
            from cosyedge.device.trt.providers import TrtSessionOptions
            trt = TrtSessionOptions.from_env()
        threads = os.environ.get("COSYEDGE_THREADS", "0").strip()
        if not (threads.isascii() and threads.isdecimal() and len(threads) <= 4):
            raise ProviderError(f"COSYEDGE_THREADS must be a whole number of threads (0 = one per core), "
                                f"not {threads[:20]!r}")
        arena = os.environ.get("COSYEDGE_ARENA", "shrink").strip()
        if arena not in ARENA_POLICIES:
            raise ProviderError(f"COSYEDGE_ARENA must be one of {', '.join(ARENA_POLICIES)}, not {arena[:20]!r}")
        prompt_cache = os.environ.get("COSYEDGE_PROMPT_CACHE_MB", "256").strip()
        if not (prompt_cache.isascii() and prompt_cache.isdecimal() and len(prompt_cache) <= 6):
            raise ProviderError(f"COSYEDGE_PROMPT_CACHE_MB must be a whole number of MB (0 = none), "
                                f"not {prompt_cache[:20]!r}")
        return cls(providers=providers, intra_op_threads=int(threads),
                   trt_cache_dir=Path(cache) if cache else None, trt=trt, arena=arena,
                   prompt_cache_mb=int(prompt_cache))

    def threads(self) -> int:
        """The intra-op threads a session gets: the configured count, or ORT's default of one per core (counted
        as the CPUs this process may run on)."""
        return self.intra_op_threads or len(os.sched_getaffinity(0))

    def row_limit(self, default: int) -> int:
        """Rows one graph call may hold: the device profile's cap when TensorRT engines have fixed profiles."""
        return min(default, self.trt.device.max_rows) if self.trt is not None else default

    def flow_row_limit(self, default: int) -> int:
        """Rows one flow batch may hold (CosyVoice): the device profile's cap under TensorRT."""
        return min(default, self.trt.device.flow_rows) if self.trt is not None else default

    def frame_limit(self, default: int) -> int:
        """Mel frames one flow call may hold (CosyVoice): the device profile's cap under TensorRT."""
        return min(default, self.trt.device.max_frames) if self.trt is not None else default

    def create(self, path: Path) -> Any:
        """One session for one graph, through the injected factory if there is one, else ONNX Runtime."""
        if self.session_factory is not None:
            return self.session_factory(Path(path), self)
        return create_session(Path(path), self)

    def available(self) -> list[str]:
        """The configured providers (short names, in order) that this onnxruntime build offers."""
        offered = set(ort.get_available_providers())
        return [short for short in self.providers if PROVIDER_NAMES[short] in offered]

    def resolved_providers(self, path: Path | None = None) -> list[str | tuple[str, dict]]:
        """The configured providers that this onnxruntime build offers, with a warning for each missing one;
        with `path`, the TensorRT provider gets that graph's profiles and cache folders."""
        available = set(ort.get_available_providers())
        chosen: list[str | tuple[str, dict]] = []
        for short in self.providers:
            name = PROVIDER_NAMES[short]
            if name not in available:
                if short != "cpu":
                    log.warning("execution provider %s is not available in this onnxruntime build; falling back", short)
                continue
            if short == "tensorrt":
                options: dict[str, object] = {"trt_fp16_enable": self.trt_fp16}
                if self.trt_cache_dir is not None:
                    options |= {"trt_engine_cache_enable": True, "trt_engine_cache_path": str(self.trt_cache_dir),
                                "trt_timing_cache_enable": True, "trt_timing_cache_path": str(self.trt_cache_dir)}
                if self.trt is not None and path is not None:
                    options |= self.trt(path)
                chosen.append((name, options))
            else:
                chosen.append(name)
        if not chosen:
            raise ProviderError(f"none of the configured providers ({', '.join(self.providers)}) is available; "
                                "add 'cpu' to COSYEDGE_PROVIDERS")
        return chosen


# Graphs with optional inputs by design (ONNX overridable initializers: CosyVoice2's flow estimator takes a prompt
# state only when a streaming call has one, quantize/cosyvoice2/flow_export.py), run in priority order.
OVERRIDABLE_INPUT_GRAPHS = frozenset({"flow_estimator"})


def create_session(path: Path, config: SessionConfig) -> ort.InferenceSession:
    """One InferenceSession for one graph; created once per engine and reused by every request."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = config.intra_op_threads
    options.inter_op_num_threads = config.inter_op_threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if Path(path).name.split(".")[0] in OVERRIDABLE_INPUT_GRAPHS:
        options.log_severity_level = 3  # errors only: ORT warns on every load that those inputs are initializers
        # the state outputs hang off every block; ORT's default order ran them last, keeping every block's input
        # alive to the end (full-size estimator, one 674-frame call: peak +198 MB over the loaded session against
        # +89 MB in priority order, the plain graph's +75 to +90 MB; the same speed)
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    providers = config.resolved_providers(path)
    above = dict(config.shrink_graphs).get(Path(path).name.split(".")[0])
    shrinks = config.arena == "shrink" and above is not None
    if shrinks and providers[0] == PROVIDER_NAMES["cpu"]:
        options.add_session_config_entry("session.use_env_allocators", "1")
        _register_shared_arena()
        _tune_malloc()
    try:
        session = ort.InferenceSession(str(path), sess_options=options, providers=providers,
                                       disabled_optimizers=list(config.disabled_optimizers) or None)
    except Exception as exc:  # noqa: BLE001 - ORT raises its own untyped errors
        raise ProviderError(f"cannot create an ONNX Runtime session for {path.name}: {type(exc).__name__}") from None
    wanted = providers[0] if isinstance(providers[0], str) else providers[0][0]
    if session.get_providers()[0] != wanted:
        log.warning("%s runs on %s instead of %s", path.name, session.get_providers()[0], wanted)
    return_freed_memory()
    if shrinks and session.get_providers()[0] == PROVIDER_NAMES["cpu"]:
        return ShrinkingSession(session, above)
    return session


_shared_arena_lock = threading.Lock()
_shared_arena_registered = False


def _register_shared_arena() -> None:
    """One CPU arena for every session of `shrink_graphs` (ONNX Runtime's environment allocator). A call's outputs
    outlive its shrink and hold their regions until that graph's next call; with an arena per session those held
    regions added up across the flow and HiFT graphs: a full-size `cpu` engine held up to 1000 MB after a stream-off
    request and started the next at up to 920 MB, against 879-892 and 862-886 MB with one arena, at the same flow
    time. Regions grow by powers of two as before: regions of the size asked for made the flow 20-30 % slower."""
    global _shared_arena_registered
    with _shared_arena_lock:
        if not _shared_arena_registered:
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 0, -1, -1))  # 0: kNextPowerOfTwo
            _shared_arena_registered = True


def _shrinking(options: ort.RunOptions) -> ort.RunOptions:
    """`options`, set to hand the CPU arena's freed regions back when the call ends."""
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return options


class ShrinkingSession:
    """An ONNX Runtime CPU session whose graph calls larger than `above` (elements of the largest input) end by
    shrinking its memory arena (RunOptions `memory.enable_memory_arena_shrinkage`): what such a call allocated goes
    back once the call is over, so the resident set between requests stays the weights, not the largest
    activations seen (a caller's own run options get the same entry). Everything else delegates."""

    def __init__(self, session: ort.InferenceSession, above: int = 0) -> None:
        self._session, self._above = session, above
        self._options = _shrinking(ort.RunOptions())

    def run(self, output_names: Any, input_feed: Any, run_options: ort.RunOptions | None = None) -> Any:
        if max((np.size(value) for value in input_feed.values()), default=0) <= self._above:
            return self._session.run(output_names, input_feed, run_options)
        try:
            return self._session.run(output_names, input_feed,
                                     self._options if run_options is None else _shrinking(run_options))
        finally:
            return_freed_memory()      # what the arena freed sits in glibc's heap until trimmed

    def run_with_iobinding(self, binding: Any, run_options: ort.RunOptions | None = None) -> Any:
        """An io-bound call shrinks unless the caller brings its own `run_options` (a call it knows to be small:
        an LLM decode step, kvcache.LLMCalls)."""
        if run_options is not None:
            return self._session.run_with_iobinding(binding, run_options)
        try:
            return self._session.run_with_iobinding(binding, self._options)
        finally:
            return_freed_memory()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


MMAP_THRESHOLD = 4 << 20  # bytes: glibc maps every block above it and unmaps it when freed
MALLOC_ARENAS = 1         # glibc heaps for all threads together


def _tune_malloc() -> None:
    """The process's glibc allocation policy for graph calls of changing sizes (`mallopt`).

    M_MMAP_THRESHOLD fixed at MMAP_THRESHOLD: by default it rises to the largest mapped block freed (up to 32 MiB),
    so from then on the flow's and HiFT's buffers of that size come from the heap and stay resident after they are
    freed (the trim threshold rises with it). Full-size `cpu` engine, 250 tokens, peak RSS of one request: 852 -> 841
    MB (fastest, stream off), 895 -> 883 (official), 916 -> 907 (fastest, stream on), the same synthesis times within
    the box's noise. Blocks of 4 MiB and more are few per graph call, so mapping each costs nothing measurable (256 KiB
    cost 8-12 %).

    M_ARENA_MAX at MALLOC_ARENAS: each thread that allocates (a stream's decode thread, the server's request
    threads) otherwise gets a heap of its own that keeps its freed blocks. Full-size `cpu-int4` engine, 250 tokens,
    two runs each: fastest stream on 745-749 -> 742 MB, official stream on 749-750 -> 747, fastest stream off 745-746
    -> 742 (2 heaps: the default's figures). The blocks left on the heap are small (numpy's and ONNX Runtime's
    bookkeeping; large buffers are mapped, ORT's arena hands out the activations), so one lock serves them."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, MMAP_THRESHOLD)  # -3: M_MMAP_THRESHOLD
        libc.mallopt(-8, MALLOC_ARENAS)   # -8: M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc: its own policy stands
        pass


def return_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc `malloc_trim`). Loading a graph parses the whole file and
    copies its weights before ONNX Runtime prepacks them; glibc keeps those freed buffers mapped, so without this
    a full-size CosyVoice2 engine stays resident with memory it no longer uses."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
