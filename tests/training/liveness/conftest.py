import pytest

from tests.training.liveness.helpers import close_all, endpoints


@pytest.fixture
def ranks():
    """``endpoints`` whose sockets are closed after the test, whatever it did."""
    made = []

    def make(*args, **kwargs):
        lives, acted = endpoints(*args, **kwargs)
        made.extend(lives)
        return lives, acted

    yield make
    close_all(made)
