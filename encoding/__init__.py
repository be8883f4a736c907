"""DeepSeek-V4 text side: chat encoding, completion parsing (whole and streaming), tokenizer.

Re-exports the public API of `encoding_dsv4` (prompt rendering and the official parser,
byte-identical to DeepSeek's encoder for the "preview" and "0731" releases), `streaming` (the
incremental, recovering reasoning / content / DSML tool-call parser; `dsml` lexes its tags) and
`tokenizer` (tokenizer.json loading and detokenization).
"""

from .encoding_dsv4 import (
    ASSISTANT, BOS, DSML, EOS, RELEASES, THINK_END, THINK_START, USER, encode_messages,
    normalize_release, parse_message_from_completion_text, parse_official_completion, release_from_config,
)
from .streaming import StreamDelta, StreamingParser, ToolCallDelta
from .tokenizer import IncrementalDecoder, Tokenizer, load_tokenizer

__all__ = [
    "ASSISTANT", "BOS", "DSML", "EOS", "RELEASES", "THINK_END", "THINK_START", "USER",
    "encode_messages", "normalize_release", "parse_message_from_completion_text", "parse_official_completion",
    "release_from_config",
    "StreamDelta", "StreamingParser", "ToolCallDelta", "IncrementalDecoder", "Tokenizer", "load_tokenizer",
]
