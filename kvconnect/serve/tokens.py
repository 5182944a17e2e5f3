"""vLLM's tokenizer endpoints: the bodies of POST /tokenize and POST /detokenize.

/tokenize answers with the tokens the engine runs for the same prompt or messages, so that a
router that tokenizes through it (vllm-router does) hashes the blocks this instance publishes.
`add_special_tokens` is accepted and adds nothing, because kvconnect puts no special tokens
around a prompt in any endpoint. For SmolLM2 that is vLLM's answer too: a byte-level BPE gets
a BOS only when its file says `add_bos_token`, and SmolLM2's does not; the byte model (tiny,
kvconnect's own) never starts a prompt with its BOS. A checkpoint whose tokenizer.json adds a
BOS (Llama's) would get one from vLLM and gets none here, in /tokenize as in completions.
"""

from __future__ import annotations

import msgspec

from kvconnect.api.protocol import ApiError
from kvconnect.api.tokenize import TokenizeChatRequest, TokenizeCompletionRequest
from kvconnect.engine.llm import EngineInfo
from kvconnect.model.tokenizer import BYTE_BOS, BYTE_EOS, ByteTokenizer, HFTokenizer, Tokenizer
from kvconnect.serve.prepare import render


def tokenize_body(info: EngineInfo, req: TokenizeCompletionRequest | TokenizeChatRequest) -> bytes:
    """The response body: the prompt's tokens as the engine would run them. Runs on a
    worker thread, as `prepare` does."""
    tok = info.tokenizer
    if isinstance(req, TokenizeChatRequest):
        text = render(
            tok,
            req.conversation(),
            req.add_generation_prompt,
            req.continue_final_message,
            req.tool_dicts(),
        )
        tokens, param = tok.encode(text), "messages"
    else:
        tokens, param = tok.encode(req.prompt), "prompt"
    _check_length(info, len(tokens), param)
    return msgspec.json.encode(
        {
            "count": len(tokens),
            "max_model_len": info.max_model_len,
            "tokens": tokens,
            "token_strs": _token_strs(tok, tokens) if req.return_token_strs else None,
        }
    )


def detokenize_body(info: EngineInfo, tokens: list[int]) -> bytes:
    vocab = info.vocab_size
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(
            f"tokens[{bad}]={tokens[bad]} is not in the vocabulary [0, {vocab})", "tokens"
        )
    _check_length(info, len(tokens), "tokens")
    return msgspec.json.encode({"prompt": _decode(info.tokenizer, tokens)})


def _check_length(info: EngineInfo, num_tokens: int, param: str) -> None:
    """vLLM's limit on both endpoints: no more tokens than the model's context."""
    limit = info.max_model_len
    if num_tokens > limit:
        raise ApiError(
            f"{param}: {num_tokens} tokens is more than the model's context of {limit} "
            "tokens (max_model_len)",
            param,
        )


def _token_strs(tok: Tokenizer, tokens: list[int]) -> list[str]:
    """Each token's piece of the vocabulary, as vLLM's `convert_ids_to_tokens` gives it (a
    byte-level BPE writes a leading space as "Ġ"). The byte model's pieces: printable ASCII as
    itself, any other byte as "<0xNN>" (how byte-fallback vocabularies name bytes), and its
    two specials as "<bos>", "<eos>"."""
    if isinstance(tok, HFTokenizer):
        # `Tokenizer` offers no piece lookup: the `tokenizers` object behind it does.
        return [tok._tok.id_to_token(t) or "" for t in tokens]
    if isinstance(tok, ByteTokenizer):
        return [_BYTE_PIECES.get(t) or _byte_piece(t) for t in tokens]
    return [tok.decode([t]) for t in tokens]


_BYTE_PIECES = {BYTE_BOS: "<bos>", BYTE_EOS: "<eos>"}


def _byte_piece(t: int) -> str:
    return chr(t) if 0x20 <= t < 0x7F else f"<0x{t:02X}>"


def _decode(tok: Tokenizer, tokens: list[int]) -> str:
    """The text of `tokens` with special tokens kept, as vLLM's /detokenize decodes (so that a
    rendered chat comes back whole); the byte model's specials have no text."""
    if isinstance(tok, HFTokenizer):
        # `Tokenizer.decode` drops special tokens (for generated text): decode underneath.
        return str(tok._tok.decode(tokens, skip_special_tokens=False))
    return tok.decode(tokens)


__all__ = ["detokenize_body", "tokenize_body"]
