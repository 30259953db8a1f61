"""The planner tests' fake clusters, for the cost model's tests too."""

from tests.planner.conftest import fake_cluster

__all__ = ["fake_cluster"]
