"""pytest fixtures over terrapipe.testing: ``pytest_plugins = ["terrapipe.testing.fixtures"]``.

``emulated_cluster(nodes, link="1gbit")`` makes a :class:`~terrapipe.testing.cluster.Cluster`
that lives until the test ends; where none can be made (not root, no ``ip netns``) the test is
skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from .cluster import Cluster, available


@pytest.fixture
def emulated_cluster() -> Iterator[Callable[..., Cluster]]:
    why = available()
    if why is not None:
        pytest.skip(why)
    made: list[Cluster] = []

    def make(nodes: int, link: str | None = "1gbit") -> Cluster:
        cluster = Cluster(nodes, link).__enter__()
        made.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            cluster.close()
