"""Setup shared by the harness's unit tests."""

from pathlib import Path

import pytest

from fa_verify.properties.reproduce import FOLDER_VARIABLE


@pytest.fixture(autouse=True, scope="session")
def _reproducers_in_a_temporary_folder(tmp_path_factory):
    """`fa_verify check` writes failing examples' reproducers under the current folder unless
    told otherwise; in tests (and the commands they start) into a temporary folder instead of
    the working tree."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FOLDER_VARIABLE, str(tmp_path_factory.mktemp("repro")))
        yield


#: Node ids that run only with -m slow: the default suite's longest tests (the file says why).
SLOW_BY_TIME = Path(__file__).with_name("slow_by_time.txt")


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by marker
def pytest_collection_modifyitems(items):
    """Mark the tests listed in SLOW_BY_TIME slow (properties/ included: this hook sees every item)."""
    listed = {line.strip() for line in SLOW_BY_TIME.read_text().splitlines() if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
