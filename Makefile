# cosyedge: every target works on a fresh clone of this repository (Debian, Python 3.11).
PYTHON ?= python3
VENV   ?= .venv
PIP     = $(VENV)/bin/pip install -q -c constraints.txt
BIN     = $(VENV)/bin
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test fuzz load hostile quantize bench bench-api serve system-deps runtime buildhost gpu-runtime gpu-check appliance install-service clean

# The runtime needs no Debian package: mp3/opus/aac/flac use the system's ffmpeg if it has one, else the static one
# of the imageio-ffmpeg wheel. The tests want ffmpeg on PATH (their decoders go through pydub + ffprobe) and
# systemd-analyze (unit checks).
system-deps:  ## Debian packages of the tests: ffmpeg + ffprobe (test decoders), systemd-analyze (unit checks)
	@command -v ffmpeg >/dev/null && command -v systemd-analyze >/dev/null || \
	  ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q --no-install-recommends ffmpeg systemd)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip

runtime: $(VENV)/bin/python  ## the device runtime + API: numpy and ONNX Runtime, no torch
	$(PIP) -e .

buildhost: system-deps $(VENV)/bin/python  ## everything, including the build-host tools (torch 2.13.0 CPU), Ray and tests
	$(PIP) -e ".[quantize,ray,test]"

# onnxruntime and onnxruntime-gpu share the import name `onnxruntime`: never both in one venv. An extra cannot remove
# a base dependency, so the GPU runtime is the CPU runtime with the wheel swapped. On Jetson, ORT_GPU is the path of
# an aarch64 onnxruntime-gpu wheel built for your JetPack with the TensorRT provider (docs/jetson.md).
# Run it last: a later `pip install -e .` would bring the CPU onnxruntime back (use --no-deps for upgrades).
ORT_GPU ?= onnxruntime-gpu
gpu-runtime: runtime  ## swap the CPU onnxruntime for onnxruntime-gpu (ORT_GPU=<wheel> on Jetson), then list usable providers
	$(VENV)/bin/pip uninstall -y -q onnxruntime
	$(VENV)/bin/pip install -q "$(ORT_GPU)"
	@! $(VENV)/bin/pip show -q onnxruntime 2>/dev/null || (echo "both onnxruntime and onnxruntime-gpu are installed" >&2; exit 1)
	$(BIN)/python -m cosyedge.device.trt.cli providers

gpu-check: runtime  ## tiny bundle on CPU, CUDA and TensorRT, compared with CPU, plus a small bench (skips absent GPUs)
	tools/gpu-check.sh

demo: runtime  ## speak a sentence with the embedded default voice into demo.wav
	$(BIN)/cosyedge synth "Hello! This is cosyedge, speaking offline from this box. No network was needed." -o demo.wav
	@echo "wrote demo.wav"

# Two pytest workers, each taking whole test files (their module fixtures are built once): the suite's many waits
# on servers and subprocesses overlap. A fresh clone's `.ci/run` on a 2-core box: the tests 2039 s in one process
# (06b153d), 979 s on two workers (bce6979). TEST_WORKERS=0 runs it in one process. -rfEs: the failed, errored
# and skipped tests are listed (with the reason) after the durations, at the end of the log CI shows.
TEST_WORKERS ?= 2
test: buildhost  ## the whole test suite (what CI runs) on TEST_WORKERS workers, with its 30 slowest tests listed
	$(BIN)/python -m pytest -q -rfEs --durations=30 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

FUZZ_REQUESTS ?= 10000
FUZZ_SESSIONS ?= 300
FUZZ_SEED ?= 0
# The door campaign runs even when the HTTP one found something; the target fails if either did.
fuzz: buildhost  ## schemathesis against a fresh service's /openapi.json (FUZZ_REQUESTS), then generated WebSocket and Wyoming sessions (FUZZ_SESSIONS each), FUZZ_SEED; figures in fuzz.json, fuzz-doors.json
	$(BIN)/python -m cosyedge.api.bench.fuzz --requests $(FUZZ_REQUESTS) --seed $(FUZZ_SEED) --json fuzz.json $(FUZZ_ARGS); \
	  http=$$?; $(BIN)/python -m cosyedge.api.bench.door_fuzz --sessions $(FUZZ_SESSIONS) --seed $(FUZZ_SEED) \
	  --json fuzz-doors.json $(FUZZ_DOOR_ARGS) && exit $$http

LOAD_CLIENTS ?= 64
LOAD_SECONDS ?= 60
load: buildhost  ## LOAD_CLIENTS concurrent clients for LOAD_SECONDS against a fresh default-voice service; figures in load.json
	$(BIN)/python -m cosyedge.api.bench.load --clients $(LOAD_CLIENTS) --seconds $(LOAD_SECONDS) --json load.json $(LOAD_ARGS)

HOSTILE_SECONDS ?= 300
hostile: buildhost  ## slowloris, malformed / cross-site floods, idle WebSockets and clients at once for HOSTILE_SECONDS against a fresh default-voice service, /healthz probed; figures in hostile.json
	$(BIN)/python -m cosyedge.api.bench.hostile --seconds $(HOSTILE_SECONDS) --json hostile.json $(HOSTILE_ARGS)

MODEL_DIR ?=
OUT ?= bundles/$(notdir $(abspath $(MODEL_DIR)))
TARGETS ?= cpu,cpu-int4,gpu-fp16,trt-int8
ALLOW_FALLBACK ?= 1
quantize: buildhost  ## no MODEL_DIR: the default voice's bundle; MODEL_DIR=<official release>: a CosyVoice bundle in $(OUT) with fp32 + TARGETS
ifeq ($(MODEL_DIR),)
	$(BIN)/cosyedge quantize --force
else
	$(BIN)/cosyedge quantize --model-dir $(MODEL_DIR) --out $(OUT) $(if $(TARGETS),--target $(TARGETS)) \
	  $(if $(filter 1,$(ALLOW_FALLBACK)),--allow-fallback)
endif

bench: runtime  ## RTF of the default voice: fp32, int8 and piper-tts side by side
	$(BIN)/cosyedge bench

bench-api: runtime  ## the HTTP API: single-client latency and 16-client throughput
	$(BIN)/cosyedge bench-api --json bench-api.json

serve: runtime  ## the HTTP API on 127.0.0.1:8100
	$(BIN)/cosyedge serve

# The offline artefact of a box (docs/deploy.md): wheelhouse for PLATFORM and this Python, default voice, BUNDLES
# (space-separated bundle directories), units, install.sh. Runs pip download: a connected build host.
PLATFORM ?= linux-$(shell uname -m)
BUNDLES ?=
APPLIANCE ?= cosyedge-$(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)-$(PLATFORM).tar
appliance: runtime  ## one tar a box installs from with no network: make appliance PLATFORM=linux-aarch64 [BUNDLES=...]
	$(BIN)/cosyedge appliance build --platform $(PLATFORM) $(foreach b,$(BUNDLES),--bundle $(b)) --out $(APPLIANCE) --force

install-service: appliance  ## this machine's artefact, installed: venv in /opt/cosyedge, units, env file (systemd/README.md)
	rm -rf .appliance && mkdir .appliance && tar -xf $(APPLIANCE) -C .appliance
	$(SUDO) env $(if $(wildcard $(ORT_GPU)),ORT_GPU=$(abspath $(ORT_GPU))) .appliance/*/install.sh  # ORT_GPU: a wheel file

clean:
	rm -rf $(VENV) demo.wav fuzz.json fuzz-doors.json load.json bundles *.egg-info .appliance cosyedge-*-linux-*.tar
