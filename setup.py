"""Everything is in pyproject.toml but one file: ``kvblend-legacy.pth``, which a wheel install puts
beside the ``kvblend`` package so that the old import names work for one more release
(``kvblend.engine.legacy``)."""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "kvblend-legacy.pth"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        shutil.copy(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildWithPth})
