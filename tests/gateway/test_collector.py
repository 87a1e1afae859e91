"""tune_for_serving freezes what is alive and raises the young threshold; cycles made
afterwards are still collected. In a child process: freezing this one would keep every
test's garbage."""

from __future__ import annotations

import subprocess
import sys

_CHILD = """
import gc, weakref
from kvrelay.gateway.collector import YOUNG_THRESHOLD, tune_for_serving
class Node: pass
before = gc.get_threshold()
tune_for_serving()
assert gc.get_freeze_count() > 1000, gc.get_freeze_count()  # the imports
assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:]), gc.get_threshold()
a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made while serving
gone = weakref.ref(a)
del a, b
gc.collect()
assert gone() is None
print("ok")
"""


def test_serving_freezes_the_start_and_still_collects_later_cycles():
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


_GATEWAY = """
import gc, sys, uvicorn
served = []
uvicorn.run = lambda app, **kw: served.append((app, gc.get_freeze_count(), gc.get_threshold()[0]))
from kvrelay.cli import main
sys.argv = ["kvrelay", "gateway", "--upstream", "http://127.0.0.1:9", "--database-url",
            "sqlite+aiosqlite:///" + sys.argv[1]]
try:
    main()
except SystemExit as exit:
    assert not exit.code, exit.code
(app, frozen, young), = served
assert frozen > 1000 and young == 20000, (frozen, young)
print("ok")
"""


def test_kvrelay_gateway_serves_with_the_collector_set(tmp_path):
    done = subprocess.run([sys.executable, "-c", _GATEWAY, str(tmp_path / "g.db")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
