"""Tokenizers and chat templates: bytes for `tiny`, a GGUF file's vocabulary, a tokenizer.json.

    load_tokenizer(model) -> Tokenizer          model as `source.resolve_model` takes it
    tokenizer.encode(text) / decode(ids)        no special tokens added: the engine sees the text
    tokenizer.apply_chat_template(messages, tools=...)   the prompt text, as transformers renders it
    tokenizer.token_bytes()                     each token's bytes in the text (for grammars)

A GGUF file's byte-level BPE (`tokenizer.ggml.model` "gpt2") is rebuilt from its vocabulary and
merges with the `tokenizers` library, its control tokens (`<|im_start|>`, ...) kept whole, so it
splits text exactly as transformers' tokenizer from the same file does. Chat templates are
Jinja, rendered in a sandbox (a template is data from a model file), with transformers'
settings: trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `tojson`,
`strftime_now`, and the special tokens by name.

The router tokenizes (and renders chats) exactly as the engines do, so this module imports
nothing from the rest of the package but the model's location, and no torch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from kvconnect.model.source import ModelKind, gguf_metadata, resolve_model

BYTE_BOS, BYTE_EOS = 256, 257
"""The byte tokenizer's special ids, after the 256 byte values."""

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
"""The byte model has no special tokens: a plain "role: content" transcript."""

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """A chat could not be rendered: no template, or the template refused the messages."""


class Tokenizer(Protocol):
    eos_token_id: int | None
    chat_template: str | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...
    def token_bytes(self) -> list[bytes]: ...
    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Message] | None = None,
    ) -> str: ...


class _Chat:
    """`apply_chat_template` for tokenizers that know their template and special tokens."""

    chat_template: str | None = None
    special_tokens: dict[str, str] = {}

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Message] | None = None,
    ) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template")
        return render_chat(
            self.chat_template, messages, add_generation_prompt, self.special_tokens, tools
        )


class ByteTokenizer(_Chat):
    """UTF-8 bytes as token ids 0..255; 256 is BOS, 257 is EOS."""

    bos_token_id = BYTE_BOS
    eos_token_id: int | None = BYTE_EOS
    chat_template: str | None = TINY_CHAT_TEMPLATE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> list[bytes]:
        """Each token's bytes in the text; b"" for BOS and EOS (they show no text)."""
        return [bytes([b]) for b in range(256)] + [b"", b""]


class HFTokenizer(_Chat):
    """A `tokenizers` tokenizer (from a tokenizer.json, or rebuilt from a GGUF vocabulary)."""

    def __init__(
        self,
        tokenizer: Any,
        eos_token_id: int | None,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self._tok = tokenizer
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_file(cls, path: Path, eos_token_id: int | None) -> HFTokenizer:
        """tokenizer.json, with the chat template and special tokens of the directory."""
        from tokenizers import Tokenizer as _Tokenizer

        directory = path.parent
        config: dict[str, Any] = {}
        if (directory / "tokenizer_config.json").is_file():
            config = json.loads((directory / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if template is None and (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text()
        if not (template is None or isinstance(template, str)):
            raise ValueError(f"{directory}: a chat_template that is not one string is unsupported")
        special = {
            k: v["content"] if isinstance(v, dict) else v
            for k, v in config.items()
            if k.endswith("_token") and isinstance(v, str | dict)
        }
        return cls(_Tokenizer.from_file(str(path)), eos_token_id, template, special)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=True))

    def token_bytes(self) -> list[bytes]:
        """Each token id's bytes in the decoded text (what a grammar matches), b"" for the
        special tokens, which `decode` drops. Byte-level BPE pieces map back through GPT-2's
        byte alphabet; a piece outside it (an added token) is its UTF-8 text."""
        alphabet = {c: b for b, c in enumerate(_byte_chars())}
        vocab: dict[str, int] = self._tok.get_vocab(with_added_tokens=True)
        out = [b""] * (max(vocab.values(), default=-1) + 1)
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        for piece, i in vocab.items():
            if piece in special:
                continue
            if all(c in alphabet for c in piece):
                out[i] = bytes(alphabet[c] for c in piece)
            else:
                out[i] = piece.encode()
        return out


def gguf_tokenizer(path: Path) -> HFTokenizer:
    """The byte-level BPE tokenizer a GGUF file describes, with its chat template."""
    from tokenizers import AddedToken, decoders, pre_tokenizers
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers.models import BPE

    meta = gguf_metadata(path)
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in ("default", "gpt2", "smollm"):
        raise ValueError(
            f"{path}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported "
            "(supported: byte-level BPE, tokenizer.ggml.model 'gpt2', pre 'gpt2' or 'smollm')"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    if "tokenizer.ggml.merges" not in meta:
        raise ValueError(f"{path}: a byte-level tokenizer without tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = _Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = _byte_alphabet()
    # 3 is CONTROL (kept whole, special), 4 USER_DEFINED (kept whole, not special); a control
    # token outside the byte alphabet is a converter's mislabel and is left alone.
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types, strict=True)
            if ty == 3 and set(t) <= alphabet
        ]
    )
    tok.add_tokens(
        [AddedToken(t, normalized=False) for t, ty in zip(tokens, types, strict=True) if ty == 4]
    )
    special = {
        name: tokens[meta[f"tokenizer.ggml.{key}"]]
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
        if f"tokenizer.ggml.{key}" in meta
    }
    return HFTokenizer(
        tok, meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.chat_template"), special
    )


@lru_cache(maxsize=1)
def _byte_chars() -> tuple[str, ...]:
    """The printable character byte-level BPE writes each byte as (GPT-2's mapping)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return tuple(chars)


def _byte_alphabet() -> set[str]:
    return set(_byte_chars())


def load_tokenizer(model: str, eos_token_id: int | None = None) -> Tokenizer:
    """The tokenizer of `model` ("tiny", "smollm2", a .gguf file or a checkpoint directory)."""
    source = resolve_model(model)
    if source.kind is ModelKind.TINY:
        return ByteTokenizer()
    assert source.path is not None
    if source.kind is ModelKind.GGUF:
        return gguf_tokenizer(source.path)
    path = source.path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"model {model!r}: no tokenizer.json in {str(source.path)!r}")
    return HFTokenizer.from_file(path, eos_token_id)


# -- chat templates -----------------------------------------------------------------------------


def render_chat(
    template: str,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    tools: Sequence[Message] | None = None,
) -> str:
    """`template` applied to `messages`, as transformers' `apply_chat_template` renders it;
    `tools` (OpenAI's function tools) are the template's `tools`, which a template that
    does not mention them ignores (as in transformers and vLLM)."""
    try:
        compiled = _compile(template)
        text: str = compiled.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tools=[dict(t) for t in tools] if tools else None,
            documents=None,
            **(special_tokens or {}),
        )
    except ChatTemplateError:
        raise
    except Exception as e:  # a template is a program from a model file; any failure is its
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
    return text


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    def tojson(value: Any, indent: int | None = None, **kwargs: Any) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent, **kwargs)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env.from_string(template)
