"""What `pip install .` installs: the built wheel holds every module and data file of the source tree (an editable
install, the suite's own, would hide a missing one). `.ci/wheel_check` then installs that wheel in a fresh virtual
environment and runs the commands from another folder."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from tests.conftest import REPO

# Source folders and where the wheel puts them (pyproject.toml's package-dir).
INSTALLED_AS = {"finetune": "finetune", "ui": "finetune/ui", "configs": "finetune/shipped_recipes",
                "accelerate_configs": "finetune/accelerate_configs"}
SHIPPED = {".py", ".yaml", ".jinja", ".jsonl", ".sbatch"}


def source_files() -> set[str]:
    found = set()
    for folder, installed in INSTALLED_AS.items():
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and path.suffix in SHIPPED and "__pycache__" not in path.parts:
                found.add(f"{installed}/{path.relative_to(REPO / folder).as_posix()}")
    return found


def test_the_wheel_holds_every_module_and_data_file_of_the_source_tree(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(REPO)],
                   check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("finetune-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = {name for name in archive.namelist() if not name.startswith("finetune-")}
    missing = sorted(source_files() - in_wheel)
    assert not missing, f"the wheel lacks {missing}: add their packages to pyproject.toml"
    assert "finetune/hooks/transformers.py" in in_wheel and "finetune/shipped_recipes/quickstart.yaml" in in_wheel


def test_every_package_folder_is_a_regular_package():
    """No namespace packages: each folder that ships is a package with an __init__.py (and its one-line purpose)."""
    folders = {path.parent for folder in INSTALLED_AS for path in (REPO / folder).rglob("*")
               if path.is_file() and path.suffix in SHIPPED and "__pycache__" not in path.parts}
    bare = sorted(str(folder.relative_to(REPO)) for folder in folders if not (folder / "__init__.py").is_file()
                  and folder.parent != REPO)
    assert not bare, f"folders without an __init__.py: {bare}"
