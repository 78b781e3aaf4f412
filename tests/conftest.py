"""Shared paths and fixtures. `../shared` (stand-in teachers and datasets) sits beside the checkout in CI;
in a user's fresh clone it is absent and the tests that need it skip, saying so."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FIXTURES = REPO / "tests" / "fixtures"


def shared_path(*parts: str) -> Path:
    """A path under ../shared, or skip the calling test when it is absent."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(
            f"{path} is absent: the stand-in weights and datasets live in ../shared beside the checkout"
        )
    return path


@pytest.fixture(scope="session")
def standin_gpt2():
    from dofmini import load

    return load(shared_path("weights", "standin-gpt2"))


@pytest.fixture(scope="session")
def standin_pythia():
    from dofmini import load

    return load(shared_path("weights", "standin-pythia"))
