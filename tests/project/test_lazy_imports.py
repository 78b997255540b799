"""The packages resolve their public names on first use, so the launcher does
not import torch, capture (torch._dynamo) or the job runtime it never runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

import splitrun.runtime
import splitrun.runtime.cluster
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
                     "'splitrun.runtime.engine')))))")
    assert loaded == ""


def test_the_launcher_and_its_scheduler_import_no_torch():
    # The parent process only starts, watches and reports its children: torch
    # (0.8 s or more to import) is the children's. Labels, the scheduler and the
    # shm files' helpers are light; `place()` and `region()` import torch when called.
    loaded = _python("import sys, splitrun.launcher.cli, splitrun.launcher.supervisor, "
                     "splitrun.runtime.cluster, splitrun.runtime.rpc.tls; "
                     "print(' '.join(sorted(m for m in sys.modules "
                     "if m.split('.')[0] in ('torch', 'numpy'))))")
    assert loaded == ""


def test_a_module_of_the_cluster_room_loads_neither_the_scheduler_nor_grpc():
    # The step file is what a process and its launcher share at every step.
    loaded = _python("import sys, splitrun.runtime.cluster.step_file; "
                     "print(' '.join(sorted(m for m in sys.modules if m == 'grpc' or m in ("
                     "'splitrun.runtime.cluster.scheduler', "
                     "'splitrun.runtime.cluster.membership'))))")
    assert loaded == ""


def test_finding_a_restarts_checkpoint_imports_no_torch():
    # The launcher looks for the newest good periodic checkpoint between two
    # starts of a job: importing torch there took seconds on a loaded machine.
    loaded = _python("import sys, splitrun.runtime.checkpoints.periodic; "
                     "print(' '.join(sorted(m for m in sys.modules "
                     "if m.split('.')[0] in ('torch', 'numpy'))))")
    assert loaded == ""


def test_the_lazy_transport_packages_still_export_their_names():
    import splitrun.runtime.transport as transport
    import splitrun.runtime.transport.grpc as grpc_transport
    from splitrun.runtime.transport.grpc.transport import GrpcTransport
    from splitrun.runtime.transport.mailbox import Mailbox
    assert transport.Mailbox is Mailbox and grpc_transport.GrpcTransport is GrpcTransport
    for package in (transport, grpc_transport):
        assert all(getattr(package, name) is not None for name in package.__all__)


def test_place_and_region_still_label_without_torch_at_import():
    from torch import nn

    from splitrun.splitter import Label, place, placement_of, region
    assert placement_of(place(nn.Linear(2, 2), rank=1)) == str(Label.worker(1))
    with region(rank=0) as text:
        assert text == "w0"


def test_capture_is_the_function_whichever_module_is_imported_first():
    # The capturing module imported before the package's name is looked up
    # must not leave the package attribute pointing at a module.
    kind = _python("import splitrun.splitter.capturing.step; "
                   "from splitrun.splitter import capture; print(type(capture).__name__)")
    assert kind == "function"
    from splitrun.splitter import capture
    assert callable(capture) and capture.__module__ == "splitrun.splitter.capturing.step"


@pytest.mark.parametrize("package", [splitrun.splitter, splitrun.runtime,
                                     splitrun.runtime.cluster])
def test_every_public_name_resolves_and_dir_lists_it(package):
    for name in package.__all__:
        assert getattr(package, name) is not None
    assert set(package.__all__) <= set(dir(package))


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="'splitrun.splitter' has no attribute 'Captur'"):
        splitrun.splitter.Captur  # noqa: B018
    with pytest.raises(ImportError):
        exec("from splitrun.runtime import Jobb", {})
