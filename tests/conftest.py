"""Setup shared by the harness's unit tests."""

import pytest

from fa_verify.properties import reproduce


@pytest.fixture(autouse=True, scope="session")
def _reproducers_in_a_temporary_folder(tmp_path_factory):
    """`fa_verify check` writes failing examples' reproducers under the current folder unless
    told otherwise; tests that check failing targets write them into a temporary folder instead
    of the working tree."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reproduce, "DEFAULT_FOLDER", tmp_path_factory.mktemp("repro"))
        yield
