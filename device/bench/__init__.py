"""Benchmarks, kept out of the runtime core: the core never imports this package (only the CLI registers it).

engine      `cosyedge bench` on a Piper/VITS bundle: RTF per sentence beside the piper-tts peer
cosyvoice   `cosyedge bench` on a CosyVoice2 bundle: one worker process per precision (+ the PyTorch reference)
worker      the worker side of that subprocess protocol (`python -m cosyedge.device.bench.worker`)
clocks      stage clocks, the timing session factory, peak RSS
report      JSON and text tables; chart: PNG charts (matplotlib, the optional `chart` extra)
graphs      `cosyedge bench-graphs`: per-graph ORT latency; decode: aggregate LLM decode throughput
cli         `register(subparsers)`: the `bench` and `bench-graphs` commands
"""
