"""Bytes and times as people read them, for every printout (plans, reports, nn blocks)."""

from __future__ import annotations

import math

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int) -> str:
    """Bytes in binary units with about three digits: "48 B", "1.0 KiB", "2.5 MiB", "128 KiB".

    >>> format_bytes(1024), format_bytes(48), format_bytes(3 * 2**20 // 2), format_bytes(2**17)
    ('1.0 KiB', '48 B', '1.5 MiB', '128 KiB')
    """
    if n < 1024:
        return f"{n} B"
    k = min(int(math.log(n, 1024)), len(_UNITS) - 1)
    value = n / 1024**k
    if round(value, 1) >= 1024 and k + 1 < len(_UNITS):
        k, value = k + 1, value / 1024
    return f"{value:.{1 if round(value, 1) < 100 else 0}f} {_UNITS[k]}"


def format_us(seconds: float) -> str:
    """Seconds as microseconds with three significant digits and no exponent.

    >>> format_us(1.024e-08), format_us(2.5e-5), format_us(0.0), format_us(0.0123)
    ('0.0102', '25.0', '0', '12300')
    """
    us = seconds * 1e6
    if us == 0:
        return "0"
    places = max(0, 2 - math.floor(math.log10(abs(us))))
    return f"{us:.{places}f}"
