"""Finding a format's opening marker in streamed text without ever showing a piece of it.

A marker such as ``<tool_call>`` can arrive split over several pieces, so text that could still
turn out to be its beginning is held back, as stop strings are, and released once the next piece
shows it is not. Whitespace right before a marker is held too: it may be the chat template's
layout between content and calls rather than content.
"""

from __future__ import annotations


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split_content(text: str, marker: str | tuple[str, ...], final: bool) -> tuple[str, int, bool]:
    """Split off the content at the start of ``text``, up to ``marker`` (or the first of
    several markers, whichever comes first).

    Returns the content that is safe to show, how many characters of ``text`` are used up
    (the content and, when found, the marker) and whether the marker was found. Whitespace at
    the end is held back unless the marker follows it (the caller decides what layout is). At
    the end of generation (``final``) nothing is held back: all of ``text`` is content.
    """
    markers = (marker,) if isinstance(marker, str) else marker
    found = [(at, -len(m)) for m in markers if (at := text.find(m)) >= 0]
    if found:
        at, longest = min(found)
        return text[:at], at - longest, True
    if final:
        return text, len(text), False
    safe = text[: len(text) - max(partial_marker(text, m) for m in markers)].rstrip()
    return safe, len(safe), False
