"""flintgen: a code-generating kernel compiler for LLM decode on NVIDIA Hopper.

A model ``Spec`` goes in; Jinja2 templates are rendered into specialized CuTe
DSL modules, compiled for sm_90a and cached on disk; ``get_kernel(spec)``
returns the ops.
"""

from flintgen._version import __version__
from flintgen.cache import MissingKernelError
from flintgen.hf import spec_from_hf_config
from flintgen.presets import PRESETS, get_preset
from flintgen.rope_tables import rope_table
from flintgen.runtime import KernelSet, get_kernel, warmup
from flintgen.spec import Spec

__all__ = ["__version__", "Spec", "PRESETS", "get_preset", "get_kernel", "warmup", "KernelSet",
           "MissingKernelError", "rope_table", "spec_from_hf_config"]
