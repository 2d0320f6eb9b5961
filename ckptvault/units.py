"""How sizes and durations are shown to people: in messages of every layer, and in the CLI's tables."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """Decimal units (1 KB = 1,000 bytes, 1 MB = 10^6), as docs/usage.md says: "1.23 KB", "999 B"."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        shown = f"{n:.0f}" if unit == "B" else f"{n:.2f}"
        # the unit is chosen by the figure as shown: 999,999 bytes round to "1.00 MB", not "1000.00 KB"
        if abs(float(shown)) < 1000 or unit == "TB":
            return f"{shown} {unit}"
        n /= 1000
    return f"{n} B"  # pragma: no cover


def format_rate(nbytes: float, seconds: float) -> str:
    """A transfer rate: "412 MB/s"; under 1 MB/s in smaller units ("864.26 KB/s", not "0 MB/s")."""
    rate = nbytes / seconds if seconds > 0 else 0.0
    return f"{rate / 1e6:.0f} MB/s" if rate >= 1e6 else f"{format_bytes(rate)}/s"


def counted(n: int, noun: str) -> str:
    """ "1 file", "2 files", "0 files"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def format_seconds(s: float) -> str:
    """A duration for a message: "1", "1.5", "62.5", "1090" (not "62.4579" nor "1.09e+03")."""
    return f"{s:.1f}".removesuffix(".0") if s < 100 else f"{s:.0f}"


def format_duration(seconds: float) -> str:
    """``90`` -> "1m30s", ``3600`` -> "1h": as a user writes it for --retry-lock, whole seconds kept."""
    whole = round(seconds)
    if whole < 1:
        return f"{seconds:g}s"
    parts = [(whole // 86400, "d"), (whole % 86400 // 3600, "h"), (whole % 3600 // 60, "m"), (whole % 60, "s")]
    return "".join(f"{n}{unit}" for n, unit in parts if n)
