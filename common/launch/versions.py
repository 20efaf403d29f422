"""Whether the installed libraries are inside the version ranges common/launch/internals.py's uses were checked on."""

from __future__ import annotations

import importlib.metadata

from common.launch.internals import CHECKED, USES


def in_checked_range(installed: str, lowest: str, first_unchecked: str) -> bool:
    """lowest <= installed < first_unchecked, releases ordered: 1.15 = 1.15.0 > 1.15.0rc1; 1.16.0rc1 >= 1.16."""
    from packaging.version import Version

    def release(version):
        return Version(version).release + (0,) * (4 - len(Version(version).release))

    return Version(installed) >= Version(lowest) and release(installed) < release(first_unchecked)


def outside_checked_range() -> list[str]:
    """One line for each installed library whose version leaves the range its uses were checked on."""
    lines = []
    for library, (lowest, first_unchecked) in CHECKED.items():
        try:
            installed = importlib.metadata.version(library)
        except importlib.metadata.PackageNotFoundError:
            continue
        if not in_checked_range(installed, lowest, first_unchecked):
            uses = "; ".join(use.what for use in USES if use.library == library)
            lines.append(
                f"{library} {installed} is outside the range common/launch/internals.py was checked on "
                f"(>={lowest},<{first_unchecked}); its uses of {library}'s internals may break: {uses}"
            )
    return lines
