"""The migrations ship inside the ledger package, so an installed wheel can migrate.

`scripts/check-wheel` (run by CI) builds the wheel and runs the installed product end to end;
these tests catch the usual ways to break it in a second, without a build.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from alembic.script import ScriptDirectory

import ledger
from ledger.db import ALEMBIC_DIR, _alembic_config

_ROOT = Path(__file__).resolve().parents[2]
_PYPROJECT = _ROOT / "pyproject.toml"


def _files(folder: Path) -> set[Path]:
    return {
        path for path in folder.rglob("*") if path.is_file() and "__pycache__" not in path.parts
    }


def test_the_migrations_live_inside_the_ledger_package() -> None:
    assert Path(ledger.__file__).parent / "migrations" == ALEMBIC_DIR
    assert (ALEMBIC_DIR / "env.py").is_file()
    assert (ALEMBIC_DIR / "script.py.mako").is_file()


def test_package_data_names_every_migration_file() -> None:
    setuptools = tomllib.loads(_PYPROJECT.read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["ledger.migrations"]
    shipped = {path for pattern in patterns for path in ALEMBIC_DIR.glob(pattern)}
    assert _files(ALEMBIC_DIR) - {ALEMBIC_DIR / "__init__.py"} <= shipped


def test_every_revision_file_is_one_revision_of_one_line_of_history() -> None:
    scripts = ScriptDirectory.from_config(_alembic_config("sqlite://"))
    revision_files = sorted((ALEMBIC_DIR / "versions").glob("*.py"))
    assert len(list(scripts.walk_revisions())) == len(revision_files)
    assert len(scripts.get_heads()) == 1


def test_no_revision_lives_outside_the_package() -> None:
    # A revision left in the old top-level alembic/ folder would be neither shipped nor run.
    assert not list((_ROOT / "alembic").rglob("*.py"))
