"""A token's own bytes, for the ``bytes`` of OpenAI's logprob entries.

OpenAI defines ``bytes`` as the token's UTF-8 bytes, "useful in instances where characters are
represented by multiple tokens and their byte representations must be combined". Decoding one
token alone cannot give them: a byte-level BPE token that holds part of a character (SmolLM2
spells "😀" in three tokens) decodes to U+FFFD, whose bytes (EF BF BD) rebuild nothing. The
bytes come from the token's vocabulary piece instead:
  - byte-level BPE (GPT-2's scheme; the tokenizer's decoder is ``tokenizers``' ``ByteLevel``):
    each character of the piece stands for one byte (transformers' ``bytes_to_unicode`` table);
  - SentencePiece byte fallback: a piece ``<0xF0>`` is that byte; a word piece ``▁Paris`` is
    " Paris" (decoded alone its leading space is stripped);
  - anything else (special tokens, tokenizers without a vocabulary, the tests' fakes): the bytes
    of the token's decoded text, which is whole there.

Life cycle: ``ResponseFormat`` makes one per request that asks for logprobs (the router's
tokenizer is read per request: tests swap it), on the router's event loop; its per-id cache
lives as long as that request.
"""

from __future__ import annotations

import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPACE_MARKER = "\u2581"   # SentencePiece's word-leading space in vocabulary pieces


class TokenBytes:
    def __init__(self, tokenizer: Any | None) -> None:
        self._tokenizer = tokenizer
        self._from_char = _byte_level_table(tokenizer)
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int, text: str) -> bytes:
        """The bytes of ``token_id``, whose decoded text alone is ``text``."""
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._piece_bytes(token_id) or text.encode("utf-8")
        return found

    def _piece_bytes(self, token_id: int) -> bytes | None:
        convert = getattr(self._tokenizer, "convert_ids_to_tokens", None)
        piece = convert(token_id) if convert is not None else None
        if not isinstance(piece, str) or not piece:
            return None
        if (byte := _BYTE_PIECE.fullmatch(piece)) is not None:
            return bytes([int(byte.group(1), 16)])
        if self._from_char and all(ch in self._from_char for ch in piece):
            return bytes(self._from_char[ch] for ch in piece)
        if SPACE_MARKER in piece:   # a SentencePiece word piece: its marker is a space in the text
            return piece.replace(SPACE_MARKER, " ").encode("utf-8")
        return None   # a special or added token: its text is whole

    def text(self, token_id: int, decoded: str) -> str:
        """The token's text as it reads inside a text: ``decoded`` (the token decoded alone) with
        the leading spaces a SentencePiece decoder strips at a text's start put back from its
        vocabulary piece, as vLLM does ("▁Paris" decodes alone to "Paris")."""
        convert = getattr(self._tokenizer, "convert_ids_to_tokens", None)
        piece = convert(token_id) if convert is not None and not self._from_char else None
        if not isinstance(piece, str) or not piece.startswith(SPACE_MARKER):
            return decoded
        missing = (len(piece) - len(piece.lstrip(SPACE_MARKER))) - (len(decoded) - len(decoded.lstrip(" ")))
        return " " * missing + decoded if missing > 0 else decoded


def _byte_level_table(tokenizer: Any | None) -> dict[str, int]:
    """char -> byte for a byte-level BPE tokenizer; empty for any other."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if type(decoder).__name__ != "ByteLevel":
        return {}
    from transformers.convert_slow_tokenizer import bytes_to_unicode   # torch-free, and only here

    return {ch: b for b, ch in bytes_to_unicode().items()}
