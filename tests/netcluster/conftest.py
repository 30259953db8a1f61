"""Skip the tests that build a network where namespaces cannot be made (not root, no ip)."""

from __future__ import annotations

import pytest

from hspmd.netcluster import run
from hspmd.netcluster.spec import NetClusterError


@pytest.fixture
def netns() -> None:
    """Skip unless this process may make network namespaces and none of ours exist."""
    try:
        run.check_permission(probe=True)
    except NetClusterError as error:
        pytest.skip(str(error))
    if run.existing():
        pytest.skip(f"a netcluster is already up ({', '.join(run.existing())}): not touching it")
