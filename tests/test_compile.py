"""Every kernel of every preset compiles for sm_90a without a GPU, with the
instructions its design needs and no register spills or local memory."""

import pytest

from flintgen import cache, codegen
from flintgen.kernels import KERNELS
from flintgen.presets import PRESETS
from flintgen.runtime import load_variant

pytestmark = pytest.mark.compile


def _cases():
    from flintgen.kernels.base import Target

    t = Target("sm_90a", 132)
    for pname, spec in sorted(PRESETS.items()):
        for kname, kdef in KERNELS.items():
            if kdef.needed(spec):
                for v in kdef.variants(spec, t):
                    yield pytest.param(spec, kdef, v, id=f"{pname}-{v.name}")


@pytest.mark.parametrize("spec, kdef, variant", list(_cases()))
def test_variant_compiles_clean(spec, kdef, variant, sm90):
    load_variant(kdef, spec, variant, sm90)  # default cache root: reused across runs
    entry = cache.make_entry(variant, kdef.template_of(variant), dict(kdef.render_params(spec, variant)), sm90)
    meta = cache.read_meta(entry)
    res = meta["resources"]
    assert res["registers"] is not None, "no ptxas report captured"
    assert res["spill_store_bytes"] == 0 and res["spill_load_bytes"] == 0, res
    assert res["stack_bytes"] == 0 and not res["local_memory"], res
    with open(entry.path("kernel.ptx")) as f:
        ptx = f.read()
    assert ".target sm_90a" in ptx
    required = kdef.variant_ptx(variant) if hasattr(kdef, "variant_ptx") else kdef.required_ptx
    missing = [p for p in required if p not in ptx]
    assert not missing, f"PTX lacks {missing}"
    assert codegen.header(variant.kernel, kdef.template_of(variant), dict(kdef.render_params(spec, variant))) in entry.source
