"""Text a tokenizer can take: valid Unicode, i.e. encodable as UTF-8.

Python strings can hold lone surrogates (U+D800..U+DFFF) that no UTF-8 text has: JSON's
``"\\ud800"`` escape makes one, and so do invalid UTF-8 bytes on a command line (Python decodes
argv with ``surrogateescape``). The tokenizers library refuses them with a TypeError about its
input types; ssdlib names the problem instead.
"""

from __future__ import annotations

from ssdlib.errors import ConfigError


def check_unicode(text: str, what: str = "the prompt") -> str:
    """``text`` when it is valid Unicode, else a :class:`ConfigError` naming the first lone
    surrogate and where it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{what} is not valid Unicode text: a lone surrogate "
                          f"(U+{ord(text[e.start]):04X}) at character {e.start} (invalid UTF-8 "
                          f"bytes in the input, or a \\u escape of half a pair)") from None
    return text
