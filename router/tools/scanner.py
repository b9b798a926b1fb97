"""Reading one call object, ``{"name": "f", "arguments": {...}}``, as its text streams in (or
a bare arguments value whose name came in the markup: :meth:`CallScanner.arguments_of`).

Every format wraps the same object in different markup, so this is the one place that knows
JSON: where a key, a string or a nested value ends, which value is the name and which the
arguments. The arguments value is passed through as the model wrote it (not re-serialized), each
part as soon as it is certainly inside the value, so a client sees the arguments grow while the
model writes them.
"""

from __future__ import annotations

import json

_WS = " \t\r\n"
# Characters that may stand outside strings inside a JSON value: numbers, true/false/null,
# separators. Anything else (a "<" of a closing tag, say) means the model lost the JSON.
_BARE = frozenset(" \t\r\n,:0123456789+-.eEtrufalsn")
_CLOSER = {"{": "}", "[": "]"}

# Where the scanner is in the call object.
_OPEN, _KEY_OR_CLOSE, _KEY, _COLON, _VALUE_START, _VALUE, _AFTER_VALUE, _DONE, _BROKEN = range(9)
# What the value being read is for.
_SKIP, _NAME, _ARGS = range(3)


class CallScanner:
    """One call object's reader: feed it text until :attr:`done` (or :attr:`broken`).

    :attr:`name` is set once the name string is complete; :meth:`take_arguments` returns the
    arguments text read since it was last called, but only once the name is known (arguments
    written before the name wait). A call object without an arguments key gets ``{}``.
    """

    __slots__ = (
        "index", "name", "_keys", "_state", "_key_raw", "_key", "_role", "_name_raw", "_args",
        "_args_seen", "_kind", "_stack", "_in_str", "_esc", "_bare",
    )

    def __init__(self, argument_keys: tuple[str, ...] = ("arguments",)) -> None:
        self.index: int | None = None
        """The call's index in its parser, set by the parser when it starts the call."""
        self.name: str | None = None
        self._keys = argument_keys
        self._state = _OPEN
        self._key_raw: list[str] = []
        self._key = ""
        self._role = _SKIP
        self._name_raw: list[str] = []
        self._args: list[str] = []
        self._args_seen = False
        self._kind = ""  # of the value being read: "string", "container" or "literal"
        self._stack: list[str] = []  # closers expected inside a container value
        self._in_str = False
        self._esc = False
        self._bare = False  # an arguments value alone (arguments_of): done when it ends

    @classmethod
    def arguments_of(cls, name: str) -> "CallScanner":
        """A reader of one bare JSON arguments value (no call object around it) for a call
        named ``name``: Mistral's ``[TOOL_CALLS]name[ARGS]{...}``. :attr:`done` once the value
        has ended; whitespace before it is skipped."""
        scanner = cls()
        scanner.name, scanner._key, scanner._state, scanner._bare = name, scanner._keys[0], _VALUE_START, True
        return scanner

    @property
    def done(self) -> bool:
        """The object's closing brace (a bare value's end) has been read."""
        return self._state == _DONE

    @property
    def broken(self) -> bool:
        """The text stopped being a call object; the scanner reads no further."""
        return self._state == _BROKEN

    def take_arguments(self) -> str:
        """Arguments text read since the last call (empty until the name is known)."""
        if self.name is None or not self._args:
            return ""
        out = "".join(self._args)
        self._args.clear()
        return out

    def feed(self, text: str) -> int:
        """Read ``text`` up to the object's closing brace, or up to the first character that
        cannot be part of a call object; return how many characters were read."""
        for i, c in enumerate(text):
            state = self._state
            if state == _DONE or state == _BROKEN:
                return i
            if state == _VALUE:
                if not self._value_char(c):
                    if self._state == _BROKEN:
                        return i
                    continue
                state = self._state  # a literal ended before c: read c as what follows it
                if state == _DONE:  # a bare value's end: c is not ours
                    return i
            if c in _WS and state != _KEY:
                continue
            if state == _KEY:
                self._key_char(c)
            elif state == _OPEN:
                self._state = _KEY_OR_CLOSE if c == "{" else _BROKEN
            elif state == _KEY_OR_CLOSE:
                if c == '"':
                    self._state = _KEY
                    self._key_raw.clear()
                else:
                    self._close_or_break(c)
            elif state == _COLON:
                self._state = _VALUE_START if c == ":" else _BROKEN
            elif state == _VALUE_START:
                self._start_value(c)
            elif state == _AFTER_VALUE:
                if c == ",":
                    self._state = _KEY_OR_CLOSE
                else:
                    self._close_or_break(c)
            if self._state == _BROKEN:
                return i
        return len(text)

    def _close_or_break(self, c: str) -> None:
        if c != "}":
            self._state = _BROKEN
            return
        self._state = _DONE
        if not self._args_seen:
            self._args_seen = True
            self._args.append("{}")

    def _key_char(self, c: str) -> None:
        if self._esc:
            self._esc = False
        elif c == "\\":
            self._esc = True
        elif c == '"':
            try:
                self._key = json.loads('"' + "".join(self._key_raw) + '"')
            except ValueError:
                self._state = _BROKEN
                return
            self._state = _COLON
            return
        self._key_raw.append(c)

    def _start_value(self, c: str) -> None:
        key = self._key
        if key == "name" and c == '"' and self.name is None and not self._name_raw:
            self._role = _NAME
        elif key in self._keys and not self._args_seen:
            self._role = _ARGS
        else:
            self._role = _SKIP
        self._state, self._in_str, self._esc, self._stack = _VALUE, False, False, []
        if c == '"':
            self._kind, self._in_str = "string", True
        elif c in _CLOSER:
            self._kind = "container"
            self._stack.append(_CLOSER[c])
        elif c in "-0123456789tfn":
            self._kind = "literal"
        else:
            self._state = _BROKEN
            return
        self._keep(c)

    def _value_char(self, c: str) -> bool:
        """Read one character of a value; True when the value ended before it (a literal)."""
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
                if self._kind == "string":
                    self._keep(c)
                    self._end_value()
                    return False
            self._keep(c)
            return False
        if self._kind == "literal":
            if c in ",}]" or c in _WS:
                self._end_value()
                return True
            if c not in _BARE:
                self._state = _BROKEN
                return False
            self._keep(c)
            return False
        # Inside an object or array, outside strings.
        if c == '"':
            self._in_str = True
        elif c in _CLOSER:
            self._stack.append(_CLOSER[c])
        elif c == "}" or c == "]":
            if c != self._stack.pop():
                self._state = _BROKEN
                return False
            if not self._stack:
                self._keep(c)
                self._end_value()
                return False
        elif c not in _BARE:
            self._state = _BROKEN
            return False
        self._keep(c)
        return False

    def _keep(self, c: str) -> None:
        if self._role == _ARGS:
            self._args.append(c)
        elif self._role == _NAME:
            self._name_raw.append(c)

    def _end_value(self) -> None:
        self._state = _AFTER_VALUE
        if self._role == _ARGS:
            self._args_seen = True
            if self._bare:
                self._state = _DONE
        elif self._role == _NAME:
            try:
                name = json.loads("".join(self._name_raw))
            except ValueError:
                name = None
            self.name = name if isinstance(name, str) and name else None  # "" names nothing
            self._name_raw.clear()
