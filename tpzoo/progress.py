"""Progress bars and the counts printed as they go: every bar tpzoo draws comes from `progress_bar`, so every one
follows the same switches; `human_count` writes a count as 1.2M.

tqdm reads TQDM_DISABLE (and the other TQDM_* variables) only for the arguments its caller leaves out, so a bar
created with an explicit `disable=` ignores it; here the environment always has the last word: TQDM_DISABLE=1
hides every bar, whatever a command's own flag (--quiet, --no-progress) asks for.
"""
from __future__ import annotations

import os

_OFF = ("", "0", "false", "no", "off")


def bars_disabled() -> bool:
    """TQDM_DISABLE is set to something other than an empty or false value (tqdm's spelling: 1, True, ...)."""
    return os.environ.get("TQDM_DISABLE", "").strip().lower() not in _OFF


def progress_bar(enabled: bool = True, **kw):
    """A tqdm bar (kw: tqdm's arguments), drawn only when `enabled` and not TQDM_DISABLE."""
    from tqdm import tqdm

    return tqdm(disable=not enabled or bars_disabled(), **kw)


def human_count(n: float, digits: int = 2) -> str:
    """A count with a K / M / B suffix (`digits` decimals), below a thousand as a whole number: 1.24B, 869.50K."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.{digits}f}{unit}"
    return f"{n:.0f}"
