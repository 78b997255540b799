"""The launcher's side of the template process: which processes it forks.
(Forked processes themselves, through the real launcher, are
tests/e2e/test_start_methods_e2e.py's.)"""

from __future__ import annotations

import subprocess
import sys

from splitrun.launcher.forked import exec_reason
from splitrun.launcher.template import BOOTSTRAP_MODULE

BOOTSTRAP = [sys.executable, "-m", BOOTSTRAP_MODULE, "--parent-pid", "7", "job.py"]


def test_a_process_is_forked_where_it_differs_in_splitruns_variables_only():
    template = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "SPLITRUN_DEVICE": "cpu"}
    own = {**template, "SPLITRUN_ROLE": "worker", "SPLITRUN_RANK": "1",
           "SPLITRUN_DEVICE": "cuda"}
    assert exec_reason(BOOTSTRAP, own, template) is None
    # What a shell sets for each command (a standing template and the launches it
    # serves start from different shells): nothing imports it.
    assert exec_reason(BOOTSTRAP, {**own, "_": "/usr/bin/timeout", "SHLVL": "3",
                                   "PWD": "/tmp", "OLDPWD": "/"}, template) is None
    # Read when torch is imported (the template's imports): must be the template's.
    assert exec_reason(BOOTSTRAP, {**own, "OMP_NUM_THREADS": "2"}, template) == \
        "its environment differs from the template's in OMP_NUM_THREADS"
    assert exec_reason(BOOTSTRAP, {**own, "CUDA_VISIBLE_DEVICES": "0"}, template) == \
        "its environment differs from the template's in CUDA_VISIBLE_DEVICES"
    without_path = {k: v for k, v in own.items() if k != "PATH"}
    assert "differs from the template's in PATH" in exec_reason(BOOTSTRAP, without_path,
                                                                template)


def test_a_command_other_than_the_bootstrap_starts_with_exec():
    for argv in ([sys.executable, "-c", "pass"], ["python3", *BOOTSTRAP[1:]]):
        assert exec_reason(argv, {}, {}).startswith("its command is not the bootstrap's")


def test_the_template_preloads_the_installed_modules_a_script_imports_first():
    from splitrun.launcher.script_imports import installed, leading_imports

    script = '"""A job."""\n' \
        "from __future__ import annotations\n" \
        "import json, numpy.linalg\n" \
        "from sklearn.datasets import load_digits\n" \
        "from . import sibling\n" \
        "import os\n" \
        "os.environ['OMP_NUM_THREADS'] = '1'\n" \
        "import scipy  # after the script's first statement: left to the script\n"
    assert leading_imports(script) == ["json", "numpy.linalg", "sklearn.datasets",
                                       "sklearn.datasets.load_digits", "os"]
    assert leading_imports("def broken(:\n") == []
    assert installed("json") and installed("numpy.linalg") and installed("sklearn.datasets")
    # the user's own modules (here the tests' helpers and splitrun's worktree) and
    # what is not there at all
    assert not installed("ps_models") and not installed("splitrun.splitter")
    assert not installed("no_such_module_anywhere")


def test_the_templates_imports_leave_logging_as_a_fresh_process_has_it():
    # fbgemm_gpu logs while it loads, and logging then gives the root logger a
    # default handler; a forked process's bootstrap would take that logger for
    # configured and its log and progress lines would be lost.
    def root_handlers_after(code: str) -> int:
        out = subprocess.run([sys.executable, "-c", code + "\nimport logging\n"
                              "print(len(logging.root.handlers))"],
                             capture_output=True, text=True, timeout=120, check=True)
        return int(out.stdout.split()[-1])

    assert root_handlers_after("import fbgemm_gpu") == 1  # what the template must undo
    assert root_handlers_after("from splitrun.launcher.template import preload_modules, "
                               "preload_script_imports\n"
                               "assert preload_modules(('fbgemm_gpu',)) is None") == 0
