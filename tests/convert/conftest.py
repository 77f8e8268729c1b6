import pytest

from tests.convert.tiny_models import ARCHS, make_tiny_model


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """arch -> directory of a saved tiny random model (built once per session)."""
    root = tmp_path_factory.mktemp("tiny_hf")
    out = {}
    for arch in ARCHS:
        d = root / arch
        make_tiny_model(arch, d)
        out[arch] = d
    return out
