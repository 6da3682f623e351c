"""Token ids to streamed text: the pieces, joined, are exactly the final text.

Each ``add`` decodes a window of the sequence: the tokens since the last settled point with those
before it as context (a piece decoded alone would turn a character split across tokens into U+FFFD,
and a tokenizer's leading-space rule applies only at a sequence's start: it applies to both decodes
of the window alike, so their difference is the new text). The window moves on once its text ends
in whole characters. Decoding the whole sequence at every token instead cost O(n) per token: at 32
streams of 256 tokens it was half the event loop's time (py-spy on the H200, benchmarks/RESULTS.md).
The new text is handed out less a trailing incomplete character and any tail that could still become
a stop string; a stop string ends the text before it (``stopped``). Without a tokenizer the text is
the token ids, space-separated.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # the text of ids[:read]
        self.prefix = self.read = 0  # the window: ids[prefix:] decoded, ids[prefix:read] its settled context
        self.sent = ""  # handed out so far
        self.stopped = False

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tok is None:
            return " ".join(map(str, ids))
        return str(self.tok.decode(list(ids)))

    def _decoded(self, final: bool) -> str:
        """The text of all ids so far, from the window (ids[:read] settled before)."""
        window = self._decode(self.ids[self.prefix:])
        context = self._decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        if not window.startswith(context):  # the decoder rewrote the context: decode from the start once
            window, context, self.prefix, self.read, self.text = self._decode(self.ids), "", 0, 0, ""
        text = self.text + window[len(context):]
        if final or not window.endswith("\ufffd"):  # whole characters: the window moves on
            self.text, self.prefix, self.read = text, self.read, len(self.ids)
        return text

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        """The new piece after ``ids`` (``final``: nothing more comes; release what was held)."""
        if self.stopped:
            return ""
        self.ids.extend(int(t) for t in ids)
        if not ids and not final:
            return ""
        text = self._decoded(final)
        if not text.startswith(self.sent):  # a decoder that rewrote earlier text: go on from the common part
            text = self.sent + text[len(os.path.commonprefix([text, self.sent])):]
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            return self._hand_out(text[:cut])
        if not final:
            text = text.rstrip("\ufffd")
            text = text[:len(text) - self._held(text)]
        return self._hand_out(text)

    def _hand_out(self, text: str) -> str:
        if len(text) <= len(self.sent):
            return ""
        piece = text[len(self.sent):]
        self.sent = text
        return piece

    def _first_stop(self, text: str) -> int | None:
        if not self.stop:
            return None
        start = max(0, len(self.sent) - max(len(s) for s in self.stop))  # the text before was checked already
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held(self, text: str) -> int:
        """Characters at the end of ``text`` that begin some stop string (they may complete it)."""
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:n]):
                    held = n
                    break
        return max(0, min(held, len(text) - len(self.sent)))
