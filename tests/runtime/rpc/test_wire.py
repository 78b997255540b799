"""The generated gRPC code in runtime/rpc/wire/ matches proto/splitrun.proto."""

import pathlib

from splitrun.runtime.rpc.wire import generate


def test_generated_code_is_fresh(tmp_path):
    fresh = generate.generate(tmp_path)
    for path in fresh:
        checked_in = generate.WIRE / path.name
        assert checked_in.exists(), f"{checked_in} is missing; run `make proto`"
        assert checked_in.read_text() == path.read_text(), (
            f"{checked_in.name} is stale: proto/splitrun.proto changed since it was "
            f"generated; run `make proto` and commit the result")


def test_no_pickle_in_the_runtime():
    """Nothing read from the network may be unpickled; the one torch.load (of a
    checkpoint file the user names) loads weights only."""
    runtime = pathlib.Path(generate.WIRE).parents[1]
    for path in runtime.rglob("*.py"):
        text = path.read_text()
        assert "import pickle" not in text and "pickle.load" not in text, path
        for line in text.splitlines():
            if "torch.load(" in line:
                assert "weights_only=True" in line, f"{path}: {line.strip()}"
