"""splitrun: split one PyTorch training step across processes and run them.

The rooms are subpackages: `splitrun.splitter` (capture, labels, the split
plan), `splitrun.runtime` (the job API, transport, cluster) and
`splitrun.launcher` (the `splitrun` command, also `python -m splitrun`).
This package (installed from `launcher/root/`) holds only that entry point.
"""
