"""Contract of ``sglang_sparse.mode_spec``: every registered mode's "module:attr" references resolve to callables
(so a moved or renamed module fails here, not at a GPU server's start), and a spec whose request options name a
config field its config class lacks, or whose config class belongs to another mode, is refused."""

import pytest

from sglang_sparse.config import PsaConfig
from sglang_sparse.mode_spec import RequestOption, SparseModeSpec, resolve
from sglang_sparse.modes import MODES


@pytest.mark.parametrize("name", sorted(MODES))
def test_every_registered_spec_resolves_its_references(name):
    spec = MODES[name]
    assert spec.name == name and spec.config_cls.mode == name
    if spec.backend_installer is not None:
        assert callable(resolve(spec.backend_installer))
    if spec.step_report is not None:
        assert callable(resolve(spec.step_report.summarize))
    if name in ("psa", "loopserve", "lastwindow"):  # attention-backend modes (samkv works at the front door)
        assert spec.backend_installer is not None


def test_a_spec_naming_a_missing_config_field_or_another_modes_config_is_refused():
    with pytest.raises(ValueError, match="lacks"):
        SparseModeSpec("psa", PsaConfig, "x", implemented=True,
                       request_options=(RequestOption("epsilon", 0.0, 1.0, floor_field="no_such_field"),))
    with pytest.raises(ValueError, match="config_cls.mode"):
        SparseModeSpec("loopserve", PsaConfig, "x", implemented=True)
    with pytest.raises((ModuleNotFoundError, AttributeError)):
        resolve("sglang_sparse.psa.backend:no_such_installer")
