"""The OpenRLHF versions this glue supports, checked when it touches OpenRLHF."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

SUPPORTED = ((0, 11), (0, 12))  # [0.11, 0.12)
SUPPORTED_TEXT = ">=0.11,<0.12"


def _parse(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split("+")[0].split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def check_openrlhf_version(installed: str | None = None) -> str:
    """Return the installed OpenRLHF version, or raise ImportError saying what to install."""
    if installed is None:
        try:
            installed = version("openrlhf")
        except PackageNotFoundError:
            raise ImportError(
                f"sparsecorr-openrlhf needs OpenRLHF {SUPPORTED_TEXT}, which is not installed: "
                f"pip install 'openrlhf{SUPPORTED_TEXT}'"
            ) from None
    v = _parse(installed)[:2]
    if not (SUPPORTED[0] <= v < SUPPORTED[1]):
        raise ImportError(
            f"sparsecorr-openrlhf supports OpenRLHF {SUPPORTED_TEXT}, found {installed}: "
            f"pip install 'openrlhf{SUPPORTED_TEXT}' or upgrade sparsecorr-openrlhf"
        )
    return installed
