"""Read an official CosyVoice2 release directory (yaml, checkpoints) without the official code.

Hyperparameters come from the release's yaml, never from constants here: tiny test releases
and the real CosyVoice2-0.5B differ in every size.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import yaml

from cosyedge.device.errors import ReleaseError

YAML_NAME = "cosyvoice2.yaml"
REQUIRED_FILES = (YAML_NAME, "llm.pt", "flow.pt", "hift.pt", "campplus.onnx",
                  "speech_tokenizer_v2.onnx", "CosyVoice-BlankEN/config.json",
                  "CosyVoice-BlankEN/vocab.json", "CosyVoice-BlankEN/merges.txt")


@dataclass(frozen=True)
class Node:
    """A `!new:` / `!name:` / `!apply:` entry of the yaml: the official class path and its arguments."""
    tag: str          # "new", "name" or "apply"
    target: str       # dotted class or function path from the official code
    args: Any         # dict of keyword arguments (or list for !apply)

    def __getitem__(self, key: str) -> Any:
        return self.args[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.args.get(key, default) if isinstance(self.args, dict) else default


class _Ref(str):
    """An unresolved `!ref` expression such as `<chunk_size> * <token_mel_ratio>`."""


def _loader() -> type[yaml.SafeLoader]:
    class Loader(yaml.SafeLoader):
        pass

    def multi(tag: str):
        def construct(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Node:
            if isinstance(node, yaml.MappingNode):
                args = loader.construct_mapping(node, deep=True)
            elif isinstance(node, yaml.SequenceNode):
                args = loader.construct_sequence(node, deep=True)
            else:
                args = {}
            return Node(tag, suffix, args)
        return construct

    for tag in ("new", "name", "apply"):
        Loader.add_multi_constructor(f"!{tag}:", multi(tag))
    Loader.add_constructor("!ref", lambda loader, node: _Ref(loader.construct_scalar(node)))
    # yaml 1.1 reads "1e-06" as a string; accept it as a float like hyperpyyaml does.
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"), list("-+0123456789."))
    return Loader


def _resolve(value: Any, top: dict[str, Any], name: str = YAML_NAME) -> Any:
    if isinstance(value, _Ref):
        whole = re.fullmatch(r"\s*<([\w.]+)>\s*", str(value))
        if whole:  # a plain reference, possibly to a class entry (CosyVoice3's `generator: !ref <hift>`)
            return _resolve(top[whole.group(1)], top, name)
        expr = re.sub(r"<([\w.]+)>", lambda m: repr(_resolve(top[m.group(1)], top, name)), str(value))
        try:
            return eval(expr, {"__builtins__": {}}, {})  # arithmetic on literals only
        except Exception as exc:  # noqa: BLE001 - reported with the offending expression
            raise ReleaseError(f"{name}: cannot evaluate !ref {value!r}: {exc}") from None
    if isinstance(value, Node):
        return Node(value.tag, value.target, _resolve(value.args, top, name))
    if isinstance(value, dict):
        return {k: _resolve(v, top, name) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, top, name) for v in value]
    return value


def read_yaml(path: Path) -> dict[str, Any]:
    """Parse an official HyperPyYAML file into plain data (`Node` for class entries), refs resolved."""
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_loader())  # noqa: S506 - SafeLoader subclass
    except (OSError, yaml.YAMLError) as exc:
        raise ReleaseError(f"{path.name}: not a readable yaml file ({exc})") from None
    if not isinstance(raw, dict):
        raise ReleaseError(f"{path.name}: expected a mapping at the top level")
    top = {k: v for k, v in raw.items() if not k.startswith("__")}
    return {k: _resolve(v, top, path.name) for k, v in top.items()}


def load_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Load a torch state dict, upcast floating tensors to float32 (tiny releases store float16)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ReleaseError(f"{path.name}: missing from the release directory") from None
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a broken file
        raise ReleaseError(f"{path.name}: cannot be read as a torch checkpoint ({type(exc).__name__})") from None
    if not isinstance(state, dict):
        raise ReleaseError(f"{path.name}: expected a state dict, found {type(state).__name__}")
    return {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}


def fold_weight_norm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace weight-norm pairs by plain `.weight` tensors; accepts both key styles.

    New style: `<m>.parametrizations.weight.original0` (g) / `original1` (v);
    legacy style: `<m>.weight_g` / `<m>.weight_v`. Effective weight = g * v / ||v|| with the
    norm over every dim except 0.
    """
    out: dict[str, torch.Tensor] = {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        for g_suffix, v_suffix in ((".parametrizations.weight.original0", ".parametrizations.weight.original1"),
                                   (".weight_g", ".weight_v")):
            if key.endswith(g_suffix):
                pairs.setdefault(key[: -len(g_suffix)], {})["g"] = value
                break
            if key.endswith(v_suffix):
                pairs.setdefault(key[: -len(v_suffix)], {})["v"] = value
                break
        else:
            out[key] = value
    for prefix, gv in pairs.items():
        if set(gv) != {"g", "v"}:
            raise ReleaseError(f"weight-norm pair incomplete for {prefix!r}")
        v = gv["v"]
        norm = v.norm(dim=tuple(range(1, v.dim())), keepdim=True)
        out[prefix + ".weight"] = gv["g"] * v / norm
    return out


def check_state(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], file_name: str) -> None:
    """Strict key and shape check; the error names the file and the first offending key."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise ReleaseError(f"{file_name}: missing key {missing[0]!r}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise ReleaseError(f"{file_name}: unexpected key {unexpected[0]!r}" + (f" (+{len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    for key, shape in expected.items():
        if tuple(state[key].shape) != tuple(shape):
            raise ReleaseError(f"{file_name}: key {key!r} has shape {tuple(state[key].shape)}, expected {tuple(shape)}")


def sub_state(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under `prefix.` with the prefix removed."""
    p = prefix + "."
    return {k[len(p):]: v for k, v in state.items() if k.startswith(p)}


@dataclass(frozen=True)
class Release:
    """An official CosyVoice2 release directory, validated: files present, yaml and Qwen2 config parsed.

    `yaml_name` / `required_files` are class attributes so that a later family with the same layout
    (CosyVoice3: another yaml and speech tokenizer) subclasses this reader instead of copying it."""
    root: Path
    hparams: dict[str, Any]
    qwen_config: dict[str, Any]
    yaml_name: ClassVar[str] = YAML_NAME
    required_files: ClassVar[tuple[str, ...]] = REQUIRED_FILES

    @classmethod
    def open(cls, root: Path | str) -> "Release":
        root = Path(root)
        if not root.is_dir():
            raise ReleaseError(f"model directory {root.name!r} does not exist")
        for name in cls.required_files:
            if not (root / name).is_file():
                raise ReleaseError(f"{name}: missing from the release directory; copy the complete official release")
        hparams = read_yaml(root / cls.yaml_name)
        for key in ("llm", "flow", "hift", "sample_rate"):
            if key not in hparams:
                raise ReleaseError(f"{cls.yaml_name}: missing top-level key {key!r}")
        try:
            qwen_config = json.loads((root / "CosyVoice-BlankEN/config.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ReleaseError(f"CosyVoice-BlankEN/config.json: malformed JSON ({exc})") from None
        return cls(root, hparams, qwen_config)

    def checkpoint(self, name: str) -> dict[str, torch.Tensor]:
        """`llm.pt`, `flow.pt` or `hift.pt` as float32 tensors, weight norm folded, `generator.` stripped."""
        state = load_checkpoint(self.root / name)
        state = {k.removeprefix("generator."): v for k, v in state.items()}
        return fold_weight_norm(state)

    @property
    def has_spk2info(self) -> bool:
        return (self.root / "spk2info.pt").is_file()
