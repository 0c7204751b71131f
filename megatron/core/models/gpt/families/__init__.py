"""The Hugging Face model families, one module each: adding a family is adding a module here.

A family module defines `FAMILIES`, a list of `base.Family` (its config-key map, the settings it
implies, its weight-name map). `registry()` is every module's families, in module order; the
conversion (`models.gpt.hf_mapping`), `tools/checkpoint/convert.py` and
`tools/verify_correctness.py` find a family here and nowhere else. docs/models.md says how to
write one.
"""
import importlib
import pkgutil

from megatron.core.models.gpt.families.base import Entry, Family, HFKey, IN_WEIGHTS

__all__ = ["Entry", "Family", "HFKey", "IN_WEIGHTS", "registry", "named", "of_hf_config"]


def registry() -> list:
    """Every family of the modules on this package's path (a module added to the path later,
    such as a test's, is found on the next call)."""
    found = []
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            found += getattr(importlib.import_module(f"{__name__}.{module.name}"), "FAMILIES", [])
    return found


def named(name: str) -> Family:
    """The family of a `transformers` model_type (`Family.name`)."""
    families = registry()
    for family in families:
        if family.name == name:
            return family
    raise ValueError(f"unsupported architecture {name!r}; supported: {tuple(f.name for f in families)}")


def of_hf_config(hf_config) -> Family:
    """The family claiming a `transformers` config: by its `architectures` entry when it has one
    (as a saved checkpoint's config.json does), else by its model_type. One error, listing the
    families, when none claims it."""
    families = registry()
    architectures = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    for family in families:
        if family.architecture in architectures or (not architectures and family.name == model_type):
            return family
    supported = ", ".join(f"{family.architecture} ({family.name})" for family in families)
    raise ValueError(f"unsupported Hugging Face model_type {model_type!r} (architectures {architectures}): no "
                     f"family claims it; supported: {supported}. A family is one module of "
                     f"megatron/core/models/gpt/families/ (docs/models.md)")
