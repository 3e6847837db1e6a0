"""Setup shared by the harness's unit tests."""

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
