"""Tokenizers: bytes for the built-in `tiny` model, a Hugging Face tokenizer.json otherwise.

The router tokenizes exactly as the engines do, so this module imports nothing from the rest
of the package (and no torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

BYTE_BOS, BYTE_EOS = 256, 257
"""The byte tokenizer's special ids, after the 256 byte values."""


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; 256 is BOS, 257 is EOS."""

    bos_token_id = BYTE_BOS
    eos_token_id: int | None = BYTE_EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json, read with the `tokenizers` library."""

    def __init__(self, path: Path, eos_token_id: int | None) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tok.decode(token_ids))


def load_tokenizer(model: str, eos_token_id: int | None = None) -> Tokenizer:
    """The tokenizer of `model`: "tiny", or a checkpoint directory with a tokenizer.json."""
    if model == "tiny":
        return ByteTokenizer()
    path = Path(model) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"model {model!r}: no tokenizer.json in {str(Path(model))!r}")
    return HFTokenizer(path, eos_token_id)
