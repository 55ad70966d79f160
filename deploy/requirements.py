"""Prints the build backend's requirements and one extra's, as pyproject.toml lists them, one per
line: what an image installs before its sources are copied, so that a code change rebuilds only
the layers after them. Run from the folder holding pyproject.toml: python requirements.py EXTRA"""

import sys

try:
    import tomllib
except ImportError:  # Python 3.10 (the ROCm base image): pip's own copy of tomli
    from pip._vendor import tomli as tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)
print(
    *project["build-system"]["requires"], *project["project"]["optional-dependencies"][sys.argv[1]], sep="\n"
)
