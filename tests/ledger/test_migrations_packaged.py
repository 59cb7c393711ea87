"""The migrations live in the checkout's top-level ``alembic/`` and ship inside the ledger
package (as ``ledger/migrations``), so an installed wheel migrates as a checkout does.

`scripts/check-wheel` (run by CI) builds the wheel and runs the installed product end to end;
these tests catch the usual ways to break it in a second, without a build.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from alembic.script import ScriptDirectory

from ledger.store.db import ALEMBIC_DIR, _alembic_config

_ROOT = Path(__file__).resolve().parents[2]
_PYPROJECT = _ROOT / "pyproject.toml"


def _files(folder: Path) -> set[Path]:
    return {
        path for path in folder.rglob("*") if path.is_file() and "__pycache__" not in path.parts
    }


def _setuptools() -> dict[str, object]:
    config: dict[str, object] = tomllib.loads(_PYPROJECT.read_text())["tool"]["setuptools"]
    return config


def test_a_checkout_migrates_from_its_top_level_alembic_folder() -> None:
    assert _ROOT / "alembic" == ALEMBIC_DIR
    assert (ALEMBIC_DIR / "env.py").is_file()
    assert (ALEMBIC_DIR / "script.py.mako").is_file()


def test_the_wheel_packs_the_alembic_folder_as_the_ledgers_migrations() -> None:
    config = _setuptools()
    assert config["package-dir"] == {"ledger.migrations": "alembic"}
    patterns = config["package-data"]["ledger.migrations"]  # type: ignore[index]
    shipped = {path for pattern in patterns for path in ALEMBIC_DIR.glob(pattern)}
    assert _files(ALEMBIC_DIR) <= shipped


def test_the_package_list_names_every_package_of_the_tree() -> None:
    found = {
        ".".join(init.parent.relative_to(_ROOT).parts)
        for top in ("ledger", "router", "otel")
        for init in (_ROOT / top).rglob("__init__.py")
    }
    assert set(_setuptools()["packages"]) == found | {"ledger.migrations"}  # type: ignore[call-overload]


def test_the_checkouts_alembic_folder_never_shadows_the_alembic_library() -> None:
    # With the checkout first on sys.path (as pytest and `python -m` from the root put it),
    # `import alembic` must still be the library: the folder has no __init__.py.
    assert not (ALEMBIC_DIR / "__init__.py").exists()
    found = subprocess.run(
        [sys.executable, "-c", "import alembic.command, sys; print(alembic.command.__file__)"],
        cwd=_ROOT,
        env={"PYTHONPATH": str(_ROOT)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert not Path(found).resolve().is_relative_to(_ROOT / "alembic")


def test_every_revision_file_is_one_revision_of_one_line_of_history() -> None:
    scripts = ScriptDirectory.from_config(_alembic_config("sqlite://"))
    revision_files = sorted((ALEMBIC_DIR / "versions").glob("*.py"))
    assert len(list(scripts.walk_revisions())) == len(revision_files)
    assert len(scripts.get_heads()) == 1
