"""Package discovery for the wheel and the sdist; every other setting is in pyproject.toml.

``treespec/`` installs as ``treespec``, ``kernels/`` as ``treespec.kernels`` and ``heads/`` as
``treespec.heads`` (the layout the design fixes). Every package below the three is found by
setuptools, not listed by hand, so a new folder cannot be left out of what users install
(``tests/test_install.py`` builds both and installs the wheel into a fresh environment).
"""

from setuptools import find_packages, setup

MAPPED = {"treespec.kernels": "kernels", "treespec.heads": "heads"}  # package -> its folder


def packages() -> list[str]:
    found = find_packages(include=["treespec", "treespec.*"])
    for package, folder in MAPPED.items():
        found += [package, *(f"{package}.{sub}" for sub in find_packages(where=folder))]
    return found


setup(packages=packages(), package_dir={"treespec": "treespec", **MAPPED})
