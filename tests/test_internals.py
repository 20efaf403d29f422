"""Other libraries' internals are used in one place only, and only on the versions they were checked on."""

import ast
import importlib
import importlib.metadata
import re

import pytest
from conftest import REPO

from common.launch import internals, versions


PUBLIC = {"os._exit"}  # documented public API, named with an underscore
SOURCES = sorted(
    [*REPO.glob("common/**/*.py"), *REPO.glob("recipes/*.py"), *REPO.glob("scripts/*.py")]
    + [*REPO.glob("benchmarks/*.py")]
)


def private_uses(source: str) -> list[str]:
    """`x._name` (but self._name / cls._name), getattr/hasattr/setattr(x, "_name"), and
    `from library import _name` or `from library._module import ...`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if ast.unparse(node) in PUBLIC:
                continue
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("_")
            and not str(node.args[1].value).startswith("__")
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and not node.module.startswith("common")
            and node.module != "__future__"
        ):
            if any(part.startswith("_") for part in node.module.split(".")) or any(
                alias.name.startswith("_") for alias in node.names
            ):
                found.append(f"{node.lineno}: from {node.module} import ...")
    return found


def test_the_finder_finds_each_kind_of_private_use():
    source = (
        "import torch\nfrom torch.x import _y\nfrom torch._z import w\nmodel._init_weights(m)\n"
        "getattr(tqdm, '_instances', ())\nself._ok = 1\nobj.__class__\n"
    )
    assert sorted(line.split(":")[0] for line in private_uses(source)) == ["2", "3", "4", "5"]


def test_no_private_attribute_of_another_library_is_used_outside_common_internals():
    outside = {
        str(path.relative_to(REPO)): uses
        for path in SOURCES
        if path.name != "internals.py"
        if (uses := private_uses(path.read_text()))
    }
    # The project's own private names, reached across its own modules: none may stand here either.
    assert not outside, (
        "private attributes used outside common/launch/internals.py (move each into it, with the "
        f"versions it was checked on): {outside}"
    )


def test_every_library_with_an_internal_use_has_a_checked_range():
    """Each use names its library, which has a range of versions that parse and are in order, and the
    function of common/launch/internals.py that holds it (its `why` starts with the function's name)."""
    from packaging.version import Version

    libraries = {use.library for use in internals.USES} - {"python"}
    assert libraries <= set(internals.CHECKED), libraries - set(internals.CHECKED)
    for library, (lowest, first_unchecked) in internals.CHECKED.items():
        assert Version(lowest) < Version(first_unchecked), library
    for use in internals.USES:
        # "function: ..." for one of common/launch/internals.py, "common/<module>.py's function" for one elsewhere
        elsewhere = re.match(r"common/([\w/]+)\.py's (\w+)", use.why)
        module = importlib.import_module(f"common.{elsewhere[1].replace('/', '.')}") if elsewhere else internals
        holders = {elsewhere[2]} if elsewhere else set(re.findall(r"\w+", use.why.split(":")[0]))
        assert any(callable(getattr(module, name, None)) for name in holders), (
            f"{use}: its why names no function of {module.__name__} that holds the use"
        )


@pytest.mark.parametrize("library", sorted(internals.CHECKED))
def test_installed_versions_are_the_ones_the_internals_were_checked_on(library):
    try:
        installed = importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{library} is not installed here")
    lowest, first_unchecked = internals.CHECKED[library]
    uses = "; ".join(use.what for use in internals.USES if use.library == library)
    assert not [line for line in versions.outside_checked_range() if line.startswith(f"{library} ")], (
        f"{library} {installed} leaves the range common/launch/internals.py was checked on "
        f"(>={lowest},<{first_unchecked}): "
        f"check these uses against it, fix what broke, then widen CHECKED: {uses}"
    )


@pytest.mark.parametrize(
    "installed, inside",
    [
        ("2.13.0", True),
        ("2.13.0+cpu", True),
        ("2.13", True),
        ("2.13.5.post1", True),
        ("2.13.1rc1", True),
        ("2.13.0rc1", False),
        ("2.13.0.dev20260101", False),
        ("2.12.9", False),  # before the lowest checked
        ("2.14", False),
        ("2.14.0rc1", False),
        ("2.14.0+cu128", False),
        ("3.0", False),
    ],
)  # the first unchecked on
def test_the_range_check_orders_versions_as_releases_are(installed, inside):
    assert versions.in_checked_range(installed, "2.13.0", "2.14") is inside
    assert versions.in_checked_range("1.15", "1.15.0", "1.16")  # a two-part version is its .0


def test_a_version_outside_the_range_gives_one_line_naming_the_uses(monkeypatch):
    monkeypatch.setitem(internals.CHECKED, "torch", ("0.1", "0.2"))
    lines = versions.outside_checked_range()
    assert len(lines) == 1 and lines[0].startswith("torch ") and "(>=0.1,<0.2)" in lines[0], lines
    assert "_get_ddp_logging_data" in lines[0]


def test_make_install_pins_torch_to_the_checked_range():
    makefile = (REPO / "Makefile").read_text()
    lowest, first_unchecked = internals.CHECKED["torch"]
    assert f"TORCH_RANGE := torch>={lowest},<{first_unchecked}\n" in makefile
    assert '"$(TORCH_RANGE)"' in makefile  # what a GPU host installs
