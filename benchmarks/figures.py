"""Measured figures go into docs/ from the script that measured them: one markdown page per run.

Each page says what wrote it (the command), when, on what machine and with which versions, so a
figure is never retyped by hand and never loses its context.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys


def machine() -> str:
    """CPU model and cores, and the GPU if there is one."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = f"{cpu}, {os.cpu_count()} cores"
    import torch

    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
    else:
        text += ", no GPU"
    return text


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_page(path: str, title: str, body: str, packages: tuple = ()) -> None:
    """`body` (markdown) under a header naming the command, date, machine and versions (the recipes'
    packages, and `packages` the measurement also used)."""
    import importlib.metadata

    from common.outputs.run_info import package_versions

    command = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0]), *sys.argv[1:]])
    versions = {**package_versions(), **{name: importlib.metadata.version(name) for name in packages}}
    versions = ", ".join(f"{name} {version}" for name, version in versions.items() if version)
    header = (
        f"# {title}\n\n*Written by `{command}` on {datetime.date.today().isoformat()}; "
        f"{machine()}; {versions}. Do not edit by hand: run the command again.*\n\n"
    )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(header + body.rstrip() + "\n")
    print(f"figures: {path}")
