"""Where a number option's value must lie: declared in its annotation, checked in one line.

    seed: Annotated[int, Range(0, 2**32 - 1, why="numpy's seeds are 32-bit")] = 42

`check_ranges` refuses the first value of a dataclass of options outside its declared range;
`common.options.parsing` calls it for every class it parses, a recipe's own included.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass

from common.launch.errors import UsageError


@dataclass(frozen=True)
class Range:
    """Where a number option's value must lie: `low`/`high` inclusive, `above`/`below` exclusive; a
    float must also be finite. `why` says what the bound is, or what to do. Declared in the
    option's annotation, so that it sits beside the option and argparse never sees it."""

    low: float | None = None
    high: float | None = None
    above: float | None = None
    below: float | None = None
    why: str = ""

    def refusal(self, key: str, value) -> str | None:
        """The one-line error for `value` of option `key`, or None if it lies in the range (or is unset)."""
        if value is None or isinstance(value, bool):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"--{key} must be a finite number, got {value}"
        if (
            (self.low is None or value >= self.low)
            and (self.high is None or value <= self.high)
            and (self.above is None or value > self.above)
            and (self.below is None or value < self.below)
        ):
            return None
        lower = f"[{self.low}" if self.low is not None else f"({self.above}" if self.above is not None else None
        upper = f"{self.high}]" if self.high is not None else f"{self.below})" if self.below is not None else None
        if lower and upper:
            bound = f"in {lower}, {upper}"
        elif lower:
            bound = f"{'>=' if self.low is not None else '>'} {lower[1:]}"
        else:
            bound = f"{'<=' if self.high is not None else '<'} {upper[:-1]}"
        return f"--{key} must be {bound}{f' ({self.why})' if self.why else ''}, got {value}"


def check_ranges(arguments) -> None:
    """Refuse, in one line, the first value of a dataclass of options outside its declared `Range`."""
    for name, declared in _declared_ranges(type(arguments)).items():
        problem = declared.refusal(name, getattr(arguments, name))
        if problem:
            raise UsageError(problem)


@functools.lru_cache(maxsize=None)
def _declared_ranges(cls) -> dict:
    hints = typing.get_type_hints(cls, include_extras=True)  # HfArgumentParser reads them without the extras
    names = [f.name for f in dataclasses.fields(cls)]
    return {
        name: extra for name in names for extra in getattr(hints[name], "__metadata__", ()) if isinstance(extra, Range)
    }


AT_LEAST_0, AT_LEAST_1 = Range(low=0), Range(low=1)
