"""Keep every test's traffic on loopback and its threads few (CI has 2 cores)."""

import os

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MPLBACKEND", "Agg")


def pytest_collection_modifyitems(config, items):
    """The slow (multi-process) tests first, each file's in its order: pytest-xdist hands tests out in this order,
    so the suite ends on short tests that fill both workers, not on one long test while the other worker idles."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
