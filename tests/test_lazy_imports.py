"""The packages resolve their public names on first use, so the launcher does
not import capture (torch._dynamo) or the job runtime it never runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

import splitrun.runtime
import splitrun.splitter


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_launcher_imports_neither_dynamo_nor_the_job_runtime():
    loaded = _python("import sys, splitrun.launcher.cli; "
                     "print(' '.join(sorted(m for m in sys.modules if m.startswith("
                     "('torch._dynamo', 'torch.distributed.checkpoint', "
                     "'splitrun.splitter.capturing', 'splitrun.runtime.job', "
                     "'splitrun.runtime.executor')))))")
    assert loaded == ""


def test_capture_is_the_function_whichever_module_is_imported_first():
    # The capturing module imported before the package's name is looked up
    # must not leave the package attribute pointing at a module.
    kind = _python("import splitrun.splitter.capturing; "
                   "from splitrun.splitter import capture; print(type(capture).__name__)")
    assert kind == "function"
    from splitrun.splitter import capture
    assert callable(capture) and capture.__module__ == "splitrun.splitter.capturing"


@pytest.mark.parametrize("package", [splitrun.splitter, splitrun.runtime])
def test_every_public_name_resolves_and_dir_lists_it(package):
    for name in package.__all__:
        assert getattr(package, name) is not None
    assert set(package.__all__) <= set(dir(package))


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="'splitrun.splitter' has no attribute 'Captur'"):
        splitrun.splitter.Captur  # noqa: B018
    with pytest.raises(ImportError):
        exec("from splitrun.runtime import Jobb", {})
