"""The one build step pyproject.toml cannot declare: the contracts (the top-level ``topics/``
and ``schemas/`` folders, kept at the top where people edit them) are copied into the wheel as
package data under ``pipeline/_contracts/``, where ``pipeline/contracts.py`` finds them. Without
it a wheel or non-editable install had no topic spec or schema and could not start."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CONTRACTS = ("topics", "schemas")


class BuildWithContracts(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the checkout's folders themselves
        root = Path(__file__).resolve().parent
        for name in CONTRACTS:
            target = Path(self.build_lib) / "pipeline" / "_contracts" / name
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(root / name, target)


setup(cmdclass={"build_py": BuildWithContracts})
