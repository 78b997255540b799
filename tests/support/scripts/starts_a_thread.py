"""A module that starts a thread when imported: preloaded into the launcher's
template (--preload starts_a_thread), it makes the template unsafe to fork
from (tests/e2e/test_start_methods_e2e.py)."""

import threading

_never = threading.Event()
threading.Thread(target=_never.wait, daemon=True, name="started-at-import").start()
