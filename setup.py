"""Package discovery for the folder layout in DESIGN.md.

Metadata lives in pyproject.toml. This shim only maps the top-level code folders
(operator/, worker/, sim/) to sub-packages of ``tessera`` and discovers their
sub-packages. ``operator/`` has no ``__init__.py``: it is a namespace portion, so
from the repository root ``import operator`` still finds the standard library's
module (a regular module wins over a namespace portion) and nothing of Tessera is
importable as a top-level ``operator``.
"""

from setuptools import find_packages, setup

FOLDERS = {
    "tessera": "tessera",
    "tessera.operator": "operator",
    "tessera.worker": "worker",
    "tessera.sim": "sim",
}

packages: list[str] = []
package_dir: dict[str, str] = {}
for package, folder in FOLDERS.items():
    package_dir[package] = folder
    packages.append(package)
    packages += [f"{package}.{sub}" for sub in find_packages(where=folder)]

setup(packages=packages, package_dir=package_dir, include_package_data=True)
