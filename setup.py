# setuptools needs setup.py only for cffi_modules; everything else is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["tbrpc/_build.py:ffibuilder"])
