# All metadata lives in setup.cfg; this shim lets pip build the project.
from setuptools import setup

setup()
