"""The layers import one way (docs/architecture.md): every import of device/, api/ and quantize/ is parsed with
`ast`, including imports inside functions, and checked against the rules below. A failure names the file, the
line, the import and the rule it breaks.

- cosyedge.device never imports cosyedge.api, cosyedge.quantize or torch;
- cosyedge.api uses the device's public surface only (API_MAY_IMPORT), never torch or cosyedge.quantize;
- cosyedge.quantize may import the device, never the API;
- the device's core (its top-level modules) never imports a model family or the benchmarks (families.py names
  them as strings and imports them with importlib);
- the API's service never imports its measurement subpackage (cosyedge.api.bench: bench-api, load, fuzz, the
  harness); only the subpackage itself and the tests do;
- no import cycle between packages, nor between the API's modules; no `getattr` / `hasattr` capability probing in
  the engine or the API;
- Ray (the optional extra cosyedge[ray]) is imported by cosyedge.device.ray_jobs only, inside a function;
- vox-tts (the optional peer of `cosyedge bench --peer vox`) is imported by cosyedge.device.bench.peer_vox only.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = {"device": "cosyedge.device", "api": "cosyedge.api", "quantize": "cosyedge.quantize"}
TORCH = ("torch", "torchaudio")
RAY_MODULE = "cosyedge.device.ray_jobs"  # the one importer of ray (synth-batch --ray)
VOX_MODULE = "cosyedge.device.bench.peer_vox"  # the one importer of vox (bench --peer vox)
FAMILIES = ("cosyedge.device.vits", "cosyedge.device.cosyvoice2", "cosyedge.device.cosyvoice3")
API_MAY_IMPORT = ("cosyedge.device", "cosyedge.device.engine", "cosyedge.device.options", "cosyedge.device.request",
                  "cosyedge.device.errors", "cosyedge.device.audio", "cosyedge.device.paths", "cosyedge.device.door",
                  "cosyedge.device.subtitles")



@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module (for `from M import name`: M.name when that is a module, else M)
    path: str
    line: int
    text: str


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _is_bench(name: str) -> bool:
    return _within(name, "cosyedge.device.bench") or name.startswith("cosyedge.device.bench_")


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = [LAYERS[rel.parts[0]], *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _all_modules() -> dict[str, Path]:
    return {module_name(p): p for layer in LAYERS for p in sorted((REPO / layer).rglob("*.py"))}


def imports_of(module: str, source: str, path: str, known: set[str]) -> list[Import]:
    """Every import statement (at any depth) and every `importlib.import_module("literal")` call."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source, path)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "import_module",
                                                                      "__import__") \
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            targets = [node.args[0].value]
        text = ast.unparse(node) if targets else ""
        found += [Import(module, t, path, node.lineno, text) for t in dict.fromkeys(targets)]
    return found


def broken_rule(imp: Import) -> str | None:
    """The rule `imp` breaks, or None."""
    src, dst = imp.module, imp.target
    uses_torch = dst.split(".")[0] in TORCH
    if dst.split(".")[0] == "ray" and src != RAY_MODULE:
        return f"only {RAY_MODULE} imports ray (the optional extra cosyedge[ray])"
    if dst.split(".")[0] == "vox" and src != VOX_MODULE:
        return f"only {VOX_MODULE} imports vox (the optional bench peer vox-tts)"
    if _within(src, "cosyedge.device"):
        if uses_torch or _within(dst, "cosyedge.api") or _within(dst, "cosyedge.quantize"):
            return "cosyedge.device never imports cosyedge.api, cosyedge.quantize or torch (not even inside functions)"
        in_core = src.count(".") == 2 or src == "cosyedge.device"
        if in_core and not _is_bench(src) and (any(_within(dst, f) for f in FAMILIES) or _is_bench(dst)):
            return ("the device's core never imports a model family or the benchmarks; resolve a family through "
                    "cosyedge.device.families (importlib)")
    if _within(src, "cosyedge.api"):
        if uses_torch or _within(dst, "cosyedge.quantize"):
            return "cosyedge.api never imports torch or cosyedge.quantize"
        if _within(dst, "cosyedge.device") and dst not in API_MAY_IMPORT:
            return f"cosyedge.api imports from the device only its public surface: {', '.join(API_MAY_IMPORT)}"
        if _within(dst, "cosyedge.api.bench") and not _within(src, "cosyedge.api.bench"):
            return "the service never imports its measurement subpackage cosyedge.api.bench"
    if _within(src, "cosyedge.quantize") and _within(dst, "cosyedge.api"):
        return "cosyedge.quantize may import cosyedge.device, never cosyedge.api"
    return None


def violations(module: str, source: str, path: str, known: set[str]) -> list[str]:
    return [f"{imp.path}:{imp.line}: `{imp.text}` imports {imp.target}: {rule}"
            for imp in imports_of(module, source, path, known)
            if (rule := broken_rule(imp))]


def probes(source: str, path: str, engine_module: bool) -> list[str]:
    """getattr/hasattr calls that probe a pipeline or engine (in the engine: any getattr/hasattr at all)."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and node.args:
            subject = ast.unparse(node.args[0])
            if engine_module or "pipeline" in subject or "engine" in subject:
                found.append(f"{path}:{node.lineno}: `{ast.unparse(node)}`: no capability probing; call the Pipeline "
                             "contract (device/pipeline.py) directly")
    return found


def _real_imports() -> list[Import]:
    modules = _all_modules()
    known = set(modules)
    return [imp for name, path in modules.items()
            for imp in imports_of(name, path.read_text(encoding="utf-8"), str(path.relative_to(REPO)), known)]


# -- the checker itself catches what it must (synthetic modules) -----------------------------------------------
KNOWN = {"cosyedge.device.engine", "cosyedge.device.vits", "cosyedge.device.vits.pipeline", "cosyedge.device.bench"}


def test_checker_flags_forbidden_imports_in_a_synthetic_module():
    bad = {
        ("cosyedge.device.engine", "import cosyedge.api\n"): "never imports cosyedge.api",
        ("cosyedge.device.engine", "def f():\n    from cosyedge.quantize.quality import SpeakerSimilarity\n"):
            "never imports cosyedge.api, cosyedge.quantize",
        ("cosyedge.device.audio", "def f():\n    import torch\n"): "or torch",
        ("cosyedge.device.engine", "from cosyedge.device.vits.pipeline import VitsPipeline\n"): "model family",
        ("cosyedge.device.engine", "from cosyedge.device import vits\n"): "model family",
        ("cosyedge.device.engine", "from .bench import run\n"): "benchmarks",
        ("cosyedge.device.jobs", "import importlib\nimportlib.import_module('cosyedge.api.app')\n"): "cosyedge.api",
        ("cosyedge.api.app", "from cosyedge.device.vits.pipeline import VitsPipeline\n"): "public surface",
        ("cosyedge.api.routes.ops", "from cosyedge.device import bench\n"): "public surface",
        ("cosyedge.api.app", "import cosyedge.quantize.cli\n"): "never imports torch or cosyedge.quantize",
        ("cosyedge.quantize.cli", "from cosyedge.api.config import ServiceConfig\n"): "never cosyedge.api",
        ("cosyedge.api.service", "def f():\n    from cosyedge.api.bench.harness import make_server\n"):
            "measurement subpackage",
        ("cosyedge.device.jobs", "def f():\n    import ray\n"): "only cosyedge.device.ray_jobs imports ray",
        ("cosyedge.device.bench.batch", "from ray import exceptions\n"): "only cosyedge.device.ray_jobs",
        ("cosyedge.device.bench.cosyvoice", "def f():\n    from vox.formats import VoiceProfile\n"):
            "only cosyedge.device.bench.peer_vox imports vox",
    }
    for (module, source), rule in bad.items():
        path = module.replace("cosyedge.", "").replace(".", "/") + ".py"
        found = violations(module, source, path, KNOWN)
        assert len(found) == 1 and rule in found[0] and found[0].startswith(f"{path}:"), (module, source, found)
    fine = {
        "cosyedge.api.app": "from cosyedge.device import Engine, InputError\nfrom cosyedge.device.options import Segment\n",
        "cosyedge.quantize.cli": "from cosyedge.device.vits.convert import build_piper_bundle\nimport torch\n",
        "cosyedge.device.vits.pipeline": "from cosyedge.device.engine import Engine\n",
        "cosyedge.device.families": "import importlib\nimportlib.import_module(spec)\n",
        "cosyedge.api.bench.load": "from cosyedge.api.bench.harness import ServiceProcess\nfrom cosyedge.api import app\n",
        RAY_MODULE: "def f():\n    import ray\n",
        VOX_MODULE: "def f():\n    import vox\n",
    }
    for module, source in fine.items():
        assert violations(module, source, "x.py", KNOWN) == [], module
    assert probes("x = getattr(self.pipeline, 'decode_stats', None)\n", "api/app.py", False)
    assert probes("getattr(args, 'seed')\n", "device/engine.py", True)
    assert not probes("getattr(args, 'seed')\n", "api/cli.py", False)


# -- the real code ---------------------------------------------------------------------------------------
def test_every_import_obeys_the_layer_rules():
    modules = _all_modules()
    known = set(modules)
    found = [v for name, path in modules.items()
             for v in violations(name, path.read_text(encoding="utf-8"), str(path.relative_to(REPO)), known)]
    assert not found, "imports that break the layer rules:\n" + "\n".join(found)


def test_no_import_cycle_between_packages():
    """Packages (cosyedge.device, its family folders, the bench, cosyedge.api, cosyedge.quantize...) form a DAG of
    static imports. Two subpackages are parts of their parent, not layers: the API's route modules (its app
    registers them; they use its services) and the device's TensorRT profiles (sessions.py hands them to ORT)."""
    modules = _all_modules()
    packages = {name if path.name == "__init__.py" else name.rpartition(".")[0] for name, path in modules.items()}
    packages -= {"cosyedge.api.routes", "cosyedge.device.trt"}
    packages.add("cosyedge.device.bench")

    def package_of(name: str) -> str | None:
        if _is_bench(name):  # the benchmarks are a layer of their own above the families
            return "cosyedge.device.bench"
        candidates = [p for p in packages if _within(name, p)]
        return max(candidates, key=len) if candidates else None

    edges: dict[str, set[str]] = {p: set() for p in packages}
    where: dict[tuple[str, str], str] = {}
    for imp in _real_imports():
        a, b = package_of(imp.module), package_of(imp.target)
        if b is not None and a != b:
            edges[a].add(b)
            where.setdefault((a, b), f"{imp.path}:{imp.line}")
    _assert_acyclic(edges, where, "packages")


def _assert_acyclic(edges: dict[str, set[str]], where: dict[tuple[str, str], str], what: str) -> None:
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return trail + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, trail + [node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start, [])):
            cycle = cycle[cycle.index(cycle[-1]):]
            steps = [f"{a} -> {b} ({where[a, b]})" for a, b in zip(cycle, cycle[1:])]
            raise AssertionError(f"import cycle between {what}:\n" + "\n".join(steps))


def test_no_import_cycle_between_the_api_modules():
    """The API's modules import one way too, imports inside functions included (server.py once imported
    wyoming.py, which imported server.py back). A route package's `__init__` that lists its modules is a
    module like the others."""
    modules = {name for name in _all_modules() if _within(name, "cosyedge.api")}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    where: dict[tuple[str, str], str] = {}
    for imp in _real_imports():
        if imp.module in modules and imp.target in modules and imp.module != imp.target:
            edges[imp.module].add(imp.target)
            where.setdefault((imp.module, imp.target), f"{imp.path}:{imp.line}")
    _assert_acyclic(edges, where, "the API's modules")


def test_no_getattr_probing_of_pipelines_in_engine_or_api():
    files = [REPO / "device" / "engine.py", *sorted((REPO / "api").rglob("*.py"))]
    found = [p for f in files for p in probes(f.read_text(encoding="utf-8"), str(f.relative_to(REPO)),
                                             f.name == "engine.py" and f.parent.name == "device")]
    assert not found, "capability probing:\n" + "\n".join(found)


def test_ray_is_imported_lazily():
    """cosyedge[ray] is optional: `ray_jobs` imports it inside a function only, so the module (and `synth-batch`)
    loads without it and `--ray` says which extra to install."""
    path = REPO / "device" / "ray_jobs.py"
    top = [node for node in ast.parse(path.read_text(encoding="utf-8")).body
           if isinstance(node, (ast.Import, ast.ImportFrom))]
    found = [ast.unparse(node) for node in top if any(
        name.split(".")[0] == "ray" for name in ([a.name for a in node.names] if isinstance(node, ast.Import)
                                                 else [node.module or ""]))]
    assert not found, f"device/ray_jobs.py imports ray at module level: {found}"
